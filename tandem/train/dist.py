"""Process-group setup and the few collectives the engine needs, all device- and backend-neutral."""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from tandem.net import bound_tcp_store
from tandem.train.config import DETERMINISTIC_ENV


def default_backend(device: torch.device) -> str:
    return "gloo" if device.type == "cpu" else "nccl"


def resolve_device(name: str) -> torch.device:
    """"cuda" becomes this process's GPU (LOCAL_RANK, as torchrun sets it, else rank modulo GPUs)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
        device = torch.device("cuda", local % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_distributed(device: torch.device, backend: str | None = None, timeout_s: float = 1800) -> bool:
    """Make sure a default process group exists. Returns True when this call created it (the
    caller then owns it and destroys it): from torchrun's env vars when present, else a
    single-rank group with an in-memory store (no launcher, no port)."""
    if dist.is_initialized():
        return False
    backend = backend or default_backend(device)
    timeout = timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        init_from_env(backend, timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True


def init_from_env(backend: str, timeout: timedelta) -> None:
    """The default process group from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), like `init_method="env://"`, except that rank 0's rendezvous store listens on
    MASTER_ADDR only (torch's own listens on every interface)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        store = bound_tcp_store(addr, port, world_size=world, timeout=timeout)
    else:
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def all_reduce_sum(values: list[float], device: torch.device, group: dist.ProcessGroup | None = None) -> list[float]:
    """Sum a few float64 scalars over the group in one collective."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t.tolist()


def seed_everything(seed: int, deterministic: bool, device_type: str = "cpu") -> None:
    """Same seed on every rank (data differs per rank, weights must not). Deterministic mode
    also makes torch pick deterministic kernels (process-wide, and it stays on) and sets
    `DETERMINISTIC_ENV`. On CUDA an op with no deterministic kernel warns instead of raising
    (`warn_only`, Archon's semantics: some CUDA kernels have none, index_add_'s for one); on CPU
    it raises."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        for key, value in DETERMINISTIC_ENV.items():
            os.environ.setdefault(key, value)
        torch.use_deterministic_algorithms(True, warn_only=device_type == "cuda")
        torch.backends.cudnn.benchmark = False


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
