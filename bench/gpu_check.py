"""The GPU checklist (/work/shared/gpu/CHECKLIST.md) as one bounded command: `make gpu-check`.

    python3 bench/gpu_check.py --out DIR [--device cuda] [--budget-s 480] [--only serve,train] [--quick]

Steps, in priority order, each a subprocess of its own (its whole process group killed at its
timeout; a failed or timed-out step never stops the next):
- env: torch/transformers/CUDA versions, the device, its memory, `nvidia-smi -L`, a measured bf16
  matmul rate and device-to-device copy bandwidth;
- correctness: `python3 -m pytest -q -s -p no:cacheprovider tests/gpu` (pass/fail counts, the
  figures the tests print);
- serve: a random Qwen3 of Qwen2.5-0.5B's shape in bf16: decode steps/s of the engine in process at
  a full batch and its bandwidth as a fraction of HBM peak ((weight bytes + KV bytes read per step)
  x steps/s), then `tandem serve` over HTTP vs transformers `generate` on bench/serve.py's workload
  (bench/serve.py's helpers; serve.py's own CPU behaviour is untouched);
- train: TrainEngine bf16 fwd+bwd tokens/s and MFU (6 x params x tokens/s over the bf16 peak: the
  nominal dense 989 TFLOP/s of H100/H200 SXM and the matmul rate measured here), eager and
  compiled, with and without full activation checkpointing;
- weight_sync: a `shm` weight update from a CUDA trainer to a CUDA `tandem serve` (CUDA IPC) vs a
  device-to-device copy of the same bytes;
- demo: `make demo`'s recipe (init-model, SFT warm start, GRPO) with experiment.device set, one
  server and one trainer rank (both on GPU 0) and `train.weight_sync=shm` (NCCL cannot join two
  processes on one GPU): wall time and eval accuracy.

`--budget-s` bounds the whole run: a step gets at most its own timeout and what is left; a step
with too little left is "skipped: budget". DIR gets three files, rewritten after every step (a
run killed from outside still leaves the steps done so far): gpu_check.json, gpu_check.md and
gpu_check.log (every step's output under a header). Models and runs go to a temporary directory,
removed at the end (`--keep`). `--device cpu --quick` is a dry run of the same steps on CPU with
tiny models (a few minutes). Tandem need not be installed: children run `python -m tandem.cli`
with the caller's PYTHONPATH, so from the repo root `PYTHONPATH=$PWD python3 bench/gpu_check.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"

# (name, timeout s on a GPU, timeout s with --quick). The quick train step compiles the model on a
# cold inductor cache in a fresh CI checkout: 33 s on an idle 2-core machine, 3-4x that under CI load.
STEPS: list[tuple[str, float, float]] = [
    ("env", 45, 45), ("correctness", 240, 120), ("serve", 120, 120), ("train", 180, 300),
    ("weight_sync", 60, 90), ("demo", 180, 150),
]
MIN_STEP_S = 20.0  # a step with less time left than this is skipped
KILL_GRACE_S = 8.0

# Qwen2.5-0.5B's shape (494M parameters, tied embeddings), as a Qwen3 (q/k norms) with random weights.
SHAPE_0_5B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, head_dim=64, intermediate_size=4864)
NOMINAL_BF16_FLOPS = 989e12  # dense bf16, H100 / H200 SXM


def device_peaks(name: str) -> dict[str, Any]:
    """HBM bandwidth and nominal dense bf16 FLOP/s by device name (empty when unknown)."""
    n = name.upper()
    if "H200" in n:
        return {"gpu": "H200", "hbm_bytes_per_s": 4.8e12, "bf16_flops": NOMINAL_BF16_FLOPS}
    if "H100" in n:
        return {"gpu": "H100", "hbm_bytes_per_s": 3.35e12, "bf16_flops": NOMINAL_BF16_FLOPS}
    return {}


# ============================================================================ orchestration
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="report folder (three files)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock bound of the whole run")
    ap.add_argument("--only", default="", help="comma-separated steps (default: all)")
    ap.add_argument("--quick", action="store_true", help="tiny models, few tokens: a dry run")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    ap.add_argument("--work", type=Path, help="(internal) work folder shared by the steps")
    ap.add_argument("--step", help="(internal) run one step in this process")
    a = ap.parse_args()
    if a.step:
        return run_step_here(a)
    if a.out is None:
        ap.error("--out is required")
    names = [s for s, _, _ in STEPS]
    only = [s for s in a.only.split(",") if s]
    if unknown := set(only) - set(names):
        ap.error(f"unknown steps {sorted(unknown)}; choose from {names}")
    orchestrate(a, only or names)


def orchestrate(a: argparse.Namespace, selected: list[str]) -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    started = time.monotonic()
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "device": a.device, "quick": a.quick,
        "budget_s": a.budget_s, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": {},
    }
    log_path = a.out / "gpu_check.log"
    current: dict[str, subprocess.Popen] = {}

    def on_signal(signum: int, _frame: object) -> None:  # killed from outside: stop the step, keep the report
        if (p := current.get("proc")) is not None:
            kill_group(p)
        report["interrupted"] = signal.Signals(signum).name
        write_report(a.out, report)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with open(log_path, "w") as log:
        for name, gpu_timeout, quick_timeout in STEPS:
            if name not in selected:
                continue
            left = a.budget_s - (time.monotonic() - started)
            if left < MIN_STEP_S:
                report["steps"][name] = {"status": "skipped: budget", "seconds": 0.0}
                log.write(f"\n===== {name}: skipped (budget: {left:.0f} s left) =====\n")
                log.flush()
                write_report(a.out, report)
                continue
            timeout = min(quick_timeout if a.quick else gpu_timeout, left)
            report["steps"][name] = run_step(name, timeout, a, work, log, current)
            report["elapsed_s"] = round(time.monotonic() - started, 1)
            write_report(a.out, report)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    write_report(a.out, report)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(render_md(report))


def step_command(name: str, a: argparse.Namespace, work: Path) -> list[str]:
    if name == "correctness":
        return [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/gpu"]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", name, "--work", str(work), "--device", a.device]
    return cmd + (["--quick"] if a.quick else [])


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the step's process group (a `tandem train` tears its servers and ranks down), then
    SIGKILL what is left after a grace period."""
    def group_alive() -> bool:
        proc.poll()  # reap the leader, or the group never looks empty
        try:
            os.killpg(proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while group_alive() and time.monotonic() < deadline:  # the leader may die before its children
            time.sleep(0.1)
        if not group_alive():
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(1)


def run_step(name: str, timeout: float, a: argparse.Namespace, work: Path, log, current: dict) -> dict[str, Any]:
    cmd = step_command(name, a, work)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if name == "correctness" and a.device == "cpu":
        env["TANDEM_TEST_DEVICE"] = "cpu"
    log.write(f"\n===== {name} (timeout {timeout:.0f} s): {' '.join(cmd)} =====\n")
    log.flush()
    start_offset = log.tell()
    result: dict[str, Any] = {"timeout_s": round(timeout, 1)}
    if name == "correctness" and not (ROOT / "tests" / "gpu").is_dir():
        log.write("tests/gpu does not exist here\n")
        log.flush()
        return {**result, "status": "skipped: no tests/gpu", "seconds": 0.0}
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    current["proc"] = proc
    try:
        rc = proc.wait(timeout)
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        kill_group(proc)
        status = "timeout"
    finally:
        current.pop("proc", None)
    seconds = time.monotonic() - began
    log.write(f"----- {name}: {status} after {seconds:.1f} s -----\n")
    log.flush()
    with open(log.name, errors="replace") as f:
        f.seek(start_offset)
        output = f.read()
    result.update(status=status, seconds=round(seconds, 1))
    if name == "correctness":
        result.update(parse_pytest(output))
        if status.startswith("failed") and result.get("failed", 0) == 0 and result.get("errors", 0) == 0 \
                and result.get("passed", 0) > 0:
            status = result["status"] = f"{status}: see log"
    else:
        with contextlib.suppress(OSError, ValueError):
            result["figures"] = json.loads((work / f"{name}.json").read_text())
    if status != "ok":
        result["tail"] = [line for line in output.splitlines() if line.strip()][-25:]
    return result


PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")
FIGURE_LINE = re.compile(r"\d")
LOG_LINE = re.compile(r"(\d\d:\d\d:\d\d|\d{4}-\d\d-\d\d|INFO|WARNING|DEBUG|\[)")


def parse_pytest(output: str) -> dict[str, Any]:
    """Counts from pytest's summary line, and the lines the tests printed with numbers in them."""
    counts: dict[str, Any] = {}
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if summary:
        for n, what in PYTEST_COUNT.findall(summary[-1]):
            counts[{"error": "errors", "warning": "warnings"}.get(what, what)] = int(n)
    printed = []
    for line in output.splitlines():
        s = line.strip()
        if not s or not FIGURE_LINE.search(s) or s.startswith(("tests/", "=", "_", "E ", ">", "FAILED", "ERROR", "-----")) \
                or LOG_LINE.match(s):  # servers' and loggers' lines are in the log, not figures
            continue
        if re.fullmatch(r"[.sFExX]+( *\[ *\d+%\])?", s) or s in summary:
            continue
        printed.append(s[:300])
    counts["printed"] = printed[:80]
    counts["failures"] = [line.strip()[:300] for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))][:30]
    return counts


def write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(render_md(report))


def _fmt(x: Any, spec: str = ".3g") -> str:
    return format(x, spec) if isinstance(x, int | float) else str(x)


def summarize(name: str, r: dict[str, Any]) -> list[str]:
    """Key figures of one step's result, as markdown bullet lines."""
    f = r.get("figures") or {}
    out: list[str] = []
    if name == "env":
        out.append(f"{f.get('device_name', '?')} ({_fmt(f.get('device_memory_gib'), '.1f')} GiB), torch "
                   f"{f.get('torch')} (CUDA {f.get('torch_cuda')}), transformers {f.get('transformers')}, "
                   f"Python {f.get('python')}")
        if "matmul_bf16_tflops" in f:
            out.append(f"bf16 matmul {f['matmul_bf16_tflops']:.3g} TFLOP/s measured ({f.get('matmul_shape')}); "
                       f"device copy {f.get('copy_gb_s', 0):.3g} GB/s (read + write)")
        if f.get("nvidia_smi"):
            out.append("nvidia-smi -L: " + "; ".join(f["nvidia_smi"]))
    elif name == "correctness":
        counts = ", ".join(f"{r[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if r.get(k))
        out.append(counts or "no summary line")
        out += [f"`{line}`" for line in r.get("failures", [])]
        out += [f"`{line}`" for line in r.get("printed", [])[:40]]
    elif name == "serve":
        m = f.get("model", {})
        if m:
            out.append(f"model {m.get('shape')} {m.get('params', 0) / 1e6:.0f}M params, {f.get('dtype')}")
        if d := f.get("decode"):
            out.append(f"engine decode: batch {d['batch']}, {d['step_ms']:.2f} ms/step ({d['steps_per_s']:.1f} steps/s, "
                       f"{d['tok_s']:,.0f} tok/s), {d['bytes_per_step'] / 1e9:.3f} GB read/step (weights "
                       f"{d['weight_bytes'] / 1e9:.3f} + KV {d['kv_bytes_per_step'] / 1e9:.3f}) -> "
                       f"{d['bandwidth_gb_s']:.3g} GB/s" + (f" = **{100 * d['hbm_fraction']:.1f}% of HBM peak**"
                                                          if d.get("hbm_fraction") is not None else ""))
        if "tandem_tok_s" in f:
            out.append(f"tandem serve {f['tandem_tok_s']:,.0f} tok/s over HTTP ({f['output_tokens']} tokens, "
                       f"{f['tandem_s']:.2f} s; warm-up {f.get('tandem_warmup_s', 0):.1f} s)")
        if "hf_tok_s" in f:
            out.append(f"transformers generate {f['hf_tok_s']:,.0f} tok/s (arrival order, batches of "
                       f"{f['hf_batch']} x 4) -> **ratio {f['ratio']:.2f}x**")
    elif name == "train":
        for c in f.get("configs", []):
            if "error" in c:
                out.append(f"{c['name']}: error {c['error']}")
                continue
            chosen = f" [compile={c.get('compile')}, AC {c.get('activation_checkpoint')}, attention {c.get('attention')}]"
            out.append(f"{c['name']}{chosen}: fwd+bwd {c['tok_s']:,.0f} tok/s, MFU **{100 * c['mfu_nominal']:.1f}%** of "
                       f"{c['peak_nominal'] / 1e12:.3g} TFLOP/s" + (
                           f" ({100 * c['mfu_measured']:.1f}% of measured {c['peak_measured'] / 1e12:.3g})"
                           if c.get("mfu_measured") is not None else "")
                       + f"; train_batch {c.get('step_tok_s', 0):,.0f} tok/s; first call {c['first_s']:.1f} s; "
                       f"peak mem {_fmt(c.get('peak_mem_gib'), '.1f')} GiB")
        if f.get("tokens"):
            out.insert(0, f"{f['params'] / 1e6:.0f}M params, {f['tokens']} tokens/iteration "
                          f"({f['n_seqs']} x {f['seq_len']}), <= {f['mb_tokens']} tokens/micro-batch, {f['dtype']}")
    elif name == "weight_sync":
        if "update_s" in f:
            out.append(f"{f['transport']} update {f['update_s']:.3f} s for {f['bytes'] / 1e9:.3f} GB "
                       f"({f['bytes'] / f['update_s'] / 1e9:.1f} GB/s; runs {f['runs']}; phases {f.get('phases')})")
        if "copy_s" in f:
            out.append(f"device copy of the same bytes {f['copy_s'] * 1e3:.2f} ms "
                       f"({f['bytes'] / f['copy_s'] / 1e9:.0f} GB/s) -> update / copy "
                       f"**{f['update_s'] / f['copy_s']:.1f}x**" if "update_s" in f else "")
    elif name == "demo":
        for k in ("init_s", "sft_s", "train_s"):
            if k in f:
                out.append(f"{k[:-2]}: {f[k]:.1f} s")
        if "eval_before" in f:
            out.append(f"eval accuracy **{f['eval_before']:.3f} -> {f['eval_after']:.3f}**; {f.get('steps_line', '')}")
        elif "last_eval" in f:
            out.append(f"last eval seen: {f['last_eval']}")
        if f.get("time_line"):
            out.append(f["time_line"])
    if "error" in f:
        out.append(f"error: {f['error']}")
    return out


def render_md(report: dict[str, Any]) -> str:
    lines = ["# Tandem GPU check", "",
             f"`{report['command']}`, started {report['started']}, budget {report['budget_s']:.0f} s, "
             f"elapsed {report.get('elapsed_s', '?')} s" + (f", interrupted ({report['interrupted']})"
                                                             if report.get("interrupted") else ""), "",
             "| step | status | seconds |", "|---|---|---:|"]
    for name, r in report["steps"].items():
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', 0):.1f} |")
    for name, r in report["steps"].items():
        lines += ["", f"## {name}: {r['status']}", ""]
        lines += [f"- {s}" for s in summarize(name, r) if s]
        if r.get("tail"):
            lines += ["", "Last lines of its output:", "", "```", *r["tail"], "```"]
    return "\n".join(lines) + "\n"


# ============================================================================ steps (in a child process)
class Figures(dict):
    """A step's result, rewritten to <work>/<step>.json on every `save` (a timed-out step keeps what
    it had measured)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def save(self, **kw: Any) -> None:
        self.update(kw)
        self.path.write_text(json.dumps(self, indent=1, default=str))
        print(f"[figures] {json.dumps(kw, default=str)}", flush=True)


def run_step_here(a: argparse.Namespace) -> None:
    sys.path[:0] = [str(BENCH), str(ROOT)]  # serve.py's helpers; tests.inference.server_utils
    figures = Figures(a.work / f"{a.step}.json")
    step = {"env": step_env, "serve": step_serve, "train": step_train, "weight_sync": step_weight_sync,
            "demo": step_demo}[a.step]
    try:
        step(a, figures)
    except BaseException as exc:
        figures.save(error=f"{type(exc).__name__}: {str(exc)[:500]}")
        raise


def sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def matmul_flops(device: str, quick: bool) -> tuple[float, str]:
    """Measured bf16 matmul FLOP/s (median of 10 after a warm-up)."""
    import torch
    n = 8192 if device == "cuda" else (512 if quick else 1024)
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    timed(lambda: x @ y, device, 3)
    t = statistics.median(timed(lambda: x @ y, device, 10))
    return 2 * n**3 / t, f"{n}x{n}x{n}"


def step_env(a: argparse.Namespace, f: Figures) -> None:
    import torch
    import transformers

    from tandem.models.common.attention import varlen_available

    f.save(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
           torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(), cpus=os.cpu_count(),
           host=platform.node(), varlen_attention=varlen_available())
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        f.save(nvidia_smi=r.stdout.strip().splitlines(), nvidia_smi_query=q.stdout.strip())
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        p = torch.cuda.get_device_properties(0)
        f.save(device_name=p.name, device_memory_gib=p.total_memory / 2**30, capability=f"{p.major}.{p.minor}",
               device_count=torch.cuda.device_count(), **device_peaks(p.name))
    else:
        f.save(device_name=f"CPU ({platform.processor() or platform.machine()})")
    flops, shape = matmul_flops(a.device, a.quick)
    f.save(matmul_bf16_tflops=flops / 1e12, matmul_shape=shape)
    nbytes = (1 << 30) if a.device == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=a.device)
    dst = torch.empty_like(src)
    timed(lambda: dst.copy_(src), a.device, 2)
    t = statistics.median(timed(lambda: dst.copy_(src), a.device, 10))
    f.save(copy_gb_s=2 * nbytes / t / 1e9)


def ensure_model(a: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The benchmark model, made once per run in the work folder: Qwen2.5-0.5B's shape on a GPU,
    the `small` preset with --quick."""
    from tandem.models.tiny import init_model
    from tandem.models.tiny.presets import PRESETS

    quick = a.quick
    shape = {} if quick else SHAPE_0_5B
    model_dir = a.work / ("model-small" if quick else "model-0.5b")
    began = time.monotonic()
    if not (model_dir / "config.json").exists():
        init_model(model_dir, arch="qwen3", preset="small", seed=0, overrides=shape or None)
    s = {**PRESETS["small"].__dict__, **shape}
    h, layers, inter, vocab = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"], s["vocab_size"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    per_layer = h * q * 2 + h * kv * 2 + 3 * h * inter + 2 * h + 2 * s["head_dim"]
    params = vocab * h + layers * per_layer + h  # tied embeddings
    info = {"shape": "qwen3 small preset" if quick else "Qwen2.5-0.5B-shaped qwen3", "params": params,
            "non_embedding_params": params - vocab * h, "config": s, "made_s": round(time.monotonic() - began, 1)}
    return model_dir, info


def decode_rate(model_dir: Path, dtype, work: list[tuple[list[int], int]], n_samples: int, steps: int,
                device: str) -> dict[str, Any]:
    """Decode steps/s of the serving engine in process at a full batch (serve.py's prompts, every sample
    decoding past the timed steps), and the bytes a step reads: every weight once plus the KV cache of
    every sequence's context (counted per sequence: an upper bound where samples share prompt blocks)."""
    import torch

    from tandem.inference.engine import LLMEngine
    from tandem.inference.request import GenerationRequest
    from tandem.inference.sampling_params import SamplingParams

    engine = LLMEngine(model_dir, dtype=dtype, device=device, max_num_seqs=256, kv_cache_tokens=65536)
    try:
        longest = max(n for _, n in work) + steps + 8
        for i, (ids, _) in enumerate(work):
            params = SamplingParams(max_new_tokens=longest, n=n_samples, temperature=1.0, top_p=1.0, ignore_eos=True)
            engine.add_request(GenerationRequest(f"p{i}", ids, params, return_logprob=True))
        began = time.perf_counter()
        while any(not s.was_started for seqs in engine._live.values() for s in seqs):
            engine.step()
        prefill_s = time.perf_counter() - began
        for _ in range(3):
            engine.step()
        seqs = [s for ss in engine._live.values() for s in ss]
        ctx_before = sum(len(s) for s in seqs)
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        dt = time.perf_counter() - t
        ctx_after = sum(len(s) for s in seqs)
        cfg = engine.model.args
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        elt = torch.empty((), dtype=dtype).element_size()
        kv_per_token = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * elt
    finally:
        del engine
        import gc
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    kv_step = (ctx_before + ctx_after) / 2 * kv_per_token
    batch = len(seqs)
    return {"batch": batch, "steps": steps, "step_ms": 1e3 * dt / steps, "steps_per_s": steps / dt,
            "tok_s": batch * steps / dt, "prefill_s": prefill_s, "weight_bytes": weight_bytes,
            "kv_bytes_per_step": kv_step, "bytes_per_step": weight_bytes + kv_step,
            "mean_context": (ctx_before + ctx_after) / 2 / batch,
            "bandwidth_gb_s": (weight_bytes + kv_step) * steps / dt / 1e9}


def peaks_here(a: argparse.Namespace) -> dict[str, Any]:
    if a.device != "cuda":
        return {}
    import torch
    return device_peaks(torch.cuda.get_device_name(0))


def server_log_tails(folder: Path, lines: int = 40) -> None:
    for log in sorted(folder.glob("serve-*.log")):
        print(f"--- tail of {log.name} ---")
        print("\n".join(log.read_text(errors="replace").splitlines()[-lines:]), flush=True)


def step_serve(a: argparse.Namespace, f: Figures) -> None:
    import asyncio

    import serve as S  # bench/serve.py
    import torch
    import transformers

    from tests.inference.server_utils import ServerProcess

    dtype_name = "bfloat16"
    dtype = getattr(torch, dtype_name)
    model_dir, info = ensure_model(a)
    f.save(model=info, dtype=dtype_name, device=a.device)
    vocab = info["config"]["vocab_size"]
    work = S.workload(0, vocab)
    if a.quick:
        work = [(ids[:32], min(n, 12)) for ids, n in work[:8]]
    f.save(prompts=len(work), n_samples=S.N_SAMPLES, prompt_tokens=sum(len(i) for i, _ in work),
           requested_tokens=sum(n for _, n in work) * S.N_SAMPLES)
    d = decode_rate(model_dir, dtype, work, S.N_SAMPLES, 8 if a.quick else 30, a.device)
    if (hbm := peaks_here(a).get("hbm_bytes_per_s")) is not None:
        d.update(hbm_peak_bytes_per_s=hbm, hbm_fraction=d["bandwidth_gb_s"] * 1e9 / hbm,
                 hbm_fraction_weights_only=d["weight_bytes"] * d["steps_per_s"] / hbm)
    f.save(decode=d)

    server = ServerProcess(model_dir, a.work, "--device", a.device, "--dtype", dtype_name, "--kv-cache-tokens",
                           "65536", "--max-num-seqs", "256", timeout=300)
    try:
        t = time.perf_counter()
        asyncio.run(S.run_http(server.url, work))
        f.save(tandem_warmup_s=time.perf_counter() - t)
        runs: list[tuple[int, float]] = []
        for _ in range(1 if a.quick else 2):  # saved after each: a timeout keeps the first
            runs.append(asyncio.run(S.run_http(server.url, work)))
            tokens, secs = runs[0][0], statistics.median(s for _, s in runs)
            f.save(output_tokens=tokens, tandem_s=secs, tandem_runs_s=[s for _, s in runs], tandem_tok_s=tokens / secs)
    except BaseException:
        server_log_tails(a.work)
        raise
    finally:
        server.stop()

    hf_batch = 4 if a.quick else 16
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(a.device).eval()
    S.hf_generate(model, work[:hf_batch], a.device, max_new=8)  # warm-up
    hf_tokens, hf_s = S.run_hf(model, work, hf_batch, a.device, "arrival")
    assert hf_tokens == tokens, (hf_tokens, tokens)
    f.save(hf_batch=hf_batch, hf_s=hf_s, hf_tok_s=hf_tokens / hf_s, ratio=(tokens / secs) / (hf_tokens / hf_s))


def step_train(a: argparse.Namespace, f: Figures) -> None:
    import gc

    import torch
    from train_throughput import nll_sum  # bench/train_throughput.py's loss

    from tandem.parallel.config import ParallelizeConfig
    from tandem.train import MicroBatchConfig, SequenceBatch, TrainEngine, TrainEngineConfig
    from tandem.train.config import OptimizerConfig

    model_dir, info = ensure_model(a)
    n_seqs, seq_len, mb_tokens = (8, 128, 512) if a.quick else (16, 1024, 4096)
    vocab = info["config"]["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (seq_len,), generator=gen) for _ in range(n_seqs)]
    batch = SequenceBatch([{"input_ids": s, "loss_mask": torch.ones_like(s)} for s in seqs])
    tokens = n_seqs * seq_len
    peaks = peaks_here(a)
    measured = None
    with contextlib.suppress(OSError, ValueError, KeyError):
        measured = json.loads((a.work / "env.json").read_text())["matmul_bf16_tflops"] * 1e12
    if measured is None:
        measured = matmul_flops(a.device, a.quick)[0]
    peak_nominal = peaks.get("bf16_flops", measured)
    params = info["params"]
    f.save(params=params, tokens=tokens, n_seqs=n_seqs, seq_len=seq_len, mb_tokens=mb_tokens, dtype="bfloat16",
           peak_nominal=peak_nominal, peak_measured=measured,
           note="MFU = 6 x params (tied embedding counted once) x fwd+bwd tokens/s / peak; attention FLOPs left out")
    iters = 2 if a.quick else 3
    # The device's defaults (compile None, activation checkpointing auto) right after eager.
    configs = [("eager", False, "none"), ("device defaults", None, "auto"), ("compile", True, "none"),
               ("eager + AC full", False, "full")]
    results: list[dict[str, Any]] = []
    for name, compile_, ac in configs:
        row: dict[str, Any] = {"name": name, "compile": compile_, "activation_checkpoint": ac}
        engine = None
        try:
            engine = TrainEngine(TrainEngineConfig(
                path=str(model_dir), dtype="bfloat16", device=a.device, optimizer=OptimizerConfig(lr=1e-5),
                mb=MicroBatchConfig(max_tokens_per_mb=mb_tokens),
                parallelize=ParallelizeConfig(compile=compile_, activation_checkpoint=ac)))
            chosen = engine.config.parallelize  # what the device's defaults became
            row.update(compile=chosen.compile, activation_checkpoint=chosen.activation_checkpoint
                       + (f" ({chosen.ac_selective})" if chosen.activation_checkpoint == "selective" else ""),
                       attention=engine.model.attention_kernel)
            if a.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            counted = sum(p.numel() for p in engine.model.parameters())  # global sizes (DTensor numel)
            if counted != params:
                f.save(params=counted, params_formula=params)
                params = counted

            def fwd_bwd(engine=engine) -> None:
                engine.optimizer.zero_grad(set_to_none=True)
                engine.forward_backward(batch, nll_sum)

            row["first_s"] = timed(fwd_bwd, a.device, 1)[0]  # compiles, when compiling
            timed(fwd_bwd, a.device, 1)
            t = statistics.median(timed(fwd_bwd, a.device, iters))
            step_t = statistics.median(timed(lambda engine=engine: engine.train_batch(batch, nll_sum), a.device, 2))
            row.update(fwd_bwd_s=t, tok_s=tokens / t, step_s=step_t, step_tok_s=tokens / step_t,
                       peak_nominal=peak_nominal, mfu_nominal=6 * params * tokens / t / peak_nominal,
                       peak_measured=measured, mfu_measured=6 * params * tokens / t / measured)
            if a.device == "cuda":
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as exc:  # one configuration failing still leaves the others
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            import traceback
            traceback.print_exc()
        finally:
            if engine is not None:
                engine.close()
            del engine
            gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()
        results.append(row)
        f.save(configs=results)
    if all("error" in r for r in results):
        raise RuntimeError("every training configuration failed")


def step_weight_sync(a: argparse.Namespace, f: Figures) -> None:
    import torch

    from tandem.fleet.http import HttpFleet
    from tandem.fleet.ops import Deadlines
    from tandem.train import TrainEngine, TrainEngineConfig
    from tandem.weights.meta import WeightUpdateMeta
    from tandem.weights.updater import WeightUpdater
    from tests.inference.server_utils import ServerProcess

    model_dir, info = ensure_model(a)
    deadlines = Deadlines(init_group_s=120, bucket_s=120, update_s=300, http_s=120)
    server = ServerProcess(model_dir, a.work, "--device", a.device, "--dtype", "bfloat16", "--kv-cache-tokens",
                           "4096", "--weight-sync-timeout", "120", timeout=300)
    engine = None
    try:
        engine = TrainEngine(TrainEngineConfig(path=str(model_dir), dtype="bfloat16", device=a.device))
        payload = sum(p.numel() for p in engine.model.parameters()) * 2
        bucket = max(4 << 20, payload // 16)
        transport = "shm (CUDA IPC)" if a.device == "cuda" else "shm (/dev/shm)"
        f.save(transport=transport, bytes=payload, bucket_bytes=bucket, params=info["params"])
        meta = WeightUpdateMeta(type="shm", path=str(a.work / "versions"), bucket_bytes=bucket, deadlines=deadlines)
        reps = 3 if a.quick else 5
        with HttpFleet([server.url], deadlines=deadlines) as fleet, WeightUpdater(engine, fleet, meta) as updater:
            for version in (1, 2):  # untimed: both sets of buffers made
                updater.update(version)
            reports = [updater.update(3 + i) for i in range(reps)]
        runs = sorted(reports, key=lambda r: r.seconds)
        mid = runs[len(runs) // 2]
        f.save(update_s=mid.seconds, runs=[round(r.seconds, 4) for r in reports],
               phases={k: round(v, 4) for k, v in mid.phases.items()}, buckets=mid.buckets,
               server_version=server.ok("/get_weight_version", method="GET").get("weight_version"))
    except BaseException:
        server_log_tails(a.work)
        raise
    finally:
        if engine is not None:
            engine.close()
        server.stop()
    src = torch.empty(payload, dtype=torch.uint8, device=a.device)
    dst = torch.empty_like(src)
    timed(lambda: dst.copy_(src), a.device, 2)
    f.save(copy_s=statistics.median(timed(lambda: dst.copy_(src), a.device, 10)))


def stream(cmd: list[str], lines: list[str], f: Figures | None = None) -> float:
    """Run `cmd` from the repo root, its output passed through and kept in `lines`; -> seconds.
    With `f`, eval accuracies are saved as they appear (a timeout keeps the last)."""
    print("$ " + " ".join(cmd), flush=True)
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line.rstrip("\n"))
        if f is not None and (m := re.search(r"step (\d+): eval accuracy ([\d.]+)", line)):
            f.save(last_eval={"step": int(m.group(1)), "accuracy": float(m.group(2))},
                   last_eval_at_s=round(time.monotonic() - began, 1))
    rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"exit {rc}: {' '.join(cmd)}")
    return time.monotonic() - began


def step_demo(a: argparse.Namespace, f: Figures) -> None:
    py = [sys.executable, "-m", "tandem.cli"]
    root = a.work / "demo"
    run_root = a.work / "runs"
    common = [f"experiment.device={a.device}", "actor.backend=archon:d1", "rollout.backend=tandem:d1",
              "train.weight_sync=shm", f"experiment.fileroot={run_root}"]
    if a.quick:
        common += ["train.total_steps=3", "train.eval_every=0", "task.eval_size=16", "sft.steps=20"]
    f.save(overrides=common)
    lines: list[str] = []
    began = time.monotonic()
    try:
        f.save(init_s=stream([*py, "init-model", str(root / "base"), "--arch", "qwen3", "--preset", "tiny",
                              "--seed", "0", "--overwrite"], lines))
        f.save(sft_s=stream([*py, "sft", "examples/demo.yaml", f"actor.path={root / 'base'}",
                             f"sft.output={root / 'sft'}", "actor.optimizer.lr=3e-3", "actor.optimizer.lr_scheduler=cosine",
                             "actor.optimizer.warmup_steps_proportion=0.05", *common], lines))
        lines.clear()
        f.save(train_s=stream([*py, "train", "examples/demo.yaml", f"actor.path={root / 'sft'}", "train.overwrite=true",
                               *common], lines, f))
    except BaseException:
        for log in sorted(run_root.glob("*/*/logs/*.log")):
            print(f"--- tail of {log} ---")
            print("\n".join(log.read_text(errors="replace").splitlines()[-30:]), flush=True)
        raise
    finally:
        f.save(wall_s=time.monotonic() - began)
    text = "\n".join(lines)
    if m := re.search(r"eval accuracy: ([\d.]+) -> ([\d.]+)", text):
        f.save(eval_before=float(m.group(1)), eval_after=float(m.group(2)))
    if m := re.search(r"^.*steps: \d+.* in \d+ s.*$", text, re.M):
        f.save(steps_line=m.group(0).strip())
    if m := re.search(r"^.*time: .*$", text, re.M):
        f.save(time_line=m.group(0).strip())


if __name__ == "__main__":
    main()
