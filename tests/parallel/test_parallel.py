"""Parallel dims, meshes, activation checkpointing and the Qwen parallelize plan."""

from __future__ import annotations

import logging
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from tandem.config.fields import validate
from tandem.config.parallel_sizes import ParallelSizes
from tandem.errors import ConfigError
from tandem.models import build_model, get_model_spec
from tandem.models.qwen import parallelize_qwen
from tandem.models.tiny import hf_config_for
from tandem.parallel import ParallelDims, ParallelizeConfig, apply_activation_checkpointing
from tests.distributed import run_distributed

CONFIG = hf_config_for("qwen3", "tiny", {"eos_token_id": 1, "pad_token_id": 0})


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_parallel_dims_split_and_validate():
    dims = ParallelDims.data_parallel(8, dp_replicate=2)
    assert dims.dp_shard == 4 and dims.dp_size == 8 and dims.fsdp_enabled and dims.only_data_parallel
    assert dims.mesh_sizes() == {"pp": 1, "dp_replicate": 2, "dp_shard": 4, "cp": 1, "tp": 1}
    assert ParallelDims(ParallelSizes(dp=2, tp=2, pp=2)).dp_shard == 2
    assert ParallelDims(ParallelSizes(dp=2, tp=2, pp=2)).world_size == 8
    with pytest.raises(ConfigError, match="must be >= 1 and divide the data-parallel size 6"):
        ParallelDims.data_parallel(6, dp_replicate=4)
    with pytest.raises(ConfigError, match=r"ep \(2\) must divide dp_shard \* cp = 3 .* or a multiple of cp\*tp = 6 "
                                          r"with etp=1 \(experts folded over the TP ranks\)"):
        ParallelDims(ParallelSizes(dp=1, cp=3, tp=2, ep=2))
    with pytest.raises(ConfigError, match=r"ep \(2\) must divide dp_shard \* cp = 4 and be a multiple of cp = 4"):
        ParallelDims(ParallelSizes(dp=1, cp=4, ep=2))
    with pytest.raises(ConfigError, match=r"ep \(8\) spans the 2 context- and tensor-parallel ranks .* and 4 "
                                          r"data-parallel ranks, more than the 2 there are"):
        ParallelDims(ParallelSizes(dp=4, tp=2, ep=8), dp_replicate=2)  # HSDP: 2 FSDP shards per replica
    # MoE parallel folding: ep over the TP ranks (and the CP ones), etp 1.
    assert ParallelDims(ParallelSizes(dp=2, tp=3, ep=3)).ep_folds_tp
    assert ParallelDims(ParallelSizes(dp=1, cp=2, tp=2, pp=4, ep=4, etp=1, edp=1)).ep_folds_tp
    assert not ParallelDims(ParallelSizes(dp=2, tp=2, ep=2, etp=2)).ep_folds_tp  # ETP: ep over d x c
    with pytest.raises(ConfigError, match=r"etp \(4\) must be 1 or tp \(2\)"):
        ParallelDims(ParallelSizes(dp=2, tp=2, ep=1, etp=4, edp=1))
    with pytest.raises(ConfigError, match="tp must be >= 1"):
        ParallelSizes(tp=0)
    with pytest.raises(ConfigError, match="activation_checkpoint"):
        validate(ParallelizeConfig(activation_checkpoint="some"))


def test_mesh_on_one_rank(one_rank_group):
    dims = ParallelDims.data_parallel(1)
    mesh = dims.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp_shard",) and dims.fsdp_mesh(mesh).size() == 1
    assert not dims.fsdp_enabled and dims.dp_group(mesh) is None


def test_activation_checkpointing_keeps_names_and_values():
    model = build_model(CONFIG, seed=0)
    names = [n for n, _ in model.named_parameters()]
    ids, cu = torch.randint(0, 512, (12,)), torch.tensor([0, 5, 12], dtype=torch.int32)
    ref = model(ids, cu)
    chosen = apply_activation_checkpointing(model.layers, "selective", every=2)
    assert chosen == ["0"]
    assert [n for n, _ in model.named_parameters()] == names
    out = model(ids, cu)
    out.sum().backward()
    assert torch.equal(out, ref) and model.layers["0"].attention.wq.weight.grad is not None


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.computing = 0  # ops other than those SAC passes through untouched (detach, ...)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        self.computing += func not in SAC_IGNORED_OPS
        return func(*args, **(kwargs or {}))


def _ops_of_a_training_step(mode: str, selective: str = "layer", debug: bool = False,
                            counter: _OpCounter | None = None) -> tuple[Counter[str], torch.Tensor]:
    model = build_model(CONFIG, seed=0)
    apply_activation_checkpointing(model.layers, mode, selective=selective, debug=debug)
    ids, cu = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(0)), torch.tensor([0, 5, 12])
    with counter or _OpCounter() as counted:
        model(ids, cu).square().mean().backward()
    return counted.counts, model.layers["0"].attention.wq.weight.grad


def test_op_level_selective_checkpointing_keeps_matmuls_and_recomputes_the_rest():
    """Counted in one forward + backward: full AC runs every block's forward twice (matmuls and
    norms alike); op-level keeps matmul outputs (no extra mm) and recomputes the elementwise ops."""
    plain, g_plain = _ops_of_a_training_step("none")
    full, g_full = _ops_of_a_training_step("full")
    op_level, g_op = _ops_of_a_training_step("selective", "op")
    assert full["aten.mm"] > plain["aten.mm"] and op_level["aten.mm"] == plain["aten.mm"], (plain, full, op_level)
    assert op_level["aten.rsqrt"] > plain["aten.rsqrt"]  # the norms are recomputed
    assert torch.equal(g_plain, g_full) and torch.equal(g_plain, g_op)


AC_DEBUG = re.compile(r"ac_debug (layers\.\d+) \((.+?)\) (forward|backward): (.*)")


def _ac_debug_lines(caplog, mode: str, selective: str) -> tuple[dict[tuple[str, str], str], int, torch.Tensor]:
    """{(block, phase): logged text}, the ops (SAC's ignored ones aside) a debug training step ran,
    and a gradient."""
    counter = _OpCounter()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tandem.parallel.activation_checkpoint"):
        _, grad = _ops_of_a_training_step(mode, selective, debug=True, counter=counter)
    lines = {(m[1], m[3]): m[4] for r in caplog.records if (m := AC_DEBUG.match(r.getMessage()))}
    return lines, counter.computing, grad


def test_ac_debug_logs_what_each_block_saves_and_recomputes(caplog):
    """Catches a debug log that miscounts (against op counts taken outside it, and the hand count of
    a Qwen3 block: 7 projections, one attention) or that changes training (gradients bit-equal)."""
    plain = _OpCounter()
    _, g_plain = _ops_of_a_training_step("none", counter=plain)
    recomputed = re.compile(r"recomputed (\d+) ops")
    for mode, selective in (("selective", "op"), ("full", "layer")):
        lines, computing, grad = _ac_debug_lines(caplog, mode, selective)
        print(f"\n[ac_debug {mode}/{selective}]", *(f"{k}: {v}" for k, v in lines.items()), sep="\n  ")
        assert set(lines) == {(f"layers.{i}", phase) for i in range(CONFIG["num_hidden_layers"])
                              for phase in ("forward", "backward")}
        assert torch.equal(grad, g_plain)
        # Every op a block ran again in backward is counted once: the step's extra ops.
        logged = sum(int(recomputed.match(text)[1]) for (_, phase), text in lines.items() if phase == "backward")
        assert logged == computing - plain.computing > 0
        forward = lines[("layers.0", "forward")]
        if selective == "op":
            assert forward.startswith("saved the outputs of 8 ops (aten.mm x7, aten._scaled_dot_product_")
            assert "aten.mm" not in lines[("layers.0", "backward")]  # matmuls are served, not recomputed
        else:
            assert forward.startswith("saved no op output (only the block's inputs)")
            assert "aten.mm x" in lines[("layers.0", "backward")]
    _, _, grad = _ac_debug_lines(caplog, "selective", "layer")  # every block: every=1
    assert torch.equal(grad, g_plain)


def test_ac_debug_names_the_blocks_layer_level_leaves_alone(caplog):
    model = build_model(CONFIG, seed=0)
    with caplog.at_level(logging.INFO, logger="tandem.parallel.activation_checkpoint"):
        apply_activation_checkpointing(model.layers, "selective", every=2, debug=True)
    assert [r.getMessage() for r in caplog.records] == [
        "ac_debug layer-level selective checkpointing: 1 of 2 blocks recomputed in backward (layers.0); "
        "activations kept, nothing recomputed: layers.1"]


def test_ac_debug_needs_checkpointed_eager_blocks():
    base = ParallelizeConfig(activation_checkpoint="full", ac_debug=True)
    base.check()
    chosen, notes = base.for_device("cuda")
    assert chosen.compile is False and notes == ["compile off: ac_debug observes the ops of eager blocks"]
    with pytest.raises(ConfigError, match=r"ac_debug=true observes each op .* set p\.compile=false"):
        ParallelizeConfig(activation_checkpoint="full", ac_debug=True, compile=True).check("p.")
    for mode in ("none", "memory_budget"):
        with pytest.raises(ConfigError, match=f"checkpoints no block .*resolves to '{mode}'"):
            ParallelizeConfig(activation_checkpoint=mode, ac_debug=True, compile=True if mode != "none" else None).check()
    auto_on_cpu, _ = ParallelizeConfig(ac_debug=True).for_device("cpu")
    with pytest.raises(ConfigError, match="set activation_checkpoint=full or selective, or ac_debug=false"):
        auto_on_cpu.check()


def test_qwen_plan_shards_blocks_and_root(one_rank_group):
    assert get_model_spec("qwen3").parallelize is parallelize_qwen
    model = build_model(CONFIG, device="meta")
    dims = ParallelDims.data_parallel(1)
    # bfloat16 compute: FSDP casts it, so one rank is sharded too
    parallelize_qwen(model, dims, config=ParallelizeConfig(activation_checkpoint="full"), param_dtype=torch.bfloat16)
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert units == ["", "layers.0", "layers.1"]
    assert model.output.weight is model.tok_embeddings.weight  # tied: one parameter, sharded once
    plain = build_model(CONFIG, device="meta")  # one float32 rank: nothing to shard or cast
    parallelize_qwen(plain, dims, config=ParallelizeConfig(activation_checkpoint="full"))
    assert not any(isinstance(m, FSDPModule) for m in plain.modules())
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        parallelize_qwen(build_model(CONFIG, device="meta"), ParallelDims(ParallelSizes(dp=2, ep=2)))


def test_coords_lay_ranks_out_pp_dp_cp_tp():
    sizes = ParallelSizes(dp=2, tp=2)
    assert [sizes.coords(r) for r in (0, 1, 2)] == [
        {"pp": 0, "dp": 0, "cp": 0, "tp": 0}, {"pp": 0, "dp": 0, "cp": 0, "tp": 1}, {"pp": 0, "dp": 1, "cp": 0, "tp": 0}]
    assert [ParallelSizes(dp=2, pp=2).dp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [ParallelSizes(dp=2, cp=2).dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert ParallelSizes(dp=1, pp=2, tp=2).coords(3) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4"):
        sizes.coords(4)
    assert ParallelDims.for_world(8, tp=2, pp=2).sizes == ParallelSizes(dp=2, tp=2, pp=2)
    with pytest.raises(ConfigError, match=r"tp \* pp \* cp = 3 \* 1 \* 1 must divide the trainer's world size 4"):
        ParallelDims.for_world(4, tp=3)


LAYOUTS = {"d2t2": {"tp": 2}, "d2c2": {"cp": 2}, "p2t2": {"pp": 2, "tp": 2}, "d2p2": {"pp": 2},
           "hsdp2x2": {"dp_replicate": 2}, "d4e2": {"ep": 2}, "d2c2e2": {"cp": 2, "ep": 2}}


def _layout_worker(rank: int, world_size: int) -> dict[str, dict]:
    out = {}
    for name, kwargs in LAYOUTS.items():
        dims = ParallelDims.for_world(world_size, **kwargs)
        mesh = dims.build_mesh("cpu")
        sub = {"tp": dims.tp_mesh(mesh), "cp": dims.cp_mesh(mesh), "pp": dims.pp_mesh(mesh)}
        group = dims.dp_group(mesh)
        out[name] = {
            "coords": dims.sizes.coords(rank),
            "dp_ranks": None if group is None else dist.get_process_group_ranks(group),
            "fsdp_ranks": sorted(dist.get_process_group_ranks(dims.fsdp_mesh(mesh).get_group()))
            if dims.fsdp_mesh(mesh).ndim == 1 else dims.fsdp_mesh(mesh).mesh.flatten().tolist(),
            **{f"{k}_ranks": None if m is None else dist.get_process_group_ranks(m.get_group()) for k, m in sub.items()},
            "describe": dims.describe(),
        }
        if dims.ep_enabled:
            out[name]["ep_ranks"] = dist.get_process_group_ranks(dims.ep_mesh(mesh).get_group())
            out[name]["expert_fsdp_ranks"] = dist.get_process_group_ranks(dims.expert_fsdp_mesh(mesh).get_group())
    return out


def _peers(sizes: ParallelSizes, rank: int, vary: str) -> list[int]:
    """Global ranks whose coords equal `rank`'s except along `vary` (from coords alone)."""
    mine = sizes.coords(rank)
    return [r for r in range(sizes.world_size)
            if all(v == mine[k] for k, v in sizes.coords(r).items() if k != vary)]


def test_meshes_agree_with_coords_at_world_4():
    """Every submesh groups exactly the ranks that `ParallelSizes.coords` (the controller's
    dispatch) says differ only along that dim: shards reach the right ranks."""
    results = run_distributed(_layout_worker, 4)
    for name, kwargs in LAYOUTS.items():
        sizes = ParallelDims.for_world(4, **kwargs).sizes
        for rank, per_layout in enumerate(results):
            got = per_layout[name]
            assert got["coords"] == sizes.coords(rank)
            if sizes.dp < 4:
                assert sorted(got["dp_ranks"]) == _peers(sizes, rank, "dp"), (name, rank, got)
            for dim in ("tp", "cp", "pp"):
                want = _peers(sizes, rank, dim) if getattr(sizes, dim) > 1 else None
                assert (got[f"{dim}_ranks"] and sorted(got[f"{dim}_ranks"])) == want, (name, dim, rank, got)
    d2c2 = results[0]["d2c2"]
    assert d2c2["fsdp_ranks"] == [0, 1, 2, 3]  # dp_shard x cp flattened: CP ranks share the shards
    assert results[0]["d2t2"]["describe"] == "pp=1 dp_shard=2 dp_replicate=1 tp=2 cp=1"
    assert results[0]["hsdp2x2"]["dp_ranks"] is None
    # Experts: ep ranks innermost in dp_shard x cp, the expert FSDP mesh over the rest of them.
    assert [(r["d4e2"]["ep_ranks"], r["d4e2"]["expert_fsdp_ranks"]) for r in results] == [
        ([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
    assert [r["d2c2e2"]["ep_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # the cp pairs
    assert results[0]["d2c2e2"]["fsdp_ranks"] == [0, 1, 2, 3]
    assert results[0]["d4e2"]["describe"] == "pp=1 dp_shard=4 dp_replicate=1 tp=1 cp=1 ep=2 etp=1 edp=2"


def _hsdp_worker(rank: int, world_size: int, path: str) -> dict:
    from tandem.data.balance import karmarkar_karp
    from tandem.train import TrainEngine
    from tests.train.helpers import engine_config, full_params, make_batch, train_steps

    batch = make_batch(512)
    local = batch.select(karmarkar_karp(batch.lengths, world_size)[rank])
    engine = TrainEngine(engine_config(path, dp_replicate=2))
    assert engine.parallel_dims.dp_shard == 2 and engine.mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    stats = train_steps(engine, local, 2)
    params = full_params(engine)  # collective: every rank gathers every replica's shards
    engine.close()
    return {"stats": stats, "params": params}


@pytest.mark.slow
def test_hsdp_world4_matches_one_rank(tmp_path):
    """HSDP (2 replicas x 2 shards) against one rank: the loss, the grad norm and every parameter
    after two steps. Catches gradients not reduced across replicas (the loss alone would not: it
    is computed before the update), or reduced twice."""
    from tandem.models.tiny import init_model
    from tandem.train import TrainEngine
    from tests.train.helpers import (
        engine_config,
        full_params,
        make_batch,
        max_param_diff,
        rel_diff,
        train_steps,
    )

    path = str(init_model(tmp_path / "m", preset="tiny"))
    ranks = run_distributed(_hsdp_worker, 4, args=(path,), timeout=300)
    engine = TrainEngine(engine_config(path))
    ref = train_steps(engine, make_batch(512), 2)
    ref_params = full_params(engine)
    engine.close()
    for r in ranks:
        pairs = list(zip(r["stats"], ref, strict=True))
        loss = max(rel_diff(a["loss"], b["loss"]) for a, b in pairs)
        gnorm = max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in pairs)
        param = max_param_diff(r["params"], ref_params)
        print(f"\n[HSDP 2x2 vs 1 rank] max rel diff: loss {loss:.2e}, grad norm {gnorm:.2e}; max |param diff| {param:.2e}")
        assert loss <= 1e-5 and gnorm <= 1e-5 and param <= 1e-5
