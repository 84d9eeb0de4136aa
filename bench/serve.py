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
so drifting load on a shared machine hits all alike, each repetition after the machine went quiet
(bench/quiet.py: vLLM's engine spins a core for ~1 s after its last request); medians are reported. The server's prefix
cache is flushed before every repetition so no repetition reuses an earlier one's prompts.
With `--vllm`, vLLM columns (`--vllm-modes`: eager, `--enforce-eager`, and compiled, its default; the
faster of the two on each row is the baseline of the ratio): the same requests (token-id prompts, n=4, max_tokens, ignore_eos,
temperature 1.0) on the `/v1/completions` of vLLM's CPU build (.venv-vllm, or `--vllm-python`),
started with tandem.launch.vllm's command (same dtype; OMP_NUM_THREADS and VLLM_CPU_OMP_THREADS_BIND
give it the same thread count as tandem serve), its prefix cache reset before every repetition; the
Tandem / vLLM tokens/s ratio is reported. `--dtypes float32 bfloat16` applies to every side;
`--no-hf` skips transformers.
`--batch-invariant` adds a second `tandem serve` with `--batch-invariant` on the same requests
(interleaved like the others) and a table of its cost: its tokens/s over the default server's.
`--profile` instead prints where a decode step's time goes (bench/decode_profile.py).
Run: `.venv/bin/python bench/serve.py [--vllm] [--no-hf]`; prints the tables and appends them to
docs/benchmarks.md (`--no-report` to skip).
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
from current import record, this_command
from decode_profile import profile_decode, profile_table
from quiet import wait_quiet

from tandem.launch import vllm as vllm_launch
from tandem.launch.process import free_port
from tandem.launch.vllm import VLLMServerSpec, default_vllm_python
from tandem.models.tiny import init_model

N_PROMPTS, N_SAMPLES = 64, 4
Work = list[tuple[list[int], int]]


def workload(seed: int, vocab: int) -> Work:
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(16, 256))], rng.randint(16, 128))
            for _ in range(N_PROMPTS)]


def start_server(model: Path, threads: int, device: str, dtype: str, *extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model), "--port", "0", "--num-threads",
           str(threads), "--kv-cache-tokens", "65536", "--max-num-seqs", "256", "--device", device, "--dtype", dtype,
           *extra]
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


class _BoundSpec(VLLMServerSpec):
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = super().env(base)
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(self.threads or 1) - 1}"
        return env


def start_vllm(python: str, model: Path, threads: int, dtype: str, log: Path,
               mode: str = "eager") -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server with Tandem's flags (tandem.launch.vllm), `threads` OpenMP threads bound to
    CPUs 0..threads-1 (VLLM_CPU_OMP_THREADS_BIND; vLLM's default `auto` keeps one CPU of the node for
    its scheduler process, which would leave it one thread here), the same sequence limit as tandem serve.
    `mode`: "eager" (`--enforce-eager`) or "compiled" (vLLM's default, what a user gets with no flags)."""
    spec = _BoundSpec(python, str(model), free_port(), dtype=dtype, served_model_name="bench", threads=threads,
                      kv_cache_gib=4, enforce_eager=mode == "eager", extra_args=["--max-num-seqs", "256", "--seed", "0"])
    return vllm_launch.start(spec, log, timeout_s=900.0), spec.url


async def run_vllm(url: str, work: Work) -> tuple[int, float]:
    """One repetition against vLLM's `/v1/completions` (token-id prompts, n=4): reset its prefix cache,
    then all requests at once -> (output tokens, seconds)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        async def one(ids: list[int], n_out: int) -> int:
            body = {"model": "bench", "prompt": ids, "n": N_SAMPLES, "max_tokens": n_out, "temperature": 1.0,
                    "top_p": 1.0, "ignore_eos": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                out = await r.json()
                assert r.status == 200, out
                return out["usage"]["completion_tokens"]

        async with s.post(url + "/reset_prefix_cache") as r:
            assert r.status == 200, await r.text()
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(ids, n) for ids, n in work))
        return sum(counts), time.perf_counter() - start


def vllm_threads(log: Path) -> str:
    """The thread binding vLLM's log reports (e.g. 'core ids=[0, 1]'), to print next to the figures."""
    m = re.search(r"local_rank=0, core ids=(\[[^\]]*\])", log.read_text(errors="replace"))
    return m.group(1) if m else "?"


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


def preset_model(tmp: Path, preset: str) -> Path:
    """The preset's model under `tmp`, made on first use (every dtype runs the same checkpoint)."""
    model_dir = tmp / preset
    if (model_dir / "config.json").exists():
        return model_dir
    return init_model(model_dir, arch="qwen3", preset=preset, seed=0)


def bench_preset(args: argparse.Namespace, tmp: Path, preset: str, dtype: str
                 ) -> tuple[list[str], list[str], list[str], dict[str, float]]:
    """One preset and dtype: returns (transformers table row(s), vLLM table row(s), batch-invariant
    row(s), tokens/s by side: srv, srv-bi, arrival, sorted, vllm-eager, vllm-compiled)."""
    model_dir = preset_model(tmp, preset)
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    work = workload(0, vocab)
    vllm_sides = [f"vllm-{m}" for m in args.vllm_modes] if args.vllm_python else []
    sides = ["srv"] + (["srv-bi"] if args.batch_invariant else []) + (["arrival", "sorted"] if args.hf else []) \
        + vllm_sides
    runs: dict[str, list[tuple[int, float]]] = {k: [] for k in sides}
    proc, model, proc_bi, url_bi = None, None, None, ""
    vprocs: list[subprocess.Popen] = []
    vllm_urls: dict[str, str] = {}
    try:
        proc, url = start_server(model_dir, args.threads, args.device, dtype)
        asyncio.run(wait_ready(url))
        if args.batch_invariant:
            proc_bi, url_bi = start_server(model_dir, args.threads, args.device, dtype, "--batch-invariant")
            asyncio.run(wait_ready(url_bi))
        for side in vllm_sides:  # one after the other: starting (compiling) is CPU-bound
            log = tmp / f"{side}-{preset}-{dtype}.log"
            vproc, vllm_urls[side] = start_vllm(args.vllm_python, model_dir, args.threads, dtype, log,
                                                mode=side.removeprefix("vllm-"))
            vprocs.append(vproc)
            print(f"  {side} {preset} {dtype}: OMP_NUM_THREADS={args.threads}, "
                  f"VLLM_CPU_OMP_THREADS_BIND=0-{args.threads - 1} (log: core ids={vllm_threads(log)}); "
                  f"tandem serve --num-threads {args.threads}", flush=True)
        if args.hf:
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
            model = model.to(args.device).eval()
        # Warm-up: the whole workload once per server, one short batch for transformers.
        asyncio.run(run_http(url, work))
        if url_bi:
            asyncio.run(run_http(url_bi, work))
        for vllm_url in vllm_urls.values():
            asyncio.run(run_vllm(vllm_url, work))
        if model is not None:
            hf_generate(model, work[: args.hf_batch], args.device, max_new=8)
        # Repetitions interleave the sides, so drifting load on a shared machine hits all of them
        # alike; each starts once the side before has stopped using the CPU.
        for _ in range(args.reps):
            for side in sides:
                wait_quiet()  # the side before may still spin (vLLM's engine: ~1 s after its last request)
                if side in ("srv", "srv-bi"):
                    runs[side].append(asyncio.run(run_http(url if side == "srv" else url_bi, work)))
                elif side in vllm_urls:
                    runs[side].append(asyncio.run(run_vllm(vllm_urls[side], work)))
                else:
                    runs[side].append(run_hf(model, work, args.hf_batch, args.device, side))
    finally:
        for vproc in vprocs:
            vllm_launch.stop(vproc)  # its process group (the engine core is a child)
        for p in (proc, proc_bi):
            if p is not None:
                p.terminate()
                p.wait(30)
    counts = {t for r in runs.values() for t, _ in r}
    assert len(counts) == 1, counts  # same output tokens counted on every side and repetition
    tokens = counts.pop()
    secs = {k: statistics.median(t for _, t in r) for k, r in runs.items()}
    tps = {k: tokens / s for k, s in secs.items()}
    params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(model_dir)).parameters()) if model is None else \
        sum(p.numel() for p in model.parameters())
    hf_rows, vllm_rows, bi_rows = [], [], []
    a = tps["srv"]
    if args.batch_invariant:
        bi_rows.append(f"| {preset} | {dtype} | {a:,.0f} | {tps['srv-bi']:,.0f} | **{tps['srv-bi'] / a:.2f}x** | "
                       f"{secs['srv']:.1f} | {secs['srv-bi']:.1f} |")
    if args.hf:
        b, c = tps["arrival"], tps["sorted"]
        hf_rows.append(f"| {preset} | {dtype} | {params / 1e6:.1f}M | {a:,.0f} | {b:,.0f} | **{a / b:.2f}x** | "
                       f"{c:,.0f} | {a / c:.2f}x | {tokens} | {secs['srv']:.1f} | {secs['arrival']:.1f} "
                       f"| {secs['sorted']:.1f} |")
    if vllm_sides:
        best = max(vllm_sides, key=lambda k: tps[k])
        tps["vllm"] = tps[best]  # vLLM at its best on this row: the acceptance baseline
        cells = " | ".join(f"{tps[k]:,.0f} | {a / tps[k]:.2f}x" for k in vllm_sides)
        vllm_rows.append(f"| {preset} | {dtype} | {params / 1e6:.1f}M | {a:,.0f} | {cells} | "
                         f"**{a / tps[best]:.2f}x** ({best.removeprefix('vllm-')}) | {tokens} | "
                         + " | ".join(f"{secs[k]:.1f}" for k in ["srv", *vllm_sides]) + " |")
    for row in hf_rows + vllm_rows + bi_rows:
        print(row, flush=True)
    print(f"  {preset} {dtype} seconds per repetition: "
          + ", ".join(f"{k} {[round(t, 2) for _, t in r]}" for k, r in runs.items()), flush=True)
    return hf_rows, vllm_rows, bi_rows, tps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["small", "medium"],
                    help="model presets (vLLM's CPU attention needs head_dim >= 32: small and medium)")
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                    help="dtype of every side (tandem serve --dtype, vLLM --dtype, transformers)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=16, help="prompts per transformers batch (x4 sequences)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per side (median reported)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers columns")
    ap.add_argument("--vllm", action="store_true", help="add the vLLM column (its CPU build, over HTTP)")
    ap.add_argument("--vllm-modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"],
                    help="vLLM columns: --enforce-eager and/or its default compiled mode (the faster is the baseline)")
    ap.add_argument("--vllm-python", default=None,
                    help="interpreter of the vLLM install (default: .venv-vllm/bin/python); implies --vllm")
    ap.add_argument("--profile", action="store_true",
                    help="instead of the throughput runs: where a decode step's time goes (bench/decode_profile.py)")
    ap.add_argument("--profile-steps", type=int, default=20, help="decode steps profiled per preset and dtype")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="add a `tandem serve --batch-invariant` side and the table of its cost")
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()
    if args.profile:
        return profile(args)
    if args.vllm and not args.vllm_python:
        args.vllm_python = default_vllm_python(Path(__file__).resolve().parent.parent)
        if args.vllm_python is None:
            ap.error("--vllm: no .venv-vllm/bin/python; pass --vllm-python")
    if not args.hf and not args.vllm_python and not args.batch_invariant:
        ap.error("--no-hf needs --vllm or --batch-invariant: nothing to compare with")
    torch.set_num_threads(args.threads)
    hf_rows = ["| preset | dtype | params | tandem serve tok/s | hf arrival tok/s | **ratio (arrival)** "
               "| hf sorted tok/s | ratio (sorted) | output tokens | tandem s | hf arrival s | hf sorted s |",
               "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    modes = args.vllm_modes
    vllm_rows = ["| preset | dtype | params | tandem serve tok/s | "
                 + " | ".join(f"vLLM {m} tok/s | Tandem / vLLM {m}" for m in modes)
                 + " | **Tandem / vLLM's best** | output tokens | tandem s | " + " | ".join(f"vLLM {m} s" for m in modes) + " |",
                 "|---|---|---:|---:|" + "---:|---:|" * len(modes) + "---:|---:|---:|" + "---:|" * len(modes)]
    bi_rows = ["| preset | dtype | tandem serve tok/s | --batch-invariant tok/s | **cost (invariant / default)** "
               "| default s | invariant s |", "|---|---|---:|---:|---:|---:|---:|"]
    rates: dict[tuple[str, str], dict[str, float]] = {}  # (dtype, preset) -> tokens/s by side
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            for preset in args.presets:
                h, v, b, rates[dtype, preset] = bench_preset(args, Path(tmp), preset, dtype)
                hf_rows += h
                vllm_rows += v
                bi_rows += b
    tables = ([("\n".join(hf_rows))] if args.hf else []) + ([("\n".join(vllm_rows))] if args.vllm_python else []) \
        + ([("\n".join(bi_rows))] if args.batch_invariant else [])
    print("\n" + "\n\n".join(tables))
    if args.no_report:
        return
    dtypes = ", ".join(args.dtypes)
    body = (f"`bench/serve.py`: {N_PROMPTS} concurrent `/generate` requests x n={N_SAMPLES} (prompts 16-256 "
            f"tokens, outputs 16-128 tokens, ignore_eos, temperature 1.0) over HTTP")
    if args.hf:
        body += (f" vs transformers `generate` (left-padded batches of {args.hf_batch} prompts x {N_SAMPLES}, each "
                 f"batch generating up to its longest output, only requested tokens counted; **arrival order** = "
                 f"the acceptance baseline, *sorted* = batches formed after sorting by output length, an oracle)")
    if args.vllm_python:
        body += (f"{' and' if args.hf else ''} vs vLLM's OpenAI server (CPU build, started as "
                 f"`tandem.launch.vllm` starts it: `--logprobs-mode processed_logprobs`, in "
                 f"{' and '.join(modes)} mode ({'`--enforce-eager`' if 'eager' in modes else ''}"
                 f"{' / ' if len(modes) == 2 else ''}{'no flag: its default, compiled' if 'compiled' in modes else ''}); "
                 f"`--max-num-seqs 256`, VLLM_CPU_KVCACHE_SPACE=4) with the same {N_PROMPTS} x n={N_SAMPLES} "
                 f"requests on `/v1/completions` (token-id prompts, max_tokens = the requested output, ignore_eos, "
                 f"temperature 1.0), OMP_NUM_THREADS={args.threads} with VLLM_CPU_OMP_THREADS_BIND="
                 f"0-{args.threads - 1} (vLLM's default `auto` keeps one CPU for its scheduler process)")
    if args.batch_invariant:
        body += (f"{' and' if args.hf or args.vllm_python else ''} vs the same server started with "
                 f"`--batch-invariant` (its cost: invariant tokens/s over default)")
    body += (f"; {args.threads} torch threads each, device {args.device}, dtype {dtypes}; warm-up, then the median "
             f"of {args.reps} repetitions per side, repetitions interleaved (prefix caches flushed before each "
             f"server repetition).\n\n" + "\n\n".join(tables))
    title = "Inference server throughput (tandem serve vs " + " and ".join(
        (["transformers"] if args.hf else []) + (["vLLM"] if args.vllm_python else [])
        + (["--batch-invariant"] if args.batch_invariant else [])) + ")"
    append_benchmark(title, body)
    record_current(args, rates)


def profile(args: argparse.Namespace) -> None:
    """`--profile`: the decode-step breakdown of every preset and dtype, one engine in this process."""
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            for preset in args.presets:
                model_dir = preset_model(Path(tmp), preset)
                work = workload(0, transformers.AutoConfig.from_pretrained(model_dir).vocab_size)
                rows.append((preset, dtype, profile_decode(model_dir, getattr(torch, dtype), work, N_SAMPLES,
                                                           steps=args.profile_steps, device=args.device)))
                print(profile_table(rows[-1:]).splitlines()[-1], flush=True)
    table = profile_table(rows)
    print("\n" + table)
    if not args.no_report:
        append_benchmark("Decode step profile (tandem serve's engine)", (
            f"`bench/serve.py --profile`: serve.py's {N_PROMPTS} prompts x n={N_SAMPLES} in one in-process engine, "
            f"every sample decoding to the longest output so the batch stays full; after the prefills and 3 "
            f"warm-up decodes, the mean of {args.profile_steps} decode steps under torch.profiler "
            f"({args.threads} torch threads). Each ATen call is charged to its region (bench/decode_profile.py); "
            f"host = step wall time outside every ATen call. Times include the profiler's own overhead.\n\n"
            + table))


def record_current(args: argparse.Namespace, rates: dict[tuple[str, str], dict[str, float]]) -> None:
    """The Current figures rows: `serve` (vs transformers, arrival order), `serve --vllm` (vs vLLM)."""
    def figures(side: str) -> str:
        return "; ".join(f"{d} " + " / ".join(f"{rates[d, p][side]:,.0f}" for p in args.presets)
                         for d in args.dtypes) + " tok/s"

    def ratios(side: str) -> str:
        return "; ".join(f"{d} " + " / ".join(f"{rates[d, p]['srv'] / rates[d, p][side]:.2f}x" for p in args.presets)
                         for d in args.dtypes)

    presets = " / ".join(args.presets)
    if args.hf:
        record("serve", f"tandem serve ({presets}) {figures('srv')}", f"transformers, arrival order: {figures('arrival')}",
               ratios("arrival"), this_command())
    if args.vllm_python:
        record("serve --vllm", f"tandem serve ({presets}) {figures('srv')}", f"vLLM CPU build: {figures('vllm')}",
               ratios("vllm"), this_command())


if __name__ == "__main__":
    main()
