"""Run a function on N real processes that form a gloo process group (CPU), and collect results.

    results = run_distributed(my_module.worker, world_size=2, args=(path,))

`worker(rank, world_size, *args)` must be importable (defined at module level): workers are
spawned fresh. The parent holds the group's TCPStore, listening on a port the kernel picked (a
port picked free and then released could be taken meanwhile by another suite running beside this
one: EADDRINUSE); each worker joins the group through it, runs the function, sends its
return value (serialised with torch.save) to the parent and leaves with `os._exit(0)`: interpreter
teardown after gloo work sometimes aborts (SIGABRT), so the reported result, not the exit code,
is the outcome. The parent waits up to `timeout` seconds and kills stragglers.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: Sequence[Any], results) -> None:
    status, payload = "ok", b""
    try:
        torch.set_num_threads(1)
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        payload = buf.getvalue()
    except BaseException:
        status, payload = "error", traceback.format_exc().encode()
    results.put((rank, status, payload))
    results.close()
    results.join_thread()  # the message must be in the pipe before the hard exit below
    os._exit(0)


class DistributedError(RuntimeError):
    pass


def run_distributed(
    fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 180.0
) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` processes; returns the values by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # held until the end
    port = store.port
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, tuple(args), results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) + len(errors) < world_size:
            if time.monotonic() > deadline:
                raise DistributedError(f"timed out after {timeout:.0f}s; results from ranks {sorted(got)}")
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
                if dead and results.empty():
                    time.sleep(0.5)  # a result written just before exit may still be in flight
                    if results.empty():
                        raise DistributedError(f"ranks {dead} exited without a result") from None
                continue
            if status == "ok":
                got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload.decode()}")
                break  # the others are likely blocked in a collective now
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise DistributedError("\n".join(errors))
    return [got[r] for r in range(world_size)]
