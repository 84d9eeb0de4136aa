"""Output tokens/s of `tandem serve` over HTTP vs `transformers` `generate` with padded batches.

Same model (small and medium presets), same prompts, same sampling (temperature 1.0, top_p 1.0,
ignore_eos so every sample has its fixed length), same output token count, same torch thread count,
same run. The server gets 64 concurrent `/generate` requests with n=4 (mixed prompt and output
lengths); transformers gets the same 64 x 4 sequences as left-padded batches (prompts sorted by
output length, `--hf-batch` prompts per batch, `num_return_sequences=4`, each batch generating its
longest length; only the requested tokens count). Run: `.venv/bin/python bench/serve.py`; prints a
table and appends it to docs/benchmarks.md (`--no-report` to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
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


def workload(seed: int, vocab: int) -> list[tuple[list[int], int]]:
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


async def run_http(url: str, work: list[tuple[list[int], int]]) -> tuple[int, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        for _ in range(600):  # wait for /health
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        warm = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 4}}
        async with s.post(url + "/generate", json=warm) as r:
            await r.read()

        async def one(ids, n_out):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n_out, "n": N_SAMPLES,
                                                          "temperature": 1.0, "ignore_eos": True}}
            async with s.post(url + "/generate", json=body) as r:
                outs = await r.json()
                return sum(o["meta_info"]["completion_tokens"] for o in outs)

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(ids, n) for ids, n in work))
        return sum(counts), time.perf_counter() - start


@torch.inference_mode()
def run_hf(model_dir: Path, work: list[tuple[list[int], int]], batch: int, device: str) -> tuple[int, float]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    pad = 0
    ordered = sorted(work, key=lambda w: w[1])
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(ordered), batch):
        chunk = ordered[i:i + batch]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in chunk], device=device)
        longest = max(n for _, n in chunk)
        model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                       top_k=0, max_new_tokens=longest, min_new_tokens=longest, num_return_sequences=N_SAMPLES,
                       pad_token_id=pad)
        tokens += sum(n for _, n in chunk) * N_SAMPLES  # only the requested tokens count
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["small", "medium"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=16, help="prompts per transformers batch (x4 sequences)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = ["| preset | params | tandem serve tok/s | transformers tok/s | ratio | output tokens | tandem s | hf s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            model_dir = init_model(Path(tmp) / preset, arch="qwen3", preset=preset, seed=0)
            vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
            work = workload(0, vocab)
            proc, url = start_server(model_dir, args.threads, args.device)
            try:
                srv_tokens, srv_s = asyncio.run(run_http(url, work))
            finally:
                proc.terminate()
                proc.wait(30)
            hf_tokens, hf_s = run_hf(model_dir, work, args.hf_batch, args.device)
            assert srv_tokens == hf_tokens, (srv_tokens, hf_tokens)
            params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(model_dir).parameters())
            a, b = srv_tokens / srv_s, hf_tokens / hf_s
            rows.append(f"| {preset} | {params / 1e6:.1f}M | {a:,.0f} | {b:,.0f} | {a / b:.2f}x | {srv_tokens} "
                        f"| {srv_s:.1f} | {hf_s:.1f} |")
            print(rows[-1], flush=True)
    table = "\n".join(rows)
    print("\n" + table)
    if not args.no_report:
        body = (f"`bench/serve.py`: {N_PROMPTS} concurrent `/generate` requests x n={N_SAMPLES} (prompts 16-256 "
                f"tokens, outputs 16-128 tokens, ignore_eos, temperature 1.0) over HTTP vs transformers `generate` "
                f"(left-padded batches of {args.hf_batch} prompts x {N_SAMPLES}, sorted by output length), "
                f"{args.threads} torch threads each, device {args.device}, fp32.\n\n{table}")
        append_benchmark("Inference server throughput (tandem serve vs transformers)", body)


if __name__ == "__main__":
    main()
