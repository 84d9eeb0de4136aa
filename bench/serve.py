"""Output tokens/s of `tandem serve` over HTTP vs `transformers` `generate` with padded batches.

Same model (small and medium presets), same prompts, same sampling (temperature 1.0, top_p 1.0,
ignore_eos so every sample has its fixed length), same output token count, same torch thread count,
same run. The server gets 64 concurrent `/generate` requests with n=4 (mixed prompt and output
lengths). transformers gets the same 64 x 4 sequences as left-padded batches of `--hf-batch`
prompts x `num_return_sequences=4`, each batch generating up to its longest requested output (only
the requested tokens count):
- **arrival order** (the baseline of the acceptance ratio): prompts batched in the order the
  workload produces them, which is how a user of `generate` batches requests whose output lengths
  are not known in advance;
- **sorted** (for transparency): prompts sorted by requested output length before batching, an
  oracle a real user does not have (it minimises the padding of outputs).
Both sides are warmed up, then timed `--reps` times, interleaved (server, arrival, sorted, server, ...)
so drifting load on a shared machine hits all alike; medians are reported. The server's prefix
cache is flushed before every repetition so no repetition reuses an earlier one's prompts.
Run: `.venv/bin/python bench/serve.py`; prints a table and appends it to docs/benchmarks.md
(`--no-report` to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch
import transformers
from _report import append_benchmark

from tandem.models.tiny import init_model

N_PROMPTS, N_SAMPLES = 64, 4
Work = list[tuple[list[int], int]]


def workload(seed: int, vocab: int) -> Work:
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(16, 256))], rng.randint(16, 128))
            for _ in range(N_PROMPTS)]


def start_server(model: Path, threads: int, device: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model), "--port", "0", "--num-threads",
           str(threads), "--kv-cache-tokens", "65536", "--max-num-seqs", "256", "--device", device]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    m = re.search(r"listening on (http://\S+)", line)
    if m is None:
        raise RuntimeError(f"server did not start: {line}{proc.stdout.read()}")
    return proc, m.group(1)


async def wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(600):
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("server not healthy after 60 s")


async def run_http(url: str, work: Work) -> tuple[int, float]:
    """One repetition: flush the prefix cache, then all requests at once -> (output tokens, seconds)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        async def one(ids: list[int], n_out: int) -> int:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n_out, "n": N_SAMPLES,
                                                          "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}}
            async with s.post(url + "/generate", json=body) as r:
                outs = await r.json()
                return sum(o["meta_info"]["completion_tokens"] for o in outs)

        async with s.post(url + "/flush_cache") as r:
            assert r.status == 200, await r.text()
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(ids, n) for ids, n in work))
        return sum(counts), time.perf_counter() - start


def hf_batches(work: Work, batch: int, order: str) -> list[Work]:
    items = sorted(work, key=lambda w: w[1]) if order == "sorted" else list(work)
    return [items[i:i + batch] for i in range(0, len(items), batch)]


@torch.inference_mode()
def hf_generate(model, chunk: Work, device: str, max_new: int | None = None) -> int:
    pad = 0
    width = max(len(ids) for ids, _ in chunk)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in chunk], device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in chunk], device=device)
    longest = max_new or max(n for _, n in chunk)
    model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                   top_k=0, max_new_tokens=longest, min_new_tokens=longest, num_return_sequences=N_SAMPLES,
                   pad_token_id=pad)
    return sum(n for _, n in chunk) * N_SAMPLES  # only the requested tokens count


def run_hf(model, work: Work, batch: int, device: str, order: str) -> tuple[int, float]:
    """One repetition of the whole workload with `generate` -> (counted output tokens, seconds)."""
    tokens, start = 0, time.perf_counter()
    for chunk in hf_batches(work, batch, order):
        tokens += hf_generate(model, chunk, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["small", "medium"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=16, help="prompts per transformers batch (x4 sequences)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per side (median reported)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = ["| preset | params | tandem serve tok/s | hf arrival tok/s | **ratio (arrival)** | hf sorted tok/s "
            "| ratio (sorted) | output tokens | tandem s | hf arrival s | hf sorted s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            model_dir = init_model(Path(tmp) / preset, arch="qwen3", preset=preset, seed=0)
            vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
            work = workload(0, vocab)
            proc, url = start_server(model_dir, args.threads, args.device)
            try:
                asyncio.run(wait_ready(url))
                model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
                model = model.to(args.device).eval()
                asyncio.run(run_http(url, work))  # warm-up: the whole workload once
                hf_generate(model, work[: args.hf_batch], args.device, max_new=8)  # warm-up
                # Repetitions interleave the three runs, so drifting load on a shared machine hits
                # all of them alike; the server is idle (no CPU) while transformers runs.
                runs: dict[str, list[tuple[int, float]]] = {"srv": [], "arrival": [], "sorted": []}
                for _ in range(args.reps):
                    runs["srv"].append(asyncio.run(run_http(url, work)))
                    runs["arrival"].append(run_hf(model, work, args.hf_batch, args.device, "arrival"))
                    runs["sorted"].append(run_hf(model, work, args.hf_batch, args.device, "sorted"))
            finally:
                proc.terminate()
                proc.wait(30)
            counts = {t for r in runs.values() for t, _ in r}
            assert len(counts) == 1, counts  # same output tokens counted on every side and repetition
            srv_tokens = arr_tokens = srt_tokens = counts.pop()
            srv_times, arr_times, srt_times = ([t for _, t in runs[k]] for k in ("srv", "arrival", "sorted"))
            params = sum(p.numel() for p in model.parameters())
            srv_s, arr_s, srt_s = (statistics.median(t) for t in (srv_times, arr_times, srt_times))
            a, b, c = srv_tokens / srv_s, arr_tokens / arr_s, srt_tokens / srt_s
            rows.append(f"| {preset} | {params / 1e6:.1f}M | {a:,.0f} | {b:,.0f} | **{a / b:.2f}x** | {c:,.0f} "
                        f"| {a / c:.2f}x | {srv_tokens} | {srv_s:.1f} | {arr_s:.1f} | {srt_s:.1f} |")
            print(rows[-1], flush=True)
            print(f"  {preset} seconds per repetition: tandem {[round(t, 2) for t in srv_times]}, "
                  f"hf arrival {[round(t, 2) for t in arr_times]}, hf sorted {[round(t, 2) for t in srt_times]}",
                  flush=True)
    table = "\n".join(rows)
    print("\n" + table)
    if not args.no_report:
        body = (f"`bench/serve.py`: {N_PROMPTS} concurrent `/generate` requests x n={N_SAMPLES} (prompts 16-256 "
                f"tokens, outputs 16-128 tokens, ignore_eos, temperature 1.0) over HTTP vs transformers `generate` "
                f"(left-padded batches of {args.hf_batch} prompts x {N_SAMPLES}, each batch generating up to its "
                f"longest output, only requested tokens counted; **arrival order** = the acceptance baseline, "
                f"*sorted* = batches formed after sorting by output length, an oracle), {args.threads} torch "
                f"threads each, device {args.device}, fp32; warm-up, then the median of {args.reps} repetitions "
                f"per side, repetitions interleaved (prefix cache flushed before each server repetition).\n\n{table}")
        append_benchmark("Inference server throughput (tandem serve vs transformers)", body)


if __name__ == "__main__":
    main()
