"""An independent process group for weight transfer between separately started programs.

The trainer's rank 0 and every inference server join a group of their own, next to whatever group
the trainer already uses (FSDP, TP): it is built from its own `TCPStore` (hosted by trainer rank 0
on `master_address:master_port`), not from `init_process_group`, so it never touches the default
group. Both sides call `init_weight_group` with the same address, port, world size and name:

    # trainer (rank 0)                          # server worker i (rank_offset + i)
    g = init_weight_group(addr, port, 0, 2)     g = init_weight_group(addr, port, 1, 2)
    g.broadcast(tensor)                         g.broadcast(buffer)   # receives into buffer
    g.destroy()                                 g.destroy()

Generations: each join adds 1 to a per-name counter in the store, so the k-th formation of a group
named N (every member joining once) uses the key prefix `N/gen{k}` and never sees stale keys of an
earlier one. Backends: gloo (CPU tensors), nccl (CUDA tensors), each constructed directly and wrapped
in a `ProcessGroup`; use the group's own methods (`dist.broadcast(group=...)` refuses such groups).
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tandem.errors import TandemError
from tandem.net import bound_tcp_store

DEFAULT_TIMEOUT_S = 60.0
BACKENDS = ("gloo", "nccl")


class WeightGroupError(TandemError, RuntimeError):
    """The weight-transfer group could not be formed, or a transfer over it failed."""


def host_store(master_address: str, master_port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The store a trainer's rank 0 hosts for the group, listening on `master_address` only (port
    0 picks a free one: `store.port`)."""
    return bound_tcp_store(master_address, master_port, timeout=datetime.timedelta(seconds=timeout_s))


def connect_store(master_address: str, master_port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """A client of the store hosted by trainer rank 0; waits up to `timeout_s` for it to appear."""
    try:
        return dist.TCPStore(master_address, master_port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # torch raises DistStoreError / RuntimeError / TimeoutError
        raise WeightGroupError(f"cannot reach the weight group's store at {master_address}:{master_port}: {exc}") from exc


@dataclass
class WeightGroup:
    name: str
    rank: int
    world_size: int
    backend: str
    pg: Any
    store: Any
    generation: int
    owns_store: bool = False
    _alive: bool = field(default=True, repr=False)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None) -> torch.Tensor:
        """Broadcast `tensor` in place from rank `src` (contiguous, on `self.device`). `timeout_s`
        bounds this one broadcast (default: the group's timeout)."""
        if not self._alive:
            raise WeightGroupError(f"weight group {self.name!r} was destroyed")
        try:
            if timeout_s is None:
                self.pg.broadcast(tensor, root=src).wait()
            else:
                opts = dist.BroadcastOptions()
                opts.rootRank, opts.rootTensor = src, 0
                opts.timeout = datetime.timedelta(seconds=timeout_s)
                self.pg.broadcast([tensor], opts).wait()
        except Exception as exc:
            raise WeightGroupError(f"broadcast over weight group {self.name!r} failed: {exc}") from exc
        return tensor

    def barrier(self) -> None:
        try:
            self.pg.barrier().wait()
        except Exception as exc:
            raise WeightGroupError(f"barrier on weight group {self.name!r} failed: {exc}") from exc

    def destroy(self) -> None:
        """Leave the group (idempotent). The store stays with its host."""
        if not self._alive:
            return
        self._alive = False
        with contextlib.suppress(Exception):  # a peer may already be gone; leaving must not fail
            self.pg.shutdown()


def init_weight_group(master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str = "weight_update_group", backend: str = "gloo",
                      timeout_s: float = DEFAULT_TIMEOUT_S, store: Any | None = None) -> WeightGroup:
    """Join (rank 0: host, unless `store` is given) the group; returns once all `world_size` joined.

    Raises WeightGroupError when the store is unreachable or the peers do not all arrive within
    `timeout_s` (the same bound then applies to each collective)."""
    if backend not in BACKENDS:
        raise WeightGroupError(f"backend {backend!r} is not supported; use one of {', '.join(BACKENDS)}")
    if not (0 <= rank < world_size):
        raise WeightGroupError(f"rank {rank} is outside the group's world of {world_size}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise WeightGroupError("backend 'nccl' needs CUDA; use 'gloo' between CPU processes")
    owns = store is None and rank == 0
    if store is None:
        store = host_store(master_address, master_port, timeout_s) if rank == 0 else \
            connect_store(master_address, master_port, timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        joins = store.add(f"{group_name}/joins", 1)
        generation = (joins - 1) // world_size
        prefixed = dist.PrefixStore(f"{group_name}/gen{generation}", store)
        pg = _make_process_group(prefixed, rank, world_size, backend, timeout)
    except WeightGroupError:
        raise
    except Exception as exc:
        raise WeightGroupError(f"forming weight group {group_name!r} (rank {rank} of {world_size}) failed: {exc}") from exc
    return WeightGroup(group_name, rank, world_size, backend, pg, store, generation, owns_store=owns)


def _make_process_group(store: Any, rank: int, world_size: int, backend: str, timeout: datetime.timedelta) -> Any:
    pg = dist.ProcessGroup(store, rank, world_size)
    if backend == "gloo":
        be = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        kind, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        be = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        kind, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
    pg._set_default_backend(kind)
    pg._register_backend(device, kind, be)
    return pg


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' / 'torch.float32' -> torch dtype; WeightGroupError for anything else."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightGroupError(f"unknown dtype {name!r}")
    return dtype
