"""Routing replay (R3) measured: how often the trainer's MoE routers agree with the server's, and
the logprob mismatch |behaviour - trainer| over generated tokens, with and without replaying the
server's routes, in bfloat16 and float32.

    .venv/bin/python bench/router_replay.py [--preset small] [--prompts 32] [--new-tokens 64]

The "server" is Tandem's in-process inference engine (`tandem.inference.LLMEngine`: paged KV
cache, prefill then one-token decode steps, the serving numerics of `tandem serve`), loaded in the
measured dtype. Its routes are captured per token through the model's `Routing(record=True)`
(this bench wraps the engine's forward; `tandem serve --dtype ... ` with `return_routed_experts`
returns the same rows over HTTP). The trainer is a `TrainEngine` in the same dtype over the
returned sequences, routed live (`actor.router_replay=off`) and replaying the server's routes
(`r3`); the last generated token has no route (never forwarded), so it routes live.

Reported per dtype: route agreement (fraction of (token, MoE layer) pairs whose top-k set equals
the server's, over every token with a route; with replay: of the routes the forward used, 1.0 by
construction, and of the router's own live choice inside that replayed forward) and the mismatch
mean / max over generated tokens. The table is printed and appended to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from _report import append_benchmark

from tandem.algo.mismatch import logprob_mismatch
from tandem.data.trajectory import Trajectory
from tandem.inference.engine import LLMEngine
from tandem.inference.sampling_params import SamplingParams
from tandem.models.common.moe import Routing
from tandem.models.tiny import init_model
from tandem.train import MicroBatchConfig, SequenceBatch, TrainEngine, TrainEngineConfig
from tandem.train.routes import ROUTED_EXPERTS, agreement_counts, stack_layers


def serve_with_routes(path: Path, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int,
                      seed: int) -> list[Trajectory]:
    """Sample from the in-process engine, capturing each token's experts per MoE layer."""
    engine = LLMEngine(path, dtype=dtype, seed=seed, max_num_seqs=len(prompts))
    model, runner = engine.model, engine.runner
    moe_layers = list(model.args.moe_layers)
    rows: dict[str, dict[int, torch.Tensor]] = {}  # rid -> position -> [moe layers, top_k]
    step: dict[str, Routing] = {}
    hidden_states = model.hidden_states

    def recording_hidden_states(*args, **kwargs):
        step["routing"] = Routing(record=True)
        return hidden_states(*args, routing=step["routing"], **kwargs)

    run = runner.run

    def recording_run(seqs, is_prefill, copies, shared_blocks=None):
        spans = [(s.rid, range(s.num_computed_tokens, len(s)) if is_prefill else range(len(s) - 1, len(s)))
                 for s in seqs]  # the positions this step forwards, per sequence, in packing order
        out = run(seqs, is_prefill, copies, shared_blocks)
        routes = stack_layers(step["routing"].recorded, moe_layers).cpu()
        row = 0
        for rid, positions in spans:
            for p in positions:
                rows.setdefault(rid, {})[p] = routes[row]
                row += 1
        return out

    model.hidden_states = recording_hidden_states
    runner.run = recording_run
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    top_k = int(model.args.num_experts_per_tok)
    trajs = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        mine = rows[out.rid]
        n = len(prompt) + len(out.output_ids)
        unknown = torch.full((len(moe_layers), top_k), -1, dtype=torch.int32)
        routed = [mine.get(p, unknown).tolist() for p in range(n)]
        trajs.append(Trajectory.from_generation(prompt, out.output_ids, out.output_logprobs,
                                                [0] * len(out.output_ids), group_id=str(i), routed_experts=routed))
    return trajs


def trainer_pass(path: Path, dtype: str, batch: SequenceBatch, replay: str) -> dict[str, float]:
    """One proximal-style forward of the trainer: mismatch over generated tokens and agreement."""
    engine = TrainEngine(TrainEngineConfig(path=str(path), dtype=dtype, router_replay=replay,
                                           mb=MicroBatchConfig(max_tokens_per_mb=4096)))
    try:
        out = engine.forward_logprobs(batch, loss_tokens_only=True, record_routes=True)
    finally:
        engine.close()
    shifted = [torch.cat([torch.zeros(1), lp[:-1]]) for lp in out.logprobs]  # input alignment
    mismatch = logprob_mismatch(shifted, [s["logprobs"] for s in batch.seqs], [s["loss_mask"] for s in batch.seqs])
    used = [agreement_counts(r, s[ROUTED_EXPERTS]) for r, s in zip(out.routes, batch.seqs, strict=True)]
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
        for dtype, tdtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
            trajs = serve_with_routes(path, tdtype, prompts, args.new_tokens, args.seed)
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
        f"{args.new_tokens}`: a random-init Qwen3-MoE ({args.preset} preset, 8 experts, top-2) served by the "
        f"in-process inference engine (paged KV, decode steps) in each dtype, sampled at temperature 1; the "
        f"trainer (`TrainEngine`, same dtype) recomputes the {tokens} generated tokens' logprobs routing live or "
        f"replaying the server's routes ({pairs} (token, MoE layer) pairs with a route). "
        f"{time.perf_counter() - began:.0f} s on CPU.")
    print("\n" + body)
    if not args.no_append:
        print(f"appended to {append_benchmark('Routing replay (R3): route agreement and logprob mismatch', body)}")


if __name__ == "__main__":
    main()
