"""Launching processes and carrying RPC to them: the scheduler interface, local processes, RPC.

    from tandem.launch import LocalScheduler
    with LocalScheduler("runs/exp1") as sched:
        servers = sched.start_servers("tandem:d2", model_path)    # -> [ServerHandle(url=...)]
        group = sched.start_workers("archon:d2", "tandem.train.worker")   # -> WorkerGroup (RPC)
        group.call(TrainWorker.ping)                               # every rank, results per rank

What a worker process runs is its caller's module (the trainer's: `tandem.train.worker`, driven
through `tandem.train.TrainController`); launch imports nothing from train, rl or rollout. A
worker module hands its object to `tandem.launch.rpc_server.serve_from_environment`. See
docs/launch.md.
"""

from tandem.lazy import lazy_attributes

# Everything loads on first use: the RPC layer pulls in torch, which neither the config room (it
# reads `tandem.launch.affinity` and the scheduler's rules, so `show-config` and the checks before a
# run stay fast) nor the processes that only need `tandem.launch.guard` (each server's exec
# wrapper, every reward pool worker) should pay for.
_LAZY = {
    "LocalScheduler": "tandem.launch.local", "ManagedProcess": "tandem.launch.process",
    "SlurmScheduler": "tandem.launch.slurm", "RayScheduler": "tandem.launch.ray_cluster",
    "ProcessScheduler": "tandem.launch.process_scheduler", "make_scheduler": "tandem.launch.factory",
    "GroupBrokenError": "tandem.launch.rpc", "RemoteError": "tandem.launch.rpc",
    "RPCError": "tandem.launch.rpc", "RPCTimeoutError": "tandem.launch.rpc",
    "WorkerCrashedError": "tandem.launch.rpc",
    "WorkerGroup": "tandem.launch.rpc",
    "LaunchError": "tandem.launch.scheduler", "Scheduler": "tandem.launch.scheduler",
    "ServerHandle": "tandem.launch.scheduler",
}

__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "GroupBrokenError",
    "LaunchError",
    "LocalScheduler",
    "ManagedProcess",
    "ProcessScheduler",
    "RPCError",
    "RPCTimeoutError",
    "RayScheduler",
    "RemoteError",
    "Scheduler",
    "ServerHandle",
    "SlurmScheduler",
    "WorkerCrashedError",
    "WorkerGroup",
    "make_scheduler",
]
