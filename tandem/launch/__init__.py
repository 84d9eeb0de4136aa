"""Launching processes and carrying RPC to them: the scheduler interface, local processes, RPC.

    with LocalScheduler("runs/exp1") as sched:
        group = sched.start_workers("archon:d2", "tandem.train.worker")   # -> WorkerGroup (RPC)

A worker process runs its caller's module, which hands its object to
`tandem.launch.rpc_server.serve_from_environment`; launch imports nothing from train, rl or
rollout. See docs/launch.md."""

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
    "RunProcesses": "tandem.launch.scheduler", "ServerHandle": "tandem.launch.scheduler",
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
    "RunProcesses",
    "Scheduler",
    "ServerHandle",
    "SlurmScheduler",
    "WorkerCrashedError",
    "WorkerGroup",
    "make_scheduler",
]
