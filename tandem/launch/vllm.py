"""Starting a vLLM server (its CPU or GPU build, in an interpreter of its own) with the flags and
environment Tandem's vLLM adapter needs (each one's reason: docs/engines.md).

`start` runs one server on its own (tests); `start_servers` runs a fleet of them as processes of a
`LocalScheduler` (`tandem train` with `rollout.backend=vllm:dN`), which stops them with the run."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import tandem
from tandem.launch.process import free_port
from tandem.launch.scheduler import ServerHandle

if TYPE_CHECKING:
    from tandem.launch.process_scheduler import ProcessScheduler


class _Process(Protocol):
    def poll(self) -> int | None: ...

DEFAULT_VENV = ".venv-vllm"  # what `make vllm-venv` creates
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM 0.32's --max-lora-rank takes
WORKER_EXTENSION = "tandem.weights.vllm_worker.TandemWorkerExtension"


def package_path_entry() -> str:
    """A directory holding only a link named `tandem` to this Tandem package: the PYTHONPATH entry
    that lets another interpreter (vLLM's venv) import it and nothing else of this environment."""
    package = Path(tandem.__file__).resolve().parent
    digest = hashlib.sha256(str(package).encode()).hexdigest()[:12]
    entry = Path(tempfile.gettempdir()) / f"tandem-path-{os.getuid()}-{digest}"
    link = entry / "tandem"
    if not (link.is_symlink() and link.resolve() == package):
        entry.mkdir(mode=0o700, exist_ok=True)
        staged = entry / f".tandem-{os.getpid()}"
        staged.unlink(missing_ok=True)
        staged.symlink_to(package, target_is_directory=True)
        os.replace(staged, link)  # atomic: a concurrent starter sees the old link or the new one
    return str(entry)


def default_vllm_python(root: str | os.PathLike[str] = ".") -> str | None:
    """`<root>/.venv-vllm/bin/python` when it exists, else None."""
    path = Path(root) / DEFAULT_VENV / "bin" / "python"
    return str(path) if path.exists() else None


@dataclass
class VLLMServerSpec:
    """One vLLM server: interpreter, model directory, address, dtype and extra arguments."""

    python: str
    model: str
    port: int
    host: str = "127.0.0.1"
    dtype: str = "float32"
    served_model_name: str | None = None
    max_model_len: int = 2048
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on the CPU build
    threads: int | None = None  # OMP_NUM_THREADS
    worker_extension: bool = True  # load Tandem's worker extension (updates over a group, staged commit)
    tensor_parallel_size: int = 1  # --tensor-parallel-size: one worker per device
    enforce_eager: bool = False  # True: --enforce-eager (starts faster, decodes slower); False: vLLM's default, compiled
    # LoRA adapters of rank <= lora_rank (--max-lora-rank: the smallest of `LORA_RANKS` that holds it), up to
    # max_loras in one batch, loaded at run time (`tandem.weights.vllm_lora`); None: no LoRA (with it the CPU
    # build runs uncompiled).
    lora_rank: int | None = None
    max_loras: int = 1
    extra_args: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", self.host, "--port", str(self.port), "--dtype", self.dtype,
               "--logprobs-mode", "processed_logprobs", "--enable-scale-out", "--max-model-len",
               str(self.max_model_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.worker_extension:
            cmd += ["--worker-extension-cls", WORKER_EXTENSION]
        if self.lora_rank is not None:
            cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(self.lora_rank)),
                    "--max-loras", str(self.max_loras)]
        return cmd + list(self.extra_args)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if self.tensor_parallel_size > 1:
            # The CPU build's automatic binding puts each worker on a NUMA node of its own and
            # refuses more workers than nodes; unbound, the workers share the server's cores.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if self.lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # the /v1/load_lora_adapter route
        if self.worker_extension:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_path_entry(), env.get("PYTHONPATH")) if p)
        return env

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def max_lora_rank(rank: int) -> int:
    """The --max-lora-rank that serves adapters of `rank`: the smallest of `LORA_RANKS` at least
    `rank` (ValueError above the largest)."""
    for size in LORA_RANKS:
        if size >= rank:
            return size
    raise ValueError(f"vLLM serves LoRA adapters of rank {LORA_RANKS[-1]} at most, not {rank}")


def wait_healthy(url: str, proc: _Process | None, timeout_s: float, log: Path | None = None) -> None:
    """Poll `url`/health every 0.5 s until it answers 200; raise RuntimeError (with the log's tail)
    when the process exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and (rc := proc.poll()) is not None:
            raise RuntimeError(f"vLLM server at {url} exited with {rc}{_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM server at {url} was not healthy within {timeout_s:.0f}s{_tail(log)}")


def start(spec: VLLMServerSpec, log: Path, timeout_s: float = 300.0) -> subprocess.Popen:
    """Run the server (output to `log`) and wait until it is healthy; the caller stops it."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(spec.command(), env=spec.env(), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(spec.url, proc, timeout_s, log)
    except BaseException:
        stop(proc)
        raise
    return proc


def start_servers(scheduler: ProcessScheduler, specs: Sequence[VLLMServerSpec], *, name: str = "rollout",
                  env: dict[str, str] | None = None, timeout_s: float = 300.0) -> list[ServerHandle]:
    """Start one server per spec as the scheduler's processes (logs in its log directory, stopped
    with it) and return once every one is healthy; on a failure, stop them and raise RuntimeError
    with the log's tail."""
    procs = []
    try:
        first = 0
        for i, spec in enumerate(specs):
            devices = list(range(first, first + spec.tensor_parallel_size))
            first += spec.tensor_parallel_size
            procs.append(scheduler._launch_server(f"{name}-{i}", spec.command(),
                                                  scheduler._env(spec.env(dict(env or {}))), devices, "cpu"))
        deadline = time.monotonic() + timeout_s
        for spec, proc in zip(specs, procs, strict=True):
            wait_healthy(spec.url, proc, max(1.0, deadline - time.monotonic()), proc.log_path)
    except BaseException:
        scheduler._stop(procs, grace_s=5.0)
        raise
    handles = [ServerHandle(p.name, s.host, s.port, p.pid, p.log_path) for s, p in zip(specs, procs, strict=True)]
    scheduler.servers.extend(handles)
    return handles


def specs_for(count: int, python: str, model: str, **fields: object) -> list[VLLMServerSpec]:
    """`count` specs on free loopback ports."""
    return [VLLMServerSpec(python, model, free_port(), **fields) for _ in range(count)]  # type: ignore[arg-type]


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the server's process group (its engine core is a child), then SIGKILL if needed."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def _tail(log: Path | None, chars: int = 3000) -> str:
    if log is None or not log.exists():
        return ""
    return "; log tail:\n" + log.read_text(errors="replace")[-chars:]

