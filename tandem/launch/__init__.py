"""Launching the fleet and the trainers: the scheduler interface, local processes, worker RPC.

    from tandem.launch import LocalScheduler
    with LocalScheduler("runs/exp1") as sched:
        servers = sched.start_servers("tandem:d2", model_path)    # -> [ServerHandle(url=...)]
        actor = sched.start_workers("archon:d2")                   # -> WorkerGroup (RPC)
        actor.call("initialize", engine_config)                    # every rank, results per rank

The worker entry point and its `TrainWorker` live in `tandem.launch.worker` (not imported here,
so `python -m tandem.launch.worker` runs it cleanly). See docs/launch.md.
"""

from tandem.launch.local import LocalScheduler, ManagedProcess
from tandem.launch.rpc import (
    GroupBrokenError,
    RemoteError,
    RPCError,
    RPCTimeoutError,
    WorkerCrashedError,
    WorkerGroup,
)
from tandem.launch.scheduler import LaunchError, Scheduler, ServerHandle
from tandem.launch.specs import LossSpec, import_object

__all__ = [
    "GroupBrokenError",
    "LaunchError",
    "LocalScheduler",
    "LossSpec",
    "ManagedProcess",
    "RPCError",
    "RPCTimeoutError",
    "RemoteError",
    "Scheduler",
    "ServerHandle",
    "WorkerCrashedError",
    "WorkerGroup",
    "import_object",
]
