"""Routing replay (R3) measured: how often the trainer's MoE routers agree with the server's, and
the logprob mismatch |behaviour - trainer| over generated tokens, with and without replaying the
server's routes, in bfloat16 and float32.

    .venv/bin/python bench/router_replay.py [--preset small] [--prompts 32] [--new-tokens 64]

The server is a real `tandem serve --dtype <dtype>` (paged KV cache, prefill then one-token
decode steps) sampled through the rollout client with `return_routed_experts`, exactly as a
`tandem train` rollout is (`Trajectory.routed_experts`). The trainer is a `TrainEngine` in the
same dtype over the returned sequences, routed live (`actor.router_replay=off`) and replaying the
server's routes (`r3`); the last generated token has no route (never forwarded), so it routes live.

Reported per dtype: route agreement (fraction of (token, MoE layer) pairs whose top-k set equals
the server's, over every token with a route; with replay: of the routes the forward used, 1.0 by
construction, and of the router's own live choice inside that replayed forward) and the mismatch
mean / max over generated tokens. The table is printed and appended to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _report import append_benchmark
from current import record, this_command

from tandem.algo.mismatch import logprob_mismatch
from tandem.data.trajectory import Trajectory
from tandem.fleet.generation import GenerationParams
from tandem.fleet.routed_experts import RoutedExpertLayout
from tandem.models.tiny import init_model
from tandem.rollout.client import ClientConfig, InferenceClient
from tandem.rollout.types import ModelRequest
from tandem.train import MicroBatchConfig, SequenceBatch, TrainEngine, TrainEngineConfig
from tandem.train.routed_experts import ROUTED_EXPERTS, agreement_counts


def start_server(path: Path, dtype: str, seed: int) -> tuple[subprocess.Popen, str]:
    """`tandem serve --dtype <dtype>` on a free port; -> (process, base URL)."""
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(path), "--port", "0", "--dtype", dtype,
           "--seed", str(seed), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    m = re.search(r"listening on (http://\S+)", line)
    if m is None:
        proc.kill()
        raise RuntimeError(f"tandem serve did not start: {line}{proc.stdout.read()}")
    return proc, m.group(1)


async def generate(url: str, layout: RoutedExpertLayout, prompts: list[list[int]], new_tokens: int) -> list[Trajectory]:
    """Sample every prompt through the rollout client, asking for the routed experts."""
    client = InferenceClient([url], ClientConfig(routed_expert_layout=layout))
    try:
        for _ in range(600):  # until /health answers 200 (the model loads after the port opens)
            try:
                await client.agenerate(ModelRequest([1], GenerationParams(max_new_tokens=1)))
                break
            except Exception:  # not ready yet
                await asyncio.sleep(0.1)
        params = GenerationParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
        responses = await asyncio.gather(*(client.agenerate(ModelRequest(p, params)) for p in prompts))
    finally:
        await client.aclose()
    return [r.to_trajectory(group_id=str(i)) for i, r in enumerate(responses)]


def serve_with_experts(path: Path, dtype: str, prompts: list[list[int]], new_tokens: int,
                      seed: int) -> list[Trajectory]:
    """Trajectories sampled by a real `tandem serve --dtype <dtype>`, with its routes."""
    proc, url = start_server(path, dtype, seed)
    try:
        return asyncio.run(generate(url, RoutedExpertLayout.of_model(path), prompts, new_tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def trainer_pass(path: Path, dtype: str, batch: SequenceBatch, replay: str) -> dict[str, float]:
    """One proximal-style forward of the trainer: mismatch over generated tokens and agreement."""
    engine = TrainEngine(TrainEngineConfig(path=str(path), dtype=dtype, router_replay=replay,
                                           mb=MicroBatchConfig(max_tokens_per_mb=4096)))
    try:
        out = engine.forward_logprobs(batch, loss_tokens_only=True, record_experts=True)
    finally:
        engine.close()
    shifted = [torch.cat([torch.zeros(1), lp[:-1]]) for lp in out.logprobs]  # input alignment
    mismatch = logprob_mismatch(shifted, [s["logprobs"] for s in batch.seqs], [s["loss_mask"] for s in batch.seqs])
    used = [agreement_counts(r, s[ROUTED_EXPERTS]) for r, s in zip(out.routed_experts, batch.seqs, strict=True)]
    return {
        "agree_used": sum(m for m, _ in used) / sum(n for _, n in used),
        "agree_live": out.route_matches / out.route_pairs,
        "mean": mismatch["mismatch/mean"],
        "max": mismatch["mismatch/max"],
        "n_tokens": mismatch["mismatch/n_tokens"],
        "pairs": float(out.route_pairs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=("tiny", "small"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-append", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    began = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = init_model(Path(tmp) / "moe", arch="qwen3_moe", preset=args.preset, seed=args.seed)
        gen = torch.Generator().manual_seed(args.seed)
        vocab = int(__import__("json").loads((path / "config.json").read_text())["vocab_size"])
        prompts = [torch.randint(10, vocab, (int(torch.randint(8, 48, (), generator=gen)),), generator=gen).tolist()
                   for _ in range(args.prompts)]
        for dtype in ("bfloat16", "float32"):
            trajs = serve_with_experts(path, dtype, prompts, args.new_tokens, args.seed)
            batch = SequenceBatch([t.to_tensors() for t in trajs])
            for replay in ("off", "r3"):
                r = trainer_pass(path, dtype, batch, replay)
                rows.append((dtype, replay, r))
                print(f"{dtype:9s} replay={replay:3s}  route agreement used {r['agree_used']:.4f} live "
                      f"{r['agree_live']:.4f} ({int(r['pairs'])} pairs)  mismatch mean {r['mean']:.3e} max "
                      f"{r['max']:.3e} ({int(r['n_tokens'])} tokens)", flush=True)
    table = [
        "| dtype | trainer routing | route agreement (routes used) | route agreement (live router) "
        "| mismatch mean | mismatch max |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for dtype, replay, r in rows:
        name = "live (reference)" if replay == "off" else "r3 replay (ours)"
        table.append(f"| {dtype} | {name} | {r['agree_used']:.4f} | {r['agree_live']:.4f} | {r['mean']:.3e} "
                     f"| {r['max']:.3e} |")
    pairs, tokens = int(rows[0][2]["pairs"]), int(rows[0][2]["n_tokens"])
    body = "\n".join(table) + (
        f"\n\n`bench/router_replay.py --preset {args.preset} --prompts {args.prompts} --new-tokens "
        f"{args.new_tokens}`: a random-init Qwen3-MoE ({args.preset} preset, 8 experts, top-2) served by "
        f"`tandem serve --dtype <dtype>` (routes over HTTP with return_routed_experts), sampled at temperature 1; the "
        f"trainer (`TrainEngine`, same dtype) recomputes the {tokens} generated tokens' logprobs routing live or "
        f"replaying the server's routes ({pairs} (token, MoE layer) pairs with a route). "
        f"{time.perf_counter() - began:.0f} s on CPU.")
    print("\n" + body)
    if not args.no_append:
        print(f"appended to {append_benchmark('Routing replay (R3): route agreement and logprob mismatch', body)}")
        by = {(dtype, replay): r for dtype, replay, r in rows}
        live, r3 = by["bfloat16", "off"], by["bfloat16", "r3"]
        record("router_replay",
               f"r3 replay, bf16: route agreement {r3['agree_used']:.4f}, logprob mismatch mean {r3['mean']:.3e}, "
               f"max {r3['max']:.3e}",
               f"live routing: {live['agree_used']:.4f}, {live['mean']:.3e}, {live['max']:.3e}",
               f"mismatch mean {r3['mean'] / live['mean']:.2f}x, max {r3['max'] / live['max']:.2f}x", this_command())


if __name__ == "__main__":
    main()
