"""Launching the fleet and the trainers: the scheduler interface, local processes, worker RPC.

    from tandem.launch import LocalScheduler
    with LocalScheduler("runs/exp1") as sched:
        servers = sched.start_servers("tandem:d2", model_path)    # -> [ServerHandle(url=...)]
        actor = sched.start_workers("archon:d2")                   # -> WorkerGroup (RPC)
        actor.call("initialize", engine_config)                    # every rank, results per rank

The worker entry point and its `TrainWorker` live in `tandem.launch.worker` (not imported here,
so `python -m tandem.launch.worker` runs it cleanly). See docs/launch.md.
"""

from tandem.lazy import lazy_attributes

# Everything loads on first use: the RPC layer pulls in torch, which neither the config room (it
# reads `tandem.launch.affinity` and the scheduler's rules, so `show-config` and the checks before a
# run stay fast) nor the processes that only need `tandem.launch.guard` (each server's exec
# wrapper, every reward pool worker) should pay for.
_LAZY = {
    "LocalScheduler": "tandem.launch.local", "ManagedProcess": "tandem.launch.process",
    "GroupBrokenError": "tandem.launch.rpc_errors", "RemoteError": "tandem.launch.rpc_errors",
    "RPCError": "tandem.launch.rpc_errors", "RPCTimeoutError": "tandem.launch.rpc_errors",
    "WorkerCrashedError": "tandem.launch.rpc_errors",
    "WorkerGroup": "tandem.launch.rpc",
    "LaunchError": "tandem.launch.scheduler", "Scheduler": "tandem.launch.scheduler",
    "ServerHandle": "tandem.launch.scheduler",
    "LossSpec": "tandem.launch.specs", "import_object": "tandem.launch.specs",
}

__getattr__ = lazy_attributes(__name__, _LAZY)


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
