"""The `actor.*` keys the training engine consumes, each shown changing what the engine does:
the optimizer and its schedule (`actor.optimizer.*`), activation checkpointing (counted as the
operations a training step runs), per-block compile, FSDP resharding after forward, the log-prob
chunk size, the process-group backend and CPU offload. Equivalence tests elsewhere (test_engine.py)
show these options leave the numbers alone; these show the options are applied at all."""

from __future__ import annotations

import collections
import math

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.errors import ConfigError
from tandem.parallel import ParallelizeConfig, fsdp_needed, fsdp_units
from tandem.rl.config import load_run_config
from tandem.train import LRSchedule, TrainEngine
from tandem.train.config import OptimizerConfig
from tandem.train.optim import build_optimizer
from tests.train.helpers import engine_config, make_batch, weighted_loss


def _optimizer_config(*overrides: str) -> OptimizerConfig:
    """`actor.optimizer` as the run config loads it (what the engine receives)."""
    return load_run_config(None, list(overrides)).actor.optimizer


def _trajectory(config: OptimizerConfig) -> list[float]:
    """Three AdamW steps of one parameter under fixed, changing gradients."""
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = build_optimizer([param], config, "cpu")
    out = []
    for grad in ([0.3, -0.1, 2.0], [-1.0, 0.4, 0.1], [0.2, 0.2, -3.0]):
        param.grad = torch.tensor(grad)
        opt.step()
        out += param.detach().tolist()
    return out


@pytest.mark.parametrize(("key", "value"), [
    pytest.param("lr", "0.01", id="actor.optimizer.lr"),
    pytest.param("weight_decay", "0.5", id="actor.optimizer.weight_decay"),
    pytest.param("beta1", "0.5", id="actor.optimizer.beta1"),
    pytest.param("beta2", "0.5", id="actor.optimizer.beta2"),
    pytest.param("eps", "1.0", id="actor.optimizer.eps"),
])
def test_optimizer_keys_change_the_updates(key, value):
    """Catches an `actor.optimizer.*` hyperparameter that `build_optimizer` stops passing to AdamW
    (the same gradients must then move the parameter differently)."""
    base = ["actor.optimizer.lr=0.001"]
    before = _trajectory(_optimizer_config(*base))
    after = _trajectory(_optimizer_config(*base, f"actor.optimizer.{key}={value}"))
    print(f"\nactor.optimizer.{key}={value}: {before[-3:]} -> {after[-3:]}")
    assert before != after


def _lrs(*overrides: str, total: int = 10) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = LRSchedule.from_config(opt, _optimizer_config("actor.optimizer.lr=1.0", *overrides), total)
    out = []
    for _ in range(total):
        out.append(schedule.get_lr())
        schedule.step()
    return out


def test_schedule_keys_shape_the_learning_rate():
    """Catches `actor.optimizer.lr_scheduler`, `warmup_steps_proportion` or `min_lr_ratio` not
    reaching `LRSchedule.from_config`, which the engine builds its schedule with."""
    assert _lrs() == [1.0] * 10  # constant, no warmup
    linear = _lrs("actor.optimizer.lr_scheduler=linear")
    assert linear[0] == 1.0 and linear[5] == pytest.approx(0.5) and linear[-1] == pytest.approx(0.1)
    cosine = _lrs("actor.optimizer.lr_scheduler=cosine")
    assert cosine[5] == pytest.approx(0.5) and cosine[2] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    warm = _lrs("actor.optimizer.warmup_steps_proportion=0.4")
    assert warm[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    floor = _lrs("actor.optimizer.lr_scheduler=linear", "actor.optimizer.min_lr_ratio=0.5")
    assert floor[-1] == pytest.approx(0.55) and min(floor) == pytest.approx(0.55)


def test_gradient_clipping_scales_the_update(tiny_dir):
    """Catches `actor.optimizer.gradient_clipping` not reaching the engine's step: the reported
    (pre-clip) norm is the same, the parameters after the step are not. (AdamW is invariant to the
    gradients' scale unless eps is large, so eps=1 makes the update follow the clipped gradient.)"""
    def one_step(clip: float) -> tuple[float, torch.Tensor]:
        opt = OptimizerConfig(lr=1e-2, eps=1.0, weight_decay=0.0, gradient_clipping=clip)
        engine = TrainEngine(engine_config(str(tiny_dir), optimizer=opt))
        stats = engine.train_batch(make_batch(engine.model.args.vocab_size), weighted_loss)
        wq = engine.model.layers["0"].attention.wq.weight  # plain at one float32 rank, else a DTensor
        weight = (wq.full_tensor() if hasattr(wq, "full_tensor") else wq).detach().clone()
        engine.close()
        return stats["grad_norm"], weight

    norm_off, off = one_step(0.0)
    norm_clipped, clipped = one_step(1e-3)
    assert norm_off == pytest.approx(norm_clipped) and norm_off > 1e-3
    assert not torch.allclose(off, clipped)


class _OpCounter(TorchDispatchMode):
    """Counts the aten operations run under it (forward, recompute and backward alike)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _training_step(tiny_dir, parallelize: ParallelizeConfig) -> tuple[dict[str, int], collections.Counter[str]]:
    """One training step: how often each block's attention ran, and the aten operations."""
    engine = TrainEngine(engine_config(str(tiny_dir), parallelize=parallelize))
    calls: collections.Counter[str] = collections.Counter()
    for name, block in engine.model.layers.items():
        block.attention.register_forward_hook(lambda *_, name=name: calls.update([name]))
    batch = make_batch(engine.model.args.vocab_size)
    with _OpCounter() as ops:
        engine.train_batch(batch, weighted_loss)
    engine.close()
    return dict(calls), ops.counts


MATMUL, NORM, ATTENTION = "aten.mm", "aten.rsqrt", "aten._scaled_dot_product_flash_attention_for_cpu"


def test_activation_checkpointing_recomputes_what_the_keys_say(tiny_dir):
    """Catches `actor.parallelize.activation_checkpoint`, `ac_every` or `ac_selective` not being
    applied: in one training step of the two-block model a checkpointed block runs its forward
    again in backward. `full` recomputes everything; `selective` with `ac_every=2` only block 0;
    op-level selective recomputes every block's norms but keeps the matmul and attention outputs."""
    none_calls, none_ops = _training_step(tiny_dir, ParallelizeConfig())
    full_calls, full_ops = _training_step(tiny_dir, ParallelizeConfig(activation_checkpoint="full"))
    every2_calls, _ = _training_step(tiny_dir, ParallelizeConfig(activation_checkpoint="selective", ac_every=2))
    op_calls, op_ops = _training_step(tiny_dir, ParallelizeConfig(activation_checkpoint="selective", ac_every=2,
                                                                   ac_selective="op"))
    print(f"\nattention forwards: none {none_calls}, full {full_calls}, every 2nd {every2_calls}, op {op_calls}")
    print(f"matmul/norm/attention ops: none {[none_ops[k] for k in (MATMUL, NORM, ATTENTION)]}, "
          f"full {[full_ops[k] for k in (MATMUL, NORM, ATTENTION)]}, op {[op_ops[k] for k in (MATMUL, NORM, ATTENTION)]}")
    assert none_calls == {"0": 1, "1": 1}
    assert full_calls == {"0": 2, "1": 2}
    assert every2_calls == {"0": 2, "1": 1}
    assert op_calls == {"0": 2, "1": 2}  # op level: every block, whatever ac_every says
    assert full_ops[MATMUL] > none_ops[MATMUL] and full_ops[ATTENTION] > none_ops[ATTENTION]
    assert op_ops[MATMUL] == none_ops[MATMUL] and op_ops[ATTENTION] == none_ops[ATTENTION]  # kept
    assert op_ops[NORM] > none_ops[NORM]  # recomputed


def test_memory_budget_and_compile_reach_the_blocks(tiny_dir, functorch_config):
    """Catches `actor.parallelize.compile` or `ac_memory_budget` being dropped: compiled blocks
    carry torch.compile's call wrapper (compiled lazily, so building costs nothing), and the
    memory budget becomes compile's partitioner budget."""
    eager = TrainEngine(engine_config(str(tiny_dir)))
    assert all(block._compiled_call_impl is None for block in eager.model.layers.values())
    eager.close()
    for budget in (0.3, 0.7):
        engine = TrainEngine(engine_config(str(tiny_dir), parallelize=ParallelizeConfig(
            activation_checkpoint="memory_budget", ac_memory_budget=budget, compile=True)))
        assert all(block._compiled_call_impl is not None for block in engine.model.layers.values())
        engine.close()
        assert functorch_config.activation_memory_budget == budget


def _sharded_after_forward(tiny_dir, policy: str) -> list[bool]:
    # bfloat16 compute: FSDP casts it, so one rank is sharded too (in float32 it stays plain).
    engine = TrainEngine(engine_config(str(tiny_dir), dtype="bfloat16",
                                       parallelize=ParallelizeConfig(reshard_after_forward=policy)))
    engine.forward_logprobs(make_batch(engine.model.args.vocab_size))
    state = [block._get_fsdp_state()._fsdp_param_group.is_sharded for block in engine.model.layers.values()]
    engine.close()
    return state


def test_reshard_after_forward_frees_the_blocks_it_says(tiny_dir):
    """Catches `actor.parallelize.reshard_after_forward` not reaching FSDP: after a forward the
    blocks' parameters are sharded again (freed) or still gathered as the policy says."""
    assert _sharded_after_forward(tiny_dir, "default") == [True, False]  # the last block stays for backward
    assert _sharded_after_forward(tiny_dir, "always") == [True, True]
    assert _sharded_after_forward(tiny_dir, "never") == [False, False]


def test_one_float32_rank_trains_a_plain_model(tiny_dir):
    """One rank in float32 has nothing to shard or cast: no FSDP units, plain parameters, the tied
    embedding and output head still one parameter, and an optimizer step changes it; bfloat16
    compute (FSDP's cast) and offload keep FSDP."""
    engine = TrainEngine(engine_config(str(tiny_dir)))
    assert fsdp_units(engine.module) == []
    assert not any(hasattr(p, "full_tensor") for p in engine.model.parameters())
    assert engine.model.output.weight is engine.model.tok_embeddings.weight
    before = engine.model.output.weight.detach().clone()
    engine.train_batch(make_batch(engine.model.args.vocab_size), weighted_loss)
    assert engine.model.output.weight is engine.model.tok_embeddings.weight
    assert not torch.equal(before, engine.model.output.weight)
    engine.close()
    bf16 = TrainEngine(engine_config(str(tiny_dir), dtype="bfloat16"))
    assert len(fsdp_units(bf16.module)) == len(bf16.model.layers) + 1
    bf16.close()
    config = ParallelizeConfig()
    assert not fsdp_needed(1, torch.float32, config, pipelined=False)
    assert fsdp_needed(2, torch.float32, config, pipelined=False)
    assert fsdp_needed(1, torch.float32, config, pipelined=True)
    assert fsdp_needed(1, torch.float32, ParallelizeConfig(offload_params=True), pipelined=False)


def test_logprob_chunk_size_splits_the_output_head(tiny_dir):
    """Catches `actor.logprob_chunk_size` being ignored: the output head runs once per chunk of
    tokens (the 165-token batch is one chunk at the default 1024, eleven at 16)."""
    def head_calls(chunk: int) -> int:
        engine = TrainEngine(engine_config(str(tiny_dir), logprob_chunk_size=chunk))
        calls = []
        engine.model.output.register_forward_hook(lambda *_: calls.append(1))
        engine.forward_logprobs(make_batch(engine.model.args.vocab_size))
        engine.close()
        return len(calls)

    assert head_calls(1024) == 1
    assert head_calls(16) == math.ceil(sum(make_batch(512).lengths) / 16)


def test_dist_backend_is_the_process_groups_backend(tiny_dir):
    """Catches `actor.dist_backend` not reaching torch.distributed: None gives gloo on CPU, a
    named backend (torch's in-process `fake` one here, as CPU runs have no other) is used."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend

    engine = TrainEngine(engine_config(str(tiny_dir)))
    assert dist.get_backend() == "gloo"
    engine.close()
    engine = TrainEngine(engine_config(str(tiny_dir), dist_backend="fake"))
    assert dist.get_backend() == "fake"
    engine.close()


def test_offload_params_keeps_parameters_in_host_memory(tiny_dir):
    """Catches `actor.parallelize.offload_params` not reaching FSDP on an accelerator run: the
    sharded parameters and their optimizer state live on the CPU while the compute runs on the
    device. (A CPU run refuses the key: test_offload_is_refused_on_a_cpu_run_with_the_reason.)"""
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="offload_params=true needs an accelerator"):
            TrainEngine(engine_config(str(tiny_dir), parallelize=ParallelizeConfig(offload_params=True)))
        pytest.skip("offload runs on an accelerator only; this machine has none")
    devices = {}
    for offload in (False, True):
        engine = TrainEngine(engine_config(str(tiny_dir), device="cuda",
                                           parallelize=ParallelizeConfig(offload_params=offload)))
        engine.train_batch(make_batch(engine.model.args.vocab_size), weighted_loss)
        weight = engine.model.layers["0"].attention.wq.weight
        state = engine.optimizer.state[weight]
        devices[offload] = (weight.to_local().device.type, state["exp_avg"].to_local().device.type)
        engine.close()
    assert devices == {False: ("cuda", "cuda"), True: ("cpu", "cpu")}
