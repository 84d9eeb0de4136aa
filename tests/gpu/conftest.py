"""The CUDA checks' one device choice, and the model they share.

Every test under tests/gpu runs on `torch.device("cuda")` and is skipped, with the reason, where
CUDA is not available. `TANDEM_TEST_DEVICE=cpu` (or `cuda:1`, ...) runs the same tests on that
device instead: on CPU they are a dry run of the GPU checks (the shared-memory weight update then
goes through /dev/shm segments instead of a CUDA IPC handle, and a one-rank group is gloo's).

Run on a GPU machine: `python3 -m pytest -q -s tests/gpu` (`-s` shows the measured figures).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.inference.conftest import MOE_OVERRIDES, make_model_dir

DEVICE_ENV = "TANDEM_TEST_DEVICE"
# What `tandem serve` imports beyond torch and transformers (pyproject's dependencies): a machine
# image without them fails the server tests at once, naming them, instead of in a server's log.
SERVER_MODULES = ("fastapi", "starlette", "pydantic", "uvicorn", "omegaconf", "aiohttp", "safetensors", "yaml")


def pytest_configure(config):
    # pytest-timeout registers it; registered here too so --strict-markers holds without the plugin.
    config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's per-test limit")
    # No "Loading weights" bars in the log: with -s they would bury the measured figures.
    import transformers

    transformers.utils.logging.disable_progress_bar()


def require_server_modules() -> None:
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"`tandem serve` cannot start here: Python modules {missing} are not installed (carry their "
                    f"wheels: pyproject.toml's dependencies)", pytrace=False)


def chosen_device() -> torch.device:
    """The device of these tests: $TANDEM_TEST_DEVICE, default cuda."""
    return torch.device(os.environ.get(DEVICE_ENV) or "cuda")


@pytest.fixture(scope="session", autouse=True)
def device() -> torch.device:
    """Session-scoped and autouse, so a machine without CUDA skips every test before any module
    fixture (servers, engines) starts."""
    dev = chosen_device()
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"CUDA is not available (torch {torch.__version__}); set {DEVICE_ENV}=cpu to dry-run "
                    f"these GPU tests on CPU")
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
        print(f"\n[gpu tests] {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    else:
        torch.set_num_threads(2)
        print(f"\n[gpu tests] dry run on {dev} (torch {torch.__version__})")
    return dev


@pytest.fixture(autouse=True)
def _clean_process_state():
    """Engines in this process own a one-rank default group: gone after each test."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3 (tied embeddings, 2 layers, vocab 512) with unit-scale random weights, so
    greedy paths and logprobs are varied (tests/inference/conftest.py)."""
    return make_model_dir(tmp_path_factory.mktemp("models"), "qwen3", seed=0)


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE, three layers, the middle one dense (tests/inference/conftest.py)."""
    return make_model_dir(tmp_path_factory.mktemp("models"), "qwen3_moe", seed=0, overrides=MOE_OVERRIDES)


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
