"""A real vLLM server (the CPU build in `.venv-vllm`, `make vllm-venv`) serving a small preset
model, started once per session. The tests skip, printing why, only when that venv cannot be made;
a venv that exists but whose server does not come up fails them."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.launch import vllm
from tandem.launch.process import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "small"


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


def generated_tokens(url: str) -> float:
    """The server's count of generated tokens so far (its Prometheus counter `vllm:generation_tokens`)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def wait_generating(url: str, since: float, tokens: int = 20, timeout_s: float = 60.0) -> None:
    """Until the server generated `tokens` more than `since` (`generated_tokens` before the request
    started): a test pauses it only once its request is decoding. (The `vllm:num_requests_running`
    gauge is no such sign: it keeps its last value while the engine is idle.)"""
    deadline = time.monotonic() + timeout_s
    while generated_tokens(url) < since + tokens:
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} generated fewer than {tokens} tokens within {timeout_s:.0f}s")
        time.sleep(0.02)
