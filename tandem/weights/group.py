"""An independent process group for weight transfer between separately started programs.

Trainer rank 0 (hosting the group's own `TCPStore`) and every inference server call
`init_weight_group` with the same address, port, world size and name; the group sits next to the
trainer's own groups and never touches the default one. It forms as SGLang's and AReaL's do, so
either side may be theirs; one formation per store (a re-formed group needs a new store). Its
`ProcessGroup` is not registered with torch.distributed: use `WeightGroup.broadcast` / `destroy`
(`dist.broadcast(group=...)` refuses it). The rendezvous in detail: docs/weight-sync.md,
"Transports".

    ranks = group_ranks(devices_per_server)                     # tandem.fleet.ranks
    g = init_weight_group(addr, port, rank, ranks.world_size)   # trainer: 0, then every server device
    g.broadcast(tensor); g.destroy()                            # receivers get it in `tensor`"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tandem.errors import TandemError
from tandem.net import address_towards, bound_tcp_store

DEFAULT_TIMEOUT_S = 60.0
BACKENDS = ("gloo", "nccl")


class WeightGroupError(TandemError, RuntimeError):
    """The weight-transfer group could not be formed, or a transfer over it failed."""


def host_store(master_address: str, master_port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The store a trainer's rank 0 hosts for the group, listening on `master_address` only (port
    0 picks a free one: `store.port`)."""
    return bound_tcp_store(master_address, master_port, timeout=datetime.timedelta(seconds=timeout_s))


def connect_store(master_address: str, master_port: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                  world_size: int | None = None) -> dist.TCPStore:
    """A client of the store hosted by trainer rank 0; waits up to `timeout_s` for it to appear.
    With `world_size` the client counts itself in, as torch's rendezvous clients do (a host
    started by torch's `tcp://` rendezvous waits for all `world_size` members that way)."""
    try:
        return dist.TCPStore(master_address, master_port, world_size, is_master=False,
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
    Interoperates with SGLang's servers and AReaL's trainer (docs/weight-sync.md, "Transports":
    "Rendezvous, as SGLang and AReaL form it").

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
            connect_store(master_address, master_port, timeout_s, world_size=world_size)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        pg = _make_process_group(store, group_name, rank, world_size, backend, timeout, address_towards(master_address))
    except WeightGroupError:
        raise
    except Exception as exc:
        raise WeightGroupError(f"forming weight group {group_name!r} (rank {rank} of {world_size}) failed: {exc}") from exc
    return WeightGroup(group_name, rank, world_size, backend, pg, store, owns_store=owns)


def _make_process_group(store: Any, name: str, rank: int, world_size: int, backend: str,
                        timeout: datetime.timedelta, local_address: str) -> Any:
    """The group under torch's key layout for a group called `name` created on
    `PrefixStore(name, store)` (what SGLang's and AReaL's `init_custom_process_group` do).
    gloo's pairs listen on `local_address`: gloo's default is the address the machine's hostname
    resolves to, often loopback, which peers on another host (or network namespace) cannot reach."""
    group_store = dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
    pg = dist.ProcessGroup(group_store, rank, world_size)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
        be = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", group_store), rank, world_size, opts)
        kind, devices = dist.ProcessGroup.BackendType.GLOO, ("cpu", "cuda")
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        be = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", group_store), rank, world_size, opts)
        kind, devices = dist.ProcessGroup.BackendType.NCCL, ("cuda",)
    be._set_sequence_number_for_group()  # gloo: rank 0 publishes a sequence number the others read
    pg._set_default_backend(kind)
    for device in devices:
        pg._register_backend(torch.device(device), kind, be)
    return pg


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' / 'torch.float32' -> torch dtype; WeightGroupError for anything else."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightGroupError(f"unknown dtype {name!r}")
    return dtype
