"""A real vLLM server (the CPU build in `.venv-vllm`, `make vllm-venv`) serving a small preset
model, started once per session. The tests skip, printing why, only when that venv cannot be made;
a venv that exists but whose server does not come up fails them."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from tandem.launch import vllm
from tandem.launch.process import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "small"
T = TypeVar("T")


def vllm_python() -> str:
    """The venv's interpreter, made with `make vllm-venv` when missing; pytest.skip with the
    reason when it cannot be made."""
    failed = ROOT / (vllm.DEFAULT_VENV + ".failed")
    python = vllm.default_vllm_python(ROOT)
    stamp = ROOT / vllm.DEFAULT_VENV / ".tandem-vllm-installed"
    if python is None or not stamp.exists():
        began = time.monotonic()
        subprocess.run(["make", "-C", str(ROOT), "vllm-venv", f"PYTHON={sys.executable}"], check=False,
                       timeout=900, capture_output=True)
        print(f"make vllm-venv: {time.monotonic() - began:.0f}s")
        python = vllm.default_vllm_python(ROOT)
    if not stamp.exists() or python is None:
        reason = failed.read_text().strip() if failed.exists() else "make vllm-venv left no venv"
        print(f"vLLM tests skipped: {reason}")
        pytest.skip(f"no vLLM CPU build: {reason}")
    return python


@dataclass
class VLLMServer:
    url: str
    model: Path  # the directory it started from (small preset, seed 0, fp32)
    name: str


def init_model(path: Path, seed: int) -> Path:
    """`tandem init-model --preset small` (head_dim 64: vLLM's CPU attention needs head_dim >= 32)."""
    subprocess.run([sys.executable, "-m", "tandem.cli", "init-model", str(path), "--arch", "qwen3", "--preset",
                    "small", "--seed", str(seed)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("small") / "small", 0)


@pytest.fixture(scope="session")
def vllm_python_path() -> str:
    return vllm_python()


@pytest.fixture(scope="package")  # stopped after tests/engines: it would idle through the rest of the session
def vllm_server(tmp_path_factory, small_model, vllm_python_path):
    root = tmp_path_factory.mktemp("vllm")
    model = small_model
    spec = vllm.VLLMServerSpec(vllm_python_path, str(model), free_port(), served_model_name=MODEL_NAME,
                               threads=1, max_model_len=4096)
    began = time.monotonic()
    proc = vllm.start(spec, root / "server.log", timeout_s=300)
    print(f"vLLM server healthy after {time.monotonic() - began:.1f}s")
    try:
        yield VLLMServer(spec.url, model, MODEL_NAME)
    finally:
        vllm.stop(proc)


@contextlib.contextmanager
def busy_engine(server: VLLMServer, count: int = 32, max_tokens: int = 2000) -> Iterator[None]:
    """`count` long completions (raw HTTP, their answers ignored) running beside a test's request
    until the block ends and they finish or a pause aborts them: every engine step then carries
    `count` + 1 sequences, so the test's request decodes at ~5-25 ms a token (measured: 221 tokens in
    its first second here, 40 with one core busy), not ~2 ms as alone on compiled vLLM (~7 s for 4k). A pause
    sent a second after that request then finds it running however late the request reached the
    engine or however long the machine stalled (both seen in suite runs: a 0.5 s sleep that took
    5 s; a request that reached the engine after the pause)."""
    body = json.dumps({"model": server.name, "prompt": [11, 12, 13], "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 1.0}).encode()

    def complete() -> None:
        request = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as resp:
            resp.read()

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        running = [pool.submit(complete) for _ in range(count)]
        yield
        concurrent.futures.wait(running, 300)


def start_decoding(submit: Callable[[], T], settle_s: float = 1.0) -> T:
    """Call `submit` (which starts one request) and return `settle_s` later, when the request has
    reached the engine and decodes (inside `busy_engine`, for tens of seconds more)."""
    submitted = submit()
    time.sleep(settle_s)
    return submitted
