"""RolloutController against two real `tandem serve` processes (tiny qwen3, CPU).

- 200 RLVR episodes under staleness bound 1 while the controller bumps versions (pause -> set
  version -> continue): no trajectory older than the bound allows.
- A real disk update in the middle of generation, fanned out by the controller (pause, load,
  version, continue) or run as a trainer runs it (staged load, then a commit that aborts and swaps
  at once): trajectories whose versions change inside the sequence, every token the greedy choice of
  the weights its version names (recomputed with `load_model` on the old and new weights).
- A spawned trainer worker drives pause / disk update / distributed update / destroy / set version /
  continue through `RolloutCallback`, the controller in between; the servers' weights change. While a
  fan-out waits 3 s (the servers wait for the group's rank 0), neither the controller process nor the
  trainer worker burns CPU.
- A `WeightUpdater` whose fleet is a `RolloutCallback` (what `tandem train` does): distributed buckets
  travel flat, one broadcast per bucket; per tensor only for a fleet that does not advertise it; shm
  too; every server holds the sent tensors bit for bit.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import shutil
import time
import traceback
from concurrent.futures import wait as wait_futures
from pathlib import Path

import pytest
import torch

from tandem.fleet import ops
from tandem.fleet.adapters import Capabilities
from tandem.fleet.interface import call
from tandem.fleet.ops import Deadlines, ParamSpec
from tandem.models import load_model, save_model
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.rollout import (
    GenerationParams,
    ModelRequest,
    RewardRunner,
    RLVRWorkflow,
    RolloutCallback,
    RolloutConfig,
    RolloutController,
    RolloutWorkflow,
)
from tandem.rollout.health import HealthConfig
from tandem.weights.group import WeightGroup
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.report import UpdateReport
from tandem.weights.transports import DiskTransport, TransportOptions
from tandem.weights.two_phase import run_update
from tandem.weights.updater import WeightUpdater
from tests.inference.conftest import make_model_dir, prompts
from tests.inference.server_utils import ServerProcess, wait_for
from tests.rollout import rewards
from tests.rollout.controller_proc import proc_cpu_s
from tests.weights.common import CheckpointSource, expected_checksums

pytestmark = pytest.mark.timeout(120)

EMBED = "model.embed_tokens.weight"
Q = "model.layers.0.self_attn.q_proj.weight"


@torch.no_grad()
def perturbed(base: Path, out: Path, seed: int, scale: float = 0.5) -> Path:
    """`base` plus noise of `scale` times each tensor's spread, saved as an HF directory."""
    model = load_model(base)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(scale * p.std().clamp_min(1e-3) * torch.randn(p.shape, generator=gen))
    return save_model(model, out, tokenizer_dir=base)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """Versioned copies as a disk update reads them: v00000000 (base), v00000001, v00000002 (perturbed)."""
    root = tmp_path_factory.mktemp("weights")
    base = make_model_dir(tmp_path_factory.mktemp("base"), "qwen3", seed=0)
    shutil.copytree(base, root / "v00000000")
    perturbed(base, root / "v00000001", seed=1)
    perturbed(base, root / "v00000002", seed=2)
    perturbed(base, root / "distributed", seed=3)
    return root


@pytest.fixture(scope="module")
def servers(weights, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve")
    args = ("--kv-cache-tokens", "8192", "--weight-sync-timeout", "30", "--weights-dir", str(weights))
    started = [ServerProcess(weights / "v00000000", logs, *args, wait=False) for _ in range(2)]  # load side by side
    for server in started:
        server.wait_ready()
    yield started
    for s in started:
        assert s.stop() == 0, s.log.read_text()


@pytest.fixture
def make_controller(servers):
    made: list[RolloutController] = []

    def make(**config) -> RolloutController:
        ctl = RolloutController(RolloutConfig(servers=[s.url for s in servers], request_deadline_s=60, **config))
        made.append(ctl)
        call(ctl, ops.SET_VERSION, ops.SetVersion(0))  # servers echo "0" whatever an earlier test left
        return ctl

    yield make
    for ctl in made:
        ctl.shutdown()


def disk_meta(root: Path, version: int) -> WeightUpdateMeta:
    return WeightUpdateMeta("disk", path=str(root), version=version, deadlines=Deadlines(update_s=60))


def weight_update(ctl: RolloutController, version: int, meta: WeightUpdateMeta | None = None) -> None:
    """protocol.md section 5 step 4, through the controller's fan-out."""
    call(ctl, ops.PAUSE, ops.PauseGeneration())
    if meta is not None:
        call(ctl, ops.LOAD_DISK, ops.DiskLoad(str(meta.versioned_path()), version=meta.version))
    call(ctl, ops.SET_VERSION, ops.SetVersion(version))
    call(ctl, ops.CONTINUE, ops.ContinueGeneration())


def test_staleness_bound_with_real_servers(make_controller):
    eta, batch, steps = 1, 8, 25
    ctl = make_controller(max_concurrent_rollouts=32, consumer_batch_size=batch, max_head_offpolicyness=eta)
    runner = RewardRunner(max_workers=2, timeout_s=10)
    wf = RLVRWorkflow(rewards.parity_reward, GenerationParams(max_new_tokens=24), n_samples=2, reward_runner=runner)
    dataset = [{"input_ids": p, "id": str(i)} for i, p in enumerate(prompts([3 + i % 5 for i in range(200)], seed=1))]
    lags, interrupted = [], 0
    t0 = time.monotonic()
    try:
        for version in range(steps):
            trajs = ctl.prepare_batch(dataset, wf, timeout=60)
            assert len(trajs) == 2 * batch
            for t in trajs:
                gen = t.generated_versions()
                assert gen and gen == sorted(gen)  # versions only move forward inside a sequence
                assert t.min_version >= version - eta, (version, gen)  # the bound
                assert t.max_version <= version  # the fleet never runs ahead of the trainer
                lags.append(version - t.min_version)
                interrupted += t.min_version != t.max_version
            time.sleep(0.02)  # "the training step": episodes that started meanwhile are mid-generation
            weight_update(ctl, version + 1)
    finally:
        runner.close()
    assert len(lags) == 2 * batch * steps  # 200 episodes
    assert max(lags) == eta
    print(f"\n200 episodes in {time.monotonic() - t0:.1f} s; lag histogram "
          f"{dict(sorted((x, lags.count(x)) for x in set(lags)))}, {interrupted} trajectories with two versions")


class Greedy(RolloutWorkflow):
    def __init__(self, max_new_tokens: int):
        self.params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)

    async def arun_episode(self, client, item):
        resp = await client.agenerate(ModelRequest(list(item), self.params))
        return resp.to_trajectory(prompt_id=str(item[0]), info={"aborts": resp.num_aborts})


def generated_tokens(server: ServerProcess) -> int:
    return server.ok("/get_server_info", method="GET")["engine_stats"]["generated_tokens"]


class Saved:
    """A weight source whose checkpoints are already on disk (the `weights` fixture's)."""

    def save_hf(self, path: str | Path, overwrite: bool = False) -> Path:
        return Path(path)


@torch.no_grad()
@pytest.mark.parametrize("how", ["paused", "trainer"])
def test_weight_update_in_the_middle_of_generation(make_controller, servers, weights, how):
    """`paused`: the controller's fan-out of pause, disk load, version and continue. `trainer`: the
    update as a trainer runs it (`run_update`, disk, unverified), which for tandem servers sends the
    staged load and a commit that aborts the requests in flight and swaps in one engine step: no
    pause and no continue. Either way every token is the greedy choice of the weights its version
    names."""
    ctl = make_controller(max_concurrent_rollouts=16, consumer_batch_size=8, max_head_offpolicyness=1)
    weight_update(ctl, 0, disk_meta(weights, 0))  # known starting weights
    models = {0: load_model(weights / "v00000000"), 1: load_model(weights / "v00000001")}
    batch = prompts([4, 7, 5, 9, 3, 6, 8, 5], seed=3)
    before = [generated_tokens(s) for s in servers]
    wf = Greedy(max_new_tokens=400)
    for p in batch:
        ctl.submit(p, wf)
    # Every server is mid-generation (a few tokens per sequence, far from 400), then update.
    wait_for(lambda: all(generated_tokens(s) - b >= 16 for s, b in zip(servers, before, strict=True)),
             timeout=30, interval=0.01)
    if how == "paused":
        weight_update(ctl, 1, disk_meta(weights, 1))
    else:
        sent, send = [], ctl.send
        ctl.send = lambda op, request, targets=None: sent.append(request) or send(op, request, targets)
        # A root of its own: after the commit the transport deletes the root's older versions.
        root = weights / "trainer"
        shutil.copytree(weights / "v00000001", root / "v00000001", dirs_exist_ok=True)
        meta = disk_meta(root, 1)
        transport = DiskTransport(Saved(), ctl, 0, 1, TransportOptions())
        assert run_update(meta, transport, ctl, 0, None, UpdateReport(1, "disk")) is None
        del ctl.send
        assert [type(r) for r in sent] == [ops.DiskLoad, ops.CommitStaged], sent
        assert sent[1] == ops.CommitStaged(1, announce=True, abort_all=True) and ctl.version.value == 1
    trajs = ctl.wait(8, timeout=90)
    assert sorted(t.input_ids[: len(p)] for t, p in zip(trajs, batch, strict=True)) == sorted(batch)
    switched = changed = 0
    worst_gap = worst_logprob = 0.0
    for t in trajs:
        gen = t.generated_versions()
        assert len(gen) == 400 and gen == sorted(gen) and set(gen) <= {0, 1}
        switched += set(gen) == {0, 1}
        ids = torch.tensor(t.input_ids)
        cu = torch.tensor([0, len(ids)], dtype=torch.int32)
        logits = {v: m(ids, cu).float() for v, m in models.items()}
        start = len(ids) - len(gen)
        for pos in range(start, len(ids)):
            v = t.versions[pos]
            row = logits[v][pos - 1]
            # The token the server produced is the greedy choice of the weights its version names,
            # with their logprob: the fp32 path's tolerance, 1e-5, between the server's paged,
            # batched kernels and this full forward (a near-tie may go either way within it).
            gap = float(row.max() - row[ids[pos]])
            error = abs(float(torch.log_softmax(row, -1)[ids[pos]]) - t.logprobs[pos])
            worst_gap, worst_logprob = max(worst_gap, gap), max(worst_logprob, error)
            assert gap <= 1e-5 and error <= 1e-5, (pos, v, gap, error)
            if v == 1 and int(logits[0][pos - 1].argmax()) != int(ids[pos]):
                changed += 1
    print(f"\n{switched}/8 trajectories switched versions mid-sequence; {changed} tokens after the switch "
          f"differ from the old weights' greedy choice; worst logit gap {worst_gap:.2e}, worst logprob error "
          f"{worst_logprob:.2e}")
    assert switched >= 1  # the update landed in the middle of generation
    assert changed > 0  # and the new weights did change what came next


# ------------------------------------------------------------------------ a trainer worker process
def _trainer_worker(callback, weights_root: str, controller_pid: int, go, out) -> None:
    """Rank 0 of the weight group, in a spawned process; reaches the fleet only through `callback`."""
    try:
        from tandem.weights import host_store, init_weight_group

        report: dict = {}
        call(callback, ops.PAUSE, ops.PauseGeneration())
        disk = disk_meta(Path(weights_root), 2)
        call(callback, ops.LOAD_DISK, ops.DiskLoad(str(disk.versioned_path()), commit=False))  # staged ...
        call(callback, ops.COMMIT, ops.CommitStaged(2))  # ... and swapped in on every server
        out.put(("disk", None))
        go.get(timeout=60)  # the test checks the servers' weights
        store = host_store("127.0.0.1", 0)
        meta = WeightUpdateMeta("distributed", master_port=store.port, version=3,
                                deadlines=Deadlines(init_group_s=30, bucket_s=60))
        join = ops.JoinGroup("127.0.0.1", store.port, meta.group_name, "gloo", (1,) * callback.world_size, 60)
        world = join.world_size
        fut = callback.send(ops.JOIN_GROUP, join)
        # The servers now wait for rank 0: the fan-out waits with them. Nobody may spin meanwhile.
        cpu0, ctl0, t0 = time.process_time(), proc_cpu_s(controller_pid), time.monotonic()
        done, _ = wait_futures([fut], timeout=3.0)
        report.update(window_s=time.monotonic() - t0, worker_cpu_s=time.process_time() - cpu0,
                      controller_cpu_s=proc_cpu_s(controller_pid) - ctl0, done_early=bool(done))
        group = init_weight_group("127.0.0.1", store.port, 0, world, meta.group_name, "gloo", 30, store=store)
        fut.result(60)
        tensors = list(iter_hf_tensors(Path(weights_root) / "distributed"))
        specs = [ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors]
        fut = callback.send(ops.STAGE_DISTRIBUTED, ops.DistributedBucket(meta.group_name, tuple(specs), version=3))
        for _, t in tensors:  # overlapped with the servers' receive, as the future allows
            group.broadcast(t.contiguous(), src=0)
        fut.result(60)
        call(callback, ops.LEAVE_GROUP, ops.LeaveGroup(meta.group_name))
        group.destroy()
        call(callback, ops.SET_VERSION, ops.SetVersion(3))
        call(callback, ops.CONTINUE, ops.ContinueGeneration())
        report["world"] = world
        checksums = call(callback, ops.CHECKSUMS, ops.ChecksumsRequest((Q,))).values()
        report["checksums"] = {a: (c.weight_version, c.checksums) for a, c in checksums.items()}
        out.put(("ok", report))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def first_values(server: ServerProcess, name: str, n: int = 8) -> list[float]:
    return server.ok("/get_weights_by_name", {"name": name, "truncate_size": n})


def reference(path: Path, name: str, n: int = 8) -> list[float]:
    return dict(iter_hf_tensors(path))[name].flatten()[:n].tolist()


def test_rollout_callback_from_a_trainer_worker_process(make_controller, servers, weights):
    # One health round (two GETs, 5-25 ms of CPU, several times that on a loaded machine) may land in
    # the measured window and is not the fan-out's: the monitor probes once at start and not again.
    ctl = make_controller(health=HealthConfig(interval_s=3600))
    ctx = mp.get_context("spawn")
    go, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_trainer_worker, args=(ctl.callback(), str(weights), os.getpid(), go, out))
    proc.start()
    try:
        kind, _ = out.get(timeout=90)
        assert kind == "disk", _
        for s in servers:  # disk update landed; the servers are paused meanwhile
            assert first_values(s, Q) == pytest.approx(reference(weights / "v00000002", Q))
            assert s.ok("/get_weight_version", method="GET") == {"weight_version": "2"}
            assert s.ok("/get_server_info", method="GET")["paused"] is True
        assert ctl.executor.stats()["paused"]
        go.put("go")
        kind, report = out.get(timeout=120)
        assert kind == "ok", report
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    for s in servers:  # the broadcast weights are served, under the new version, generation continues
        for name in (Q, EMBED):
            assert first_values(s, name) == pytest.approx(reference(weights / "distributed", name))
        out_ = s.ok("/generate", {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 2}})
        assert out_["meta_info"]["weight_version"] == "3"
    assert ctl.version.value == 3 and not ctl.executor.stats()["paused"]
    print(f"\nfan-out waiting {report['window_s']:.2f} s: controller {report['controller_cpu_s'] * 1000:.0f} ms CPU, "
          f"trainer worker {report['worker_cpu_s'] * 1000:.1f} ms CPU; group world {report['world']}")
    assert report["world"] == 3 and not report["done_early"] and report["window_s"] >= 3.0
    sums = report["checksums"]
    assert sorted(sums) == sorted(s.url for s in servers)
    assert len({(v, tuple(c.items())) for v, c in sums.values()}) == 1 and next(iter(sums.values()))[0] == 3
    assert report["controller_cpu_s"] < 0.1
    assert report["worker_cpu_s"] < 0.1


# ------------------------------------------------------- a WeightUpdater whose fleet is the controller
class PerTensorCallback(RolloutCallback):
    """A callback that does not advertise flat buckets: the updater's SGLang-style fallback."""

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities, flat_buckets=False)


def test_weight_updater_through_the_callback_sends_one_broadcast_per_bucket(make_controller, servers, weights,
                                                                             monkeypatch):
    """`tandem train`'s path: WeightUpdater -> RolloutCallback -> controller -> HttpFleet -> servers.
    Distributed buckets travel flat (ONE uint8 broadcast each, layout forwarded by the controller);
    the servers then hold the sent tensors bit for bit. Shm buckets and checksums go the same way."""
    ctl = make_controller()
    sent: list[torch.Tensor] = []
    real_broadcast = WeightGroup.broadcast

    def counting(group, tensor, src=0, timeout_s=None):  # only the trainer's side runs in this process
        sent.append(tensor)
        return real_broadcast(group, tensor, src, timeout_s)

    monkeypatch.setattr(WeightGroup, "broadcast", counting)
    deadlines = Deadlines(init_group_s=30, bucket_s=60, update_s=120, http_s=30)
    rows = []
    for version, (kind, callback) in enumerate([("distributed", ctl.callback()),
                                                ("distributed", PerTensorCallback(ctl.callback_address(), ctl.secret)),
                                                ("shm", ctl.callback())], start=4):
        assert callback.capabilities.flat_buckets == (type(callback) is RolloutCallback)
        source = CheckpointSource(weights / "distributed", scale=1.0 + version / 8)  # each version differs
        meta = WeightUpdateMeta(kind, bucket_bytes=64 * 1024, deadlines=deadlines)
        sent.clear()
        with WeightUpdater(source, callback, meta, verify=True) as updater:  # verify: checksums forwarded
            report = updater.update(version)
        callback.close()
        rows.append((kind, report.buckets, len(source.tensors), len(sent), report.phases.get("broadcast")))
        assert report.verified and report.buckets >= 3, report
        want = expected_checksums(source.tensors)
        for s in servers:  # bit for bit: every tensor's sha256, and one whole tensor
            assert s.ok("/get_weights_checksum", {})["checksums"] == want
            full = s.ok("/get_weights_by_name", {"name": Q, "truncate_size": source.tensors[Q].numel()})
            assert torch.equal(torch.tensor(full, dtype=torch.float32).view(-1), source.tensors[Q].view(-1))
            assert s.ok("/get_weight_version", method="GET") == {"weight_version": str(version)}
        if kind == "shm":
            assert sent == []
        elif callback.capabilities.flat_buckets:  # one flat uint8 broadcast per bucket
            assert len(sent) == report.buckets and all(t.dtype == torch.uint8 and t.dim() == 1 for t in sent)
            assert sum(t.numel() for t in sent) >= report.bytes
        else:  # one broadcast per tensor
            assert len(sent) == len(source.tensors) > report.buckets
    print("\n" + "\n".join(f"{kind}: {buckets} buckets, {tensors} tensors, {n} broadcasts"
                           f"{'' if t is None else f' ({t * 1000:.0f} ms)'}" for kind, buckets, tensors, n, t in rows))
    assert ctl.version.value == 6 and not ctl.executor.stats()["paused"]
