"""Parallel dims, meshes, activation checkpointing and the Qwen parallelize plan."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

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
    with pytest.raises(ConfigError, match=r"ep \(3\) must divide dp_shard \* cp \(2\)"):
        ParallelDims(ParallelSizes(dp=2, tp=3, ep=3))
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


def test_qwen_plan_shards_blocks_and_root(one_rank_group):
    assert get_model_spec("qwen3").parallelize is parallelize_qwen
    model = build_model(CONFIG, device="meta")
    dims = ParallelDims.data_parallel(1)
    parallelize_qwen(model, dims, config=ParallelizeConfig(activation_checkpoint="full"))
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert units == ["", "layers.0", "layers.1"]
    assert model.output.weight is model.tok_embeddings.weight  # tied: one parameter, sharded once
    with pytest.raises(NotImplementedError, match="only data parallelism"):
        parallelize_qwen(build_model(CONFIG, device="meta"), ParallelDims(ParallelSizes(tp=2)))


def _hsdp_worker(rank: int, world_size: int, path: str) -> list[float]:
    from tandem.data.balance import karmarkar_karp
    from tandem.train import TrainEngine
    from tests.train.helpers import engine_config, make_batch, train_steps

    batch = make_batch(512)
    local = batch.select(karmarkar_karp(batch.lengths, world_size)[rank])
    engine = TrainEngine(engine_config(path, dp_replicate=2))
    assert engine.parallel_dims.dp_shard == 2 and engine.mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    losses = [s["loss"] for s in train_steps(engine, local, 2)]
    engine.close()
    return losses


@pytest.mark.slow
def test_hsdp_world4_matches_one_rank(tmp_path):
    from tandem.models.tiny import init_model
    from tandem.train import TrainEngine
    from tests.train.helpers import engine_config, make_batch, rel_diff, train_steps

    path = str(init_model(tmp_path / "m", preset="tiny"))
    ranks = run_distributed(_hsdp_worker, 4, args=(path,), timeout=300)
    engine = TrainEngine(engine_config(path))
    ref = [s["loss"] for s in train_steps(engine, make_batch(512), 2)]
    engine.close()
    diff = max(rel_diff(a, b) for r in ranks for a, b in zip(r, ref, strict=True))
    print(f"\n[HSDP 2x2 vs 1 rank] max rel loss diff {diff:.2e}")
    assert diff <= 1e-5
