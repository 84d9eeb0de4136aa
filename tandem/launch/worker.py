"""The trainer worker process: one rank of the SPMD trainer group, driven by RPC.

    python -m tandem.launch.worker --device cpu [--backend gloo] [--name actor-rank0]

started by a scheduler with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
TANDEM_RPC_AUTHKEY / TANDEM_RPC_READY_FD in its environment. It joins the torch.distributed group
(gloo on CPU, NCCL on CUDA, unless --backend says otherwise), listens for the controller on
127.0.0.1 (an ephemeral port written to the ready pipe), then serves a `TrainWorker` until the
controller disconnects or calls `shutdown`, and leaves with `os._exit(0)` (interpreter teardown
after collectives sometimes aborts; the reply has been sent by then).

Every public method of `TrainWorker` is an RPC. The controller calls each on every rank
(`WorkerGroup.call` / `call_per_rank`) because most are collectives.

Loss functions cross the process boundary as a `LossSpec` (a dotted path plus picklable
arguments), never as a lambda. Steps specific to one training loop go through `call(fn_path, ...)`:
the worker imports `fn_path` and runs `fn(worker, *args, **kwargs)`, where `worker.engine` is the
`TrainEngine`, `worker.rank`/`world_size`/`device` describe the rank, and `worker.state` is a dict
that lives as long as the process (for objects kept between calls).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from datetime import timedelta
from typing import Any

from tandem.launch.affinity import apply_cpu_affinity_from_env
from tandem.launch.guard import die_with_parent
from tandem.launch.local import ENV_AUTHKEY, ENV_PARENT_PID, ENV_READY_FD
from tandem.launch.rpc import ExitAfterReply, serve
from tandem.launch.specs import LossSpec, import_object


class TrainWorker:
    """What the controller can ask a trainer rank to do. Collective methods say so."""

    def __init__(self, rank: int, world_size: int, device: Any, backend: str, name: str):
        self.rank, self.world_size, self.device, self.backend, self.name = rank, world_size, device, backend, name
        self.engine: Any = None
        self.updater: Any = None
        self.state: dict[str, Any] = {}

    # ---------------------------------------------------------------------------- basics

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "device": str(self.device),
                "backend": self.backend, "initialized": self.engine is not None}

    def initialize(self, engine_config: Any) -> dict[str, Any]:
        """Build the `TrainEngine` (a `TrainEngineConfig`). Collective."""
        from tandem.train import TrainEngine

        if self.engine is not None:
            raise RuntimeError("the engine is initialised already")
        self.engine = TrainEngine(engine_config)
        n_params = sum(p.numel() for p in self.engine.model.parameters())
        return {"rank": self.rank, "step": self.engine.step, "local_params": int(n_params)}

    def _engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("no engine on this worker yet: call initialize(engine_config) first")
        return self.engine

    # ---------------------------------------------------------------------------- training

    def train_batch(self, batch: Any, loss: LossSpec | str, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on this rank's shard (`SequenceBatch`). Collective."""
        spec = LossSpec(loss) if isinstance(loss, str) else loss
        loss_fn, weight_fn = spec.resolve()
        return self._engine().train_batch(batch, loss_fn, weight_fn, temperature=temperature)

    def forward_logprobs(self, batch: Any, temperature: float = 1.0) -> Any:
        """`TokenOutputs` of this rank's shard. Collective."""
        return self._engine().forward_logprobs(batch, temperature=temperature)

    def step(self) -> int:
        """Optimizer steps taken so far."""
        return int(self._engine().step)

    # ---------------------------------------------------------------------------- checkpoints

    def save_hf(self, path: str, **kwargs: Any) -> str:
        """HF directory of the current weights (kwargs of `TrainEngine.save_hf`). Collective."""
        return str(self._engine().save_hf(path, **kwargs))

    def save_state(self, path: str) -> str:
        """Weights, optimizer, step, LR schedule, RNG (DCP). Collective."""
        return str(self._engine().save_state(path))

    def load_state(self, path: str) -> int:
        """Resume from `save_state`; returns the step. Collective."""
        self._engine().load_state(path)
        return int(self.engine.step)

    # ---------------------------------------------------------------------------- weight sync

    def init_weight_update(self, meta: Any, callback: Any = None, **updater_kwargs: Any) -> None:
        """Prepare weight updates to the fleet (`WeightUpdateMeta`). Rank 0 reaches the fleet
        through `callback` (a `RolloutCallback`), else one built from its environment. Collective."""
        from tandem.weights.updater import WeightUpdater

        self.close_weight_update()
        fleet = None
        if self.rank == 0:
            if callback is None:
                from tandem.rollout.callback import RolloutCallback

                callback = RolloutCallback.from_env()
            fleet = callback
        self.updater = WeightUpdater(self._engine(), fleet, meta, **updater_kwargs)

    def update_weights(self, version: int) -> Any:
        """Move the current weights to every server as `version`; an `UpdateReport`. Collective."""
        if self.updater is None:
            raise RuntimeError("call init_weight_update(meta) first")
        return self.updater.update(version)

    def close_weight_update(self) -> None:
        if self.updater is not None:
            updater, self.updater = self.updater, None
            updater.close()

    # ---------------------------------------------------------------------------- escape hatch

    def call(self, fn_path: str, *args: Any, **kwargs: Any) -> Any:
        """Import `fn_path` ('pkg.mod:fn') and return `fn(self, *args, **kwargs)`."""
        return import_object(fn_path)(self, *args, **kwargs)

    def shutdown(self) -> ExitAfterReply:
        """Reply, then the process leaves (`os._exit(0)`)."""
        with contextlib.suppress(Exception):
            self.close_weight_update()
        step = None if self.engine is None else int(self.engine.step)
        return ExitAfterReply({"rank": self.rank, "pid": os.getpid(), "step": step})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tandem.launch.worker")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (LOCAL_RANK picks the GPU)")
    parser.add_argument("--backend", default=None, help="torch.distributed backend (default: gloo on CPU, nccl on CUDA)")
    parser.add_argument("--name", default=None, help="name in logs")
    parser.add_argument("--pg-timeout", type=float, default=1800.0, help="seconds for rendezvous and each collective")
    args = parser.parse_args(argv)
    apply_cpu_affinity_from_env()

    if (parent := os.environ.get(ENV_PARENT_PID)) is not None:
        die_with_parent(int(parent))
    authkey = bytes.fromhex(os.environ.pop(ENV_AUTHKEY))
    ready_fd = int(os.environ.pop(ENV_READY_FD))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    name = args.name or f"worker-rank{rank}"

    from tandem.train.dist import default_backend, init_from_env, resolve_device

    device = resolve_device(args.device)
    backend = args.backend or default_backend(device)
    init_from_env(backend, timedelta(seconds=args.pg_timeout))
    worker = TrainWorker(rank, world, device, backend, name)

    from multiprocessing.connection import Listener
    from multiprocessing.context import AuthenticationError

    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    os.write(ready_fd, f"{listener.address[1]}\n".encode())
    os.close(ready_fd)
    while True:
        try:
            conn = listener.accept()
            break
        except AuthenticationError:
            continue  # not our controller
    listener.close()
    print(f"{name}: rank {rank}/{world} pid {os.getpid()} {backend} on {device}: serving RPC", flush=True)
    try:
        serve(conn, worker)
    finally:
        print(f"{name}: leaving", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
