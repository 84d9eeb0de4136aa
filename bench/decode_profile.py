"""Where a decode step of `tandem serve`'s engine spends its time: `bench/serve.py --profile`.

In process (no HTTP): an `LLMEngine` gets serve.py's workload (64 prompts x n=4, ignore_eos,
temperature 1.0), steps until every prompt is prefilled, then `torch.profiler` records `--steps`
decode steps at full batch (after as many unprofiled ones, whose mean is the reference step time).
A region's time is its wall time, Python included: the model runner's metadata (`prepare`), the
KV write, attention (`decode_attention`), sampling (`sample`, `top_logprobs`). An ATen call outside
them is charged by its name to GEMM (mm, addmm, linear, matmul, bmm, oneDNN's prepacked linear) or "other ops" (elementwise,
norms, RoPE, casts, copies). "Host" is the rest of the step's wall time: Python between ATen
calls, the scheduler, the engine's bookkeeping. "ATen calls per layer" counts those inside one
transformer block (attention and KV write included). Regions are marked by wrapping those functions
here; the product code carries no profiling hooks.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.autograd.profiler_util import FunctionEvent

from tandem.inference import engine as engine_mod
from tandem.inference import model_runner, paged_attention
from tandem.inference.engine import LLMEngine
from tandem.inference.request import GenerationRequest
from tandem.inference.sampling_params import SamplingParams
from tandem.models.qwen.model import TransformerBlock

REGIONS = ("metadata", "kv write", "attention", "sampling")
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::baddbmm",
            "mkldnn::_linear_pointwise"}
OP_NAMESPACES = ("aten::", "mkldnn::", "mkl::")  # the ops counted (prepacked linears are mkldnn::)
PREFIX = "tandem:"


def _marked(name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(PREFIX + name):
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def regions_marked() -> Iterator[None]:
    """Wrap the functions that make up each region in a `record_function` (undone on exit)."""
    patches = [
        (model_runner.ModelRunner, "prepare", "metadata"),
        (paged_attention, "write_kv", "kv write"),
        (paged_attention, "decode_attention", "attention"),
        (engine_mod, "sample", "sampling"),
        (engine_mod, "top_logprobs", "sampling"),
        (TransformerBlock, "forward", "layer"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    try:
        for owner, attr, region in patches:
            setattr(owner, attr, _marked(region, getattr(owner, attr)))
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def _scopes(event: FunctionEvent) -> list[str]:
    """The regions `event` runs in, innermost first."""
    out, e = [], event.cpu_parent
    while e is not None:
        if e.name.startswith(PREFIX):
            out.append(e.name[len(PREFIX):])
        e = e.cpu_parent
    return out


def _is_top_aten(event: FunctionEvent) -> bool:
    """An ATen call not inside another ATen call (its time includes its children's)."""
    if not event.name.startswith(OP_NAMESPACES):
        return False
    e = event.cpu_parent
    while e is not None:
        if e.name.startswith(OP_NAMESPACES):
            return False
        e = e.cpu_parent
    return True


def profile_decode(model_dir: Path, dtype: torch.dtype, work: list[tuple[list[int], int]], n_samples: int,
                   steps: int = 20, **engine_kwargs) -> dict[str, float]:
    """-> per decode step: ms by category, ATen calls per layer, batch size, step ms."""
    engine = LLMEngine(model_dir, dtype=dtype, max_num_seqs=256, kv_cache_tokens=65536, **engine_kwargs)
    longest = max(n for _, n in work)
    for i, (ids, _) in enumerate(work):  # every sample runs the longest output: the batch stays full
        params = SamplingParams(max_new_tokens=longest, n=n_samples, temperature=1.0, top_p=1.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"p{i}", ids, params, return_logprob=True))
    while any(not s.was_started for seqs in engine._live.values() for s in seqs):
        engine.step()  # prefills (and the first decodes that run beside them)
    for _ in range(3):
        engine.step()  # warm-up decodes
    batch = sum(len(seqs) for seqs in engine._live.values())
    plain = []
    for _ in range(steps):  # the same steps' cost without the profiler, for reference
        start = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - start)
    walls: list[float] = []
    with regions_marked(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function(PREFIX + "step"):
                start = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - start)
    by: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    for ev in prof.events():
        if ev.name.startswith(PREFIX) and ev.name[len(PREFIX):] in REGIONS:
            if not any(s in REGIONS for s in _scopes(ev)):  # the outermost mark of a region
                by[ev.name[len(PREFIX):]] += ev.cpu_time_total / 1e3  # µs -> ms, Python included
            continue
        if not _is_top_aten(ev):
            continue
        scopes = _scopes(ev)
        if "step" not in scopes:
            continue
        calls["in layers" if "layer" in scopes else "outside layers"] += 1
        if not any(s in REGIONS for s in scopes):
            by["gemm" if ev.name in GEMM_OPS else "other ops"] += ev.cpu_time_total / 1e3
    step_ms = 1e3 * statistics.fmean(walls)
    out = {k: v / steps for k, v in by.items()}
    out["host"] = step_ms - sum(out.values())
    out["step"] = step_ms
    out["step unprofiled"] = 1e3 * statistics.fmean(plain)
    out["batch"] = batch
    out["aten calls per layer"] = calls["in layers"] / steps / engine.model.args.n_layers
    out["aten calls per step"] = sum(calls.values()) / steps
    return out


def profile_table(rows: list[tuple[str, str, dict[str, float]]]) -> str:
    """Markdown: one row per (preset, dtype) profile."""
    cols = ["gemm", "attention", "kv write", "other ops", "sampling", "metadata", "host"]
    head = ("| preset | dtype | batch | step ms (unprofiled) | step ms | " + " | ".join(f"{c} ms" for c in cols)
            + " | ATen calls / layer | ATen calls / step |")
    lines = [head, "|" + "---|" * 2 + "---:|" * (len(cols) + 5)]
    for preset, dtype, p in rows:
        cells = " | ".join(f"{p.get(c, 0.0):.2f} ({100 * p.get(c, 0.0) / p['step']:.0f}%)" for c in cols)
        lines.append(f"| {preset} | {dtype} | {p['batch']:.0f} | {p['step unprofiled']:.2f} | {p['step']:.2f} | {cells} "
                     f"| {p['aten calls per layer']:.0f} | {p['aten calls per step']:.0f} |")
    return "\n".join(lines)
