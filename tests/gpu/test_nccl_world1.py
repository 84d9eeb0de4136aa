"""Item 4: one-rank process groups on the device, as Tandem makes them: NCCL on CUDA (gloo on the
CPU dry run).

- The weight-transfer group (`tandem.weights.group.init_weight_group`: a TCPStore on loopback,
  torch's key layout of SGLang's and AReaL's groups): broadcast, with and without a per-call
  timeout, float32 and bfloat16, and an all-reduce; every result equals the input (one rank).
- The trainer's default group (`tandem.train.dist.init_distributed` with an in-memory store, as a
  one-process `TrainEngine` makes it): `all_reduce_sum`, a broadcast and the barrier checkpoint
  saving uses.

(A broadcast *between* a trainer and a server needs two GPUs: NCCL refuses two ranks on one
device, so the `distributed` weight update is not part of these one-GPU checks.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tandem.train.dist import all_reduce_sum, default_backend, init_distributed, resolve_device
from tandem.weights.group import init_weight_group

pytestmark = pytest.mark.timeout(180)

GROUP_TIMEOUT_S = 60.0  # a hung collective fails the test rather than the whole run


def test_one_rank_weight_group_broadcasts_and_all_reduces(device):
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = init_weight_group("127.0.0.1", 0, rank=0, world_size=1, group_name="gpu-check", backend=backend,
                              timeout_s=GROUP_TIMEOUT_S)
    try:
        assert group.device.type == device.type, (group.device, device)
        gen = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16):
            want = torch.randn(4097, generator=gen).to(dtype)
            t = want.to(group.device)
            assert group.broadcast(t, src=0) is t
            group.broadcast(t, src=0, timeout_s=30)
            assert torch.equal(t.cpu(), want), dtype
        t = torch.arange(1000, dtype=torch.float32, device=group.device)
        group.pg.allreduce([t]).wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(t.cpu(), torch.arange(1000, dtype=torch.float32))
        print(f"\n[weight group, {backend} on {group.device}] one-rank broadcast (fp32, bf16) and all-reduce: ok")
    finally:
        group.destroy()


def test_one_rank_default_group_collectives(device):
    dev = resolve_device(str(device))
    assert default_backend(dev) == ("nccl" if device.type == "cuda" else "gloo")
    assert init_distributed(dev, timeout_s=GROUP_TIMEOUT_S)
    assert dist.get_backend() == default_backend(dev) and dist.get_world_size() == 1
    assert all_reduce_sum([1.5, -2.0, 3.25], dev) == [1.5, -2.0, 3.25]
    t = torch.arange(7, dtype=torch.float32, device=dev)
    dist.broadcast(t, src=0)
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.arange(7, dtype=torch.float32))
    dist.barrier()  # as tandem.train.checkpoint calls it
    print(f"\n[default group, {dist.get_backend()} on {dev}] all_reduce_sum, broadcast, all_reduce, barrier: ok")
