"""MoE routing replay in the trainer (`actor.router_replay`, tandem.train.routed_experts): r3 forwards use
exactly the batch's routes (rows of -1 route live), r2 update passes replay what the proximal pass
recorded, route agreement on a hand-built case, the load-balancing loss reaches the router, the
CP split keeps routes aligned with the ids, routes travel from trajectories into micro-batches."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from tandem.algo.config import AlgoConfig
from tandem.data.batch import pack_sequences
from tandem.data.trajectory import Trajectory, stack_group
from tandem.models.common.moe import Routing, load_balancing_loss
from tandem.models.loader import load_model
from tandem.models.tiny import init_model
from tandem.parallel.context_split import ContextSplit
from tandem.train import MicroBatchConfig, SequenceBatch, TrainEngine
from tandem.train.logprobs import LogprobModel, _local_routing
from tandem.train.rl_step import ppo_update
from tandem.train.routed_experts import (
    PROX_ROUTED_EXPERTS,
    ROUTED_EXPERTS,
    agreement_counts,
    split_layers,
    stack_layers,
)
from tests.train.helpers import engine_config

LENGTHS = [7, 12, 5, 9]
TOP_K, N_MOE, N_EXPERTS = 2, 2, 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("models") / "moe-tiny", arch="qwen3_moe", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def ref(moe_dir):
    return LogprobModel(load_model(moe_dir, dtype=torch.float32)).eval()


def random_experts(n: int, seed: int) -> torch.Tensor:
    """`[n, MoE layers, top_k]` distinct expert ids per row."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, N_MOE, N_EXPERTS, generator=gen).topk(TOP_K, -1).indices.to(torch.int32)


def make_batch(vocab: int, routes: bool = True, seed: int = 0) -> SequenceBatch:
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i, n in enumerate(LENGTHS):
        seq = {"input_ids": torch.randint(0, vocab, (n,), generator=gen),
               "loss_mask": (torch.arange(n) >= n // 2).long()}
        if routes:
            seq[ROUTED_EXPERTS] = random_experts(n, seed + i)
        seqs.append(seq)
    return SequenceBatch(seqs)


def ref_logprobs(ref: LogprobModel, ids: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids, torch.tensor([0, ids.numel()], dtype=torch.int32), routing=routing)[0]


def live_experts(ref: LogprobModel, ids: torch.Tensor) -> torch.Tensor:
    routing = Routing(record=True)
    ref_logprobs(ref, ids, routing)
    return stack_layers(routing.recorded, [0, 1])


def test_r3_forward_uses_exactly_the_batch_routes_and_unknown_rows_route_live(moe_dir, ref):
    engine = TrainEngine(engine_config(str(moe_dir), router_replay="r3"))
    try:
        batch = make_batch(engine.model.args.vocab_size)
        for seq in batch.seqs:
            seq[ROUTED_EXPERTS][::3] = -1  # unknown rows: these tokens route live
        got = engine.forward_logprobs(batch).logprobs
        moved = 0.0
        for seq, lp in zip(batch.seqs, got, strict=True):
            want = ref_logprobs(ref, seq["input_ids"], Routing(replay=split_layers(seq[ROUTED_EXPERTS], [0, 1], 2)))
            torch.testing.assert_close(lp, want, rtol=0, atol=2e-6)
            moved = max(moved, float((lp - ref_logprobs(ref, seq["input_ids"])).abs().max()))
        assert moved > 1e-2  # the imposed routes really changed the numbers

        # Every row unknown: exactly the live forward (r3 with nothing to replay).
        unknown = SequenceBatch([{**s, ROUTED_EXPERTS: torch.full_like(s[ROUTED_EXPERTS], -1)} for s in batch.seqs])
        plain = SequenceBatch([{k: v for k, v in s.items() if k != ROUTED_EXPERTS} for s in batch.seqs])
        for a, b in zip(engine.forward_logprobs(unknown).logprobs, engine.forward_logprobs(plain).logprobs,
                        strict=True):
            assert torch.equal(a, b)
    finally:
        engine.close()


def test_route_agreement_hand_computed():
    live = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 2], [3, 4]]])
    server = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [-1, -1]], [[2, 1], [4, 3]]])
    # pairs with a known server row: 5; equal sets: (0,0) reordered, (1,0), (2,0), (2,1) reordered.
    assert agreement_counts(live, server) == (4, 5)


def test_agreement_metric_of_a_live_forward(moe_dir, ref):
    """Routing off: the batch's server routes are the live ones except one changed set and one
    reordered row; the proximal pass reports exactly (pairs - 1) / pairs."""
    engine = TrainEngine(engine_config(str(moe_dir)))
    try:
        batch = make_batch(engine.model.args.vocab_size, routes=False)
        for seq in batch.seqs:
            seq[ROUTED_EXPERTS] = live_experts(ref, seq["input_ids"])
        batch.seqs[0][ROUTED_EXPERTS][-1] = -1  # unknown: not counted
        batch.seqs[1][ROUTED_EXPERTS][2, 1] = batch.seqs[1][ROUTED_EXPERTS][2, 1].flip(0)  # same set
        row = batch.seqs[2][ROUTED_EXPERTS][3, 0]
        row[0] = next(e for e in range(N_EXPERTS) if e not in row.tolist())  # another set
        out = engine.forward_logprobs(batch)
        pairs = sum(LENGTHS) * N_MOE - N_MOE
        assert (out.route_matches, out.route_pairs) == (pairs - 1, pairs)
    finally:
        engine.close()


def _ppo_batch(vocab: int) -> SequenceBatch:
    batch = make_batch(vocab, routes=False, seed=3)
    gen = torch.Generator().manual_seed(4)
    for seq in batch.seqs:
        n = seq["input_ids"].numel()
        seq.update(logprobs=-torch.rand(n, generator=gen) * seq["loss_mask"], versions=seq["loss_mask"] - 1,
                   advantages=torch.randn(n, generator=gen))
    return batch


def test_r2_update_passes_replay_the_routes_the_proximal_pass_recorded(moe_dir, ref):
    engine = TrainEngine(engine_config(str(moe_dir), router_replay="r2", mb=MicroBatchConfig(n_mbs=1)))
    calls: list[tuple[torch.Tensor, torch.Tensor, Routing | None, bool]] = []
    forward = engine.module.forward

    def spy(ids, cu, temperature=1.0, wanted=None, routing=None):
        calls.append((ids.clone(), cu.clone(), routing, torch.is_grad_enabled()))
        return forward(ids, cu, temperature, wanted, routing)

    engine.module.forward = spy
    try:
        shard = _ppo_batch(engine.model.args.vocab_size)
        stats = ppo_update(engine, shard, AlgoConfig(), version=0, temperature=1.0, n_minibatches=2)
        assert all(PROX_ROUTED_EXPERTS in s for s in shard.seqs)
        for seq in shard.seqs:  # the proximal pass ran the initial weights, routing live
            assert torch.equal(seq[PROX_ROUTED_EXPERTS], live_experts(ref, seq["input_ids"]))
        prox = [c for c in calls if not c[3]]
        updates = [c for c in calls if c[3]]
        assert len(prox) == 1 and prox[0][2].record and prox[0][2].replay is None
        assert len(updates) == 2
        by_ids = {tuple(s["input_ids"].tolist()): s[PROX_ROUTED_EXPERTS] for s in shard.seqs}
        for ids, cu, routing, _ in updates:
            want = torch.cat([by_ids[tuple(ids[a:b].tolist())] for a, b in pairwise(cu.tolist())])
            got = torch.stack([routing.replay[layer] for layer in (0, 1)], dim=1)
            assert torch.equal(got.to(torch.int32), want)
        assert stats["train/n_loss_tokens"] > 0
    finally:
        engine.close()


def test_r3_live_mismatch_is_the_live_forwards_and_mismatch_the_replayed_ones(moe_dir, ref):
    """r3 with router_replay_live_mismatch: the server routes differ from the live ones on every
    third token of layer 0 and the behaviour logprobs are those of a forward replaying them (what
    that server returns). `mismatch/*` is the replayed forward's (~0) and `moe/mismatch_live/*`
    equals the hand-computed |behaviour - live forward (`Routing()`)| over the loss tokens, with
    the proximal pass fused into the update (one minibatch) and separate (two)."""
    from tandem.algo.losses import to_input_alignment

    shard = _ppo_batch(512)
    live_diff = []
    for seq in shard.seqs:
        ids, mask = seq["input_ids"], seq["loss_mask"].bool()
        routes = live_experts(ref, ids)
        for t in range(0, ids.numel(), 3):
            row = routes[t, 0]
            row[:] = torch.tensor([e for e in range(N_EXPERTS) if e not in row.tolist()][:TOP_K])
        seq[ROUTED_EXPERTS] = routes
        replayed = to_input_alignment(ref_logprobs(ref, ids, Routing(replay=split_layers(routes, [0, 1], TOP_K))))
        live = to_input_alignment(ref_logprobs(ref, ids, Routing()))
        seq["logprobs"] = replayed * mask
        live_diff.append((live - replayed)[mask].double().abs())
    want = torch.cat(live_diff)
    assert float(want.max()) > 1e-3  # the differing routes really move the logprobs
    for n_minibatches in (1, 2):
        engine = TrainEngine(engine_config(str(moe_dir), router_replay="r3", router_replay_live_mismatch=True))
        try:
            assert engine.model.args.vocab_size == 512
            batch = SequenceBatch([dict(s) for s in shard.seqs])
            stats = ppo_update(engine, batch, AlgoConfig(), version=0, temperature=1.0, n_minibatches=n_minibatches)
        finally:
            engine.close()
        assert stats["moe/mismatch_live/mean"] == pytest.approx(float(want.mean()), abs=2e-6), n_minibatches
        assert stats["moe/mismatch_live/max"] == pytest.approx(float(want.max()), abs=2e-6), n_minibatches
        assert stats["mismatch/max"] <= 2e-6 and stats["mismatch/n_tokens"] == want.numel(), stats
        assert stats["moe/route_agreement"] < 1.0
        assert all("live_logprobs" not in s for s in batch.seqs)


def test_live_mismatch_needs_r3(moe_dir):
    from tandem.errors import ConfigError

    for mode in ("off", "r2"):
        with pytest.raises(ConfigError, match=rf"router_replay_live_mismatch=True .* needs router_replay='r3', "
                                              rf"not '{mode}'"):
            TrainEngine(engine_config(str(moe_dir), router_replay=mode, router_replay_live_mismatch=True))


def test_load_balancing_loss_reaches_the_router(moe_dir, ref):
    def no_policy_loss(logprobs, entropy, mb):
        return (logprobs.sum() + entropy.sum()) * 0.0

    grads = {}
    for coef in (0.0, 0.5):
        engine = TrainEngine(engine_config(str(moe_dir), moe_aux_loss_coef=coef))
        try:
            batch = make_batch(engine.model.args.vocab_size, routes=False)
            stats = engine.forward_backward(batch, no_policy_loss)
            grad = engine.model.layers["0"].moe.router.weight.grad
            grads[coef] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        finally:
            engine.close()
    assert float(grads[0.0].abs().max()) == 0.0
    assert float(grads[0.5].abs().max()) > 1e-6
    # One micro-batch: the reported aux loss is the load-balancing loss of the whole packed batch.
    routing = Routing(keep_logits=True)
    ids = torch.cat([s["input_ids"] for s in batch.seqs])
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        ref.model.hidden_states(ids, cu, routing=routing)
    assert stats["aux_loss"] == pytest.approx(float(load_balancing_loss(list(routing.logits.values()), TOP_K)),
                                              rel=1e-5)


def test_context_split_keeps_routes_aligned_with_ids():
    n = 11
    ids = torch.arange(100, 100 + n)
    rows = torch.stack([ids, ids + 1], dim=1)  # row t encodes token t
    for cp in (2, 3):
        for rank in range(cp):
            split = ContextSplit(None, n, cp, rank)  # type: ignore[arg-type]  # no collective used
            local = _local_routing(Routing(replay={3: rows}, record=True, record_live=True), split)
            local_ids = split.local(ids, -1)
            got = local.replay[3]
            real = local_ids >= 0
            assert torch.equal(got[real, 0], local_ids[real]) and torch.equal(got[real, 1], local_ids[real] + 1)
            assert (got[~real] == -1).all()  # padding tokens route live
            assert local.record and local.record_live and not local.recorded


def test_routes_travel_from_trajectories_into_micro_batches():
    def traj(n, routed):
        routes = [[[t, t + 1], [t + 2, t + 3]] for t in range(n)] if routed else None
        return Trajectory.from_generation(list(range(10, 10 + n // 2)), list(range(n - n // 2)),
                                          [-0.5] * (n - n // 2), [0] * (n - n // 2), routed_experts=routes)

    trajs = [traj(5, True), traj(4, False), traj(6, True)]
    assert trajs[0].to_tensors()[ROUTED_EXPERTS].shape == (5, 2, 2)
    packed = stack_group(trajs)[ROUTED_EXPERTS]
    assert packed.shape == (15, 2, 2) and (packed[5:9] == -1).all()
    assert packed[9:, 0, 0].tolist() == list(range(6))

    from tandem.rl.batch import build_training_batch

    batch = build_training_batch(trajs, AlgoConfig(), version=0)[0].batch
    assert all(ROUTED_EXPERTS in s for s in batch.seqs) and (batch.seqs[1][ROUTED_EXPERTS] == -1).all()
    mb = pack_sequences(batch, [2, 0])
    assert torch.equal(mb.tokens[ROUTED_EXPERTS], torch.cat([batch.seqs[2][ROUTED_EXPERTS],
                                                             batch.seqs[0][ROUTED_EXPERTS]]))
    with pytest.raises(ValueError, match="routed_experts"):
        Trajectory([1, 2], [0, 1], [0.0, 0.0], [-1, 0], routed_experts=[[[1, 2]], [[3]]]).to_tensors()


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("models") / "dense-tiny", arch="qwen3", preset="tiny", seed=0)


@pytest.mark.parametrize("overrides, command, match", [
    (["actor.router_replay=r2"], "train", r"actor.router_replay='r2' applies to mixture-of-experts .* dense"),
    (["actor.moe_aux_loss_coef=0.01"], "train", r"actor.moe_aux_loss_coef=0.01 applies to mixture-of-experts"),
])
def test_moe_options_are_refused_for_a_dense_model(dense_dir, overrides, command, match):
    from tandem.errors import ConfigError
    from tandem.rl.config import load_run_config

    with pytest.raises(ConfigError, match=match):
        load_run_config(None, [f"actor.path={dense_dir}", *overrides], command=command)
    with pytest.raises(ConfigError, match=overrides[0].split(".")[1].split("=")[0]):
        TrainEngine(engine_config(str(dense_dir), **{overrides[0].split(".")[1].split("=")[0]:
                                                     "r2" if "replay" in overrides[0] else 0.01}))


@pytest.mark.parametrize("overrides, command, match", [
    (["actor.router_replay=r3", "rollout.backend=vllm:d1", "rollout.servers=[127.0.0.1:1]"], "train",
     r"actor.router_replay='r3' .* vllm servers do not return them"),
    (["actor.router_replay=r2", "actor.backend=archon:p2"], "train", r"router_replay='r2' is not supported with pipeline"),
    (["actor.router_replay=r3"], "sft", r"actor.router_replay='r3' replays routes in RL"),
    (["actor.moe_aux_loss_coef=0.01", "actor.backend=archon:t2"], "train",
     r"moe_aux_loss_coef=0.01 is not supported with tensor parallelism"),
    (["actor.router_replay_live_mismatch=true"], "train",
     r"actor.router_replay_live_mismatch=true .* needs actor.router_replay=r3 \(it is 'off'\)"),
    (["actor.router_replay=r2", "actor.router_replay_live_mismatch=true"], "train",
     r"actor.router_replay_live_mismatch=true .* needs actor.router_replay=r3 \(it is 'r2'\)"),
])
def test_router_replay_config_errors(moe_dir, overrides, command, match):
    from tandem.errors import ConfigError
    from tandem.rl.config import load_run_config

    load_run_config(None, [f"actor.path={moe_dir}", "actor.router_replay=r3", "actor.moe_aux_loss_coef=0.01",
                           "actor.router_replay_live_mismatch=true"])
    with pytest.raises(ConfigError, match=match):
        load_run_config(None, [f"actor.path={moe_dir}", *overrides], command=command)


@pytest.mark.slow
def test_context_parallel_replay_equals_one_rank(moe_dir):
    """Two gloo CP ranks: every rank replays its slice of the routes and returns the whole
    micro-batch's records; log-probs, recorded routes, agreement, aux loss and the router's
    gradient equal one rank's."""
    import torch.distributed as dist

    from tests.distributed import run_distributed
    from tests.train.replay_workers import replay_forward

    batch = make_batch(512)
    for seq in batch.seqs:
        seq[ROUTED_EXPERTS][1::4] = -1
    one = replay_forward(0, 1, str(moe_dir), batch, 1)
    if dist.is_initialized():
        dist.destroy_process_group()
    ranks = run_distributed(replay_forward, 2, args=(str(moe_dir), batch, 2), timeout=300)
    for got in ranks:
        for a, b in zip(got["logprobs"], one["logprobs"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
        for a, b, seq in zip(got["routes"], one["routes"], batch.seqs, strict=True):
            assert torch.equal(a, b)
            known = (seq[ROUTED_EXPERTS] >= 0).all(-1)
            assert torch.equal(a[known], seq[ROUTED_EXPERTS][known].int())  # replayed where known
        assert got["counts"] == one["counts"] and one["counts"][1] > 0
        for key in ("loss", "aux_loss", "route_matches", "route_pairs"):
            assert got["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5), key
        torch.testing.assert_close(got["grad"], one["grad"], rtol=1e-4, atol=1e-7)


def test_rollouts_ask_for_routes_when_they_are_used(moe_dir, dense_dir):
    from tandem.rl.config import load_run_config
    from tandem.rl.trainer import routed_expert_layout

    layout = routed_expert_layout(load_run_config(None, [f"actor.path={moe_dir}", "actor.router_replay=r3"]))
    assert (layout.num_layers, layout.top_k, layout.moe_layers) == (2, 2, (0, 1))
    assert routed_expert_layout(load_run_config(None, [f"actor.path={moe_dir}"])) == layout  # tandem: agreement metric
    sglang = load_run_config(None, [f"actor.path={moe_dir}"])
    sglang.rollout.backend = "sglang:d1"  # `tandem train` refuses sglang's weight sync today
    assert routed_expert_layout(sglang) is None
    sglang.actor.router_replay = "r3"
    assert routed_expert_layout(sglang) == layout
    assert routed_expert_layout(load_run_config(None, [f"actor.path={dense_dir}"])) is None


LAYOUTS = [{"ep": 2}, {"tp": 2}, {"tp": 2, "etp": 2}]


@pytest.mark.slow
def test_replay_under_expert_and_tensor_parallelism_equals_one_rank(moe_dir):
    """Two gloo ranks at e2 (experts split), t2 (each TP rank routes its token shard with whole
    experts) and t2 with etp=2 (tokens gathered, experts' hidden units split): the replayed
    forward's log-probs, recorded routes and agreement equal one rank's."""
    import torch.distributed as dist

    from tests.distributed import run_distributed
    from tests.train.replay_workers import replay_layouts

    batch = make_batch(512, seed=5)
    for seq in batch.seqs:
        seq[ROUTED_EXPERTS][::3] = -1
    one = replay_layouts(0, 1, str(moe_dir), batch, [{}])[0]
    if dist.is_initialized():
        dist.destroy_process_group()
    ranks = run_distributed(replay_layouts, 2, args=(str(moe_dir), batch, LAYOUTS), timeout=400)
    for got_layouts in ranks:
        for layout, got in zip(LAYOUTS, got_layouts, strict=True):
            for a, b in zip(got["logprobs"], one["logprobs"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=5e-6, msg=lambda m, lay=layout: f"{lay}: {m}")
            for a, b in zip(got["routes"], one["routes"], strict=True):
                assert torch.equal(a, b), layout
            assert got["counts"] == one["counts"], layout


def test_r2_records_routes_under_loglinear_and_r3_needs_server_routes(moe_dir):
    """r2 with several minibatches runs the proximal forward for its routes even when the proximal
    logprobs are interpolated (loglinear), and only then; r3 refuses a batch without routes."""
    from tandem.algo.losses import PROX_LOGPROBS

    engine = TrainEngine(engine_config(str(moe_dir), router_replay="r2"))
    try:
        algo = AlgoConfig()
        algo.ppo.prox_logp = "loglinear"
        for n_minibatches, recorded in ((2, True), (1, False)):
            shard = _ppo_batch(engine.model.args.vocab_size)
            ppo_update(engine, shard, algo, version=0, temperature=1.0, n_minibatches=n_minibatches)
            assert all((PROX_ROUTED_EXPERTS in s) == recorded and PROX_LOGPROBS not in s for s in shard.seqs)
        engine.config.router_replay = "r3"
        with pytest.raises(ValueError, match="router_replay='r3' but the batch carries no routed_experts"):
            ppo_update(engine, _ppo_batch(engine.model.args.vocab_size), AlgoConfig(), version=0, temperature=1.0)
    finally:
        engine.close()
