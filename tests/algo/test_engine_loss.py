"""End to end on a real tiny model: rollouts from the inference engine (behaviour logprobs), the
trainer's recomputed proximal logprobs, the mismatch metric and one decoupled-PPO step through
`TrainEngine.train_batch`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tandem.algo import (
    add_advantages,
    batch_logprob_mismatch,
    make_policy_loss,
    policy_loss_weight,
    recipe,
    set_prox_logprobs,
    shape_rewards,
    summarize_stats,
)
from tandem.algo.losses import PROX_LOGPROBS
from tandem.data.trajectory import Trajectory
from tandem.inference.engine import LLMEngine
from tandem.inference.sampling_params import SamplingParams
from tandem.models.tiny import init_model
from tandem.train import MicroBatchConfig, SequenceBatch, TrainEngine, TrainEngineConfig
from tandem.train.config import OptimizerConfig
from tandem.train.rl_step import ppo_update


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("algo") / "qwen3-tiny", arch="qwen3", preset="tiny", seed=0)


def _rollouts(model_dir, version: int = 0) -> list[Trajectory]:
    llm = LLMEngine(model_dir, kv_cache_tokens=1024, block_size=8, seed=0)
    prompts = [[5, 17, 42, 8], [9, 23, 4]]
    params = SamplingParams(max_new_tokens=6, n=4, seed=1, ignore_eos=True)
    trajs = []
    for out in llm.generate(prompts, params):
        p = int(out.rid.rsplit("-", 1)[1])
        reward = sum(t % 2 == 0 for t in out.output_ids) / len(out.output_ids)  # any varied score
        trajs.append(Trajectory.from_generation(
            prompts[p], out.output_ids, out.output_logprobs, [version] * len(out.output_ids),
            reward=reward, group_id=f"p{p}",
        ))
    return trajs


@pytest.mark.filterwarnings("ignore:index_reduce")  # the inference engine's paged attention
def test_decoupled_ppo_step_on_a_real_engine(tiny_dir):
    torch.set_num_threads(2)
    trajs = _rollouts(tiny_dir)
    cfg = recipe("grpo", max_head_offpolicyness=0)
    batch = SequenceBatch([t.to_tensors() for t in trajs])
    rewards = shape_rewards([t.reward for t in trajs], cfg.reward)
    adv_stats = add_advantages(batch, cfg.advantage, group_ids=[t.group_id for t in trajs], rewards=rewards)
    assert adv_stats["adv_std"] > 0

    engine = TrainEngine(TrainEngineConfig(
        path=str(tiny_dir), optimizer=OptimizerConfig(lr=1e-3), mb=MicroBatchConfig(n_mbs=2),
    ))
    try:
        set_prox_logprobs(batch, engine.forward_logprobs(batch, loss_tokens_only=True).logprobs)
        # Staleness 0: the server sampled with exactly these weights, so the recomputed logprobs
        # match the behaviour logprobs up to float32 numerics.
        mm = batch_logprob_mismatch(batch, current_version=0)
        print(f"\nmismatch fp32 CPU: mean {mm['mismatch/mean']:.2e} max {mm['mismatch/max']:.2e}")
        assert mm["mismatch/n_tokens"] == 8 * 6 and mm["mismatch/current_n_tokens"] == 8 * 6
        assert mm["mismatch/max"] < 1e-4 and mm["mismatch/current_mean"] == mm["mismatch/mean"]

        stats: dict = {}
        out = engine.train_batch(batch, make_policy_loss(cfg.ppo, version=0, stats=stats), policy_loss_weight)
        s = summarize_stats(stats)
        print("train stats:", s)
        assert math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
        assert out["n_loss_tokens"] == s["n_loss_tokens"] == 48 and out["n_mbs"] == 2
        # First minibatch of the step: pi_theta == pi_prox. The training forward runs the same
        # micro-batches through the same kernels as forward_logprobs, so on CPU float32 the ratio
        # is exactly 1 and nothing is clipped; w = pi_prox / pi_behave is 1 up to the mismatch.
        assert s["ratio"] == 1.0 and s["ratio_max"] == 1.0 and s["clip_frac"] == 0 and s["approx_kl"] == 0
        assert abs(s["imp_weight"] - 1) < 1e-4 and s["behave_cap_frac"] == 0
        assert s["loss"] == pytest.approx(out["loss"], rel=1e-5)
        # Advantages are group-normalised (mean 0 per group), so the token-mean loss is ~ -mean(A).
        assert out["loss"] == pytest.approx(-s["advantage"], abs=1e-4)
        assert s["theta_behave_absdiff"] < 1e-4 and math.isfinite(s["entropy"])

        # Next step with the same (now one-version-stale) samples: recomputed prox differs from
        # behaviour, the weight moves away from 1, and the loss still runs; log-linear too.
        set_prox_logprobs(batch, engine.forward_logprobs(batch, loss_tokens_only=True).logprobs)
        stale = batch_logprob_mismatch(batch, current_version=1)
        assert stale["mismatch/current_n_tokens"] == 0 and stale["mismatch/mean"] > 1e-4
        stats = {}
        engine.train_batch(batch, make_policy_loss(cfg.ppo, version=1, stats=stats), policy_loss_weight)
        s = summarize_stats(stats)
        assert abs(s["ratio"] - 1) < 1e-5 and abs(s["imp_weight"] - 1) > 1e-5 and s["behave_approx_kl"] > 0
        loglinear = recipe("grpo", max_head_offpolicyness=1, prox_logp="loglinear").ppo
        out = engine.train_batch(batch, make_policy_loss(loglinear, version=2), policy_loss_weight)
        assert math.isfinite(out["loss"])
    finally:
        engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _grads(engine: TrainEngine) -> list[torch.Tensor]:
    out = []
    for p in engine.model.parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out.append(g.detach().clone())
    return out


@pytest.mark.filterwarnings("ignore:index_reduce")
def test_proximal_logprobs_from_the_training_forward_equal_a_separate_pass(tiny_dir):
    """One optimizer step per batch: taking pi_prox from the training forward (no extra pass) gives
    the same gradient and the same mismatch stats as recomputing it first, also for stale samples
    (behaviour logprobs of other weights, so w = pi_prox / pi_behave != 1)."""
    torch.set_num_threads(2)
    trajs = _rollouts(tiny_dir)
    cfg = recipe("grpo", max_head_offpolicyness=1)
    batch = SequenceBatch([t.to_tensors() for t in trajs])
    add_advantages(batch, cfg.advantage, group_ids=[t.group_id for t in trajs],
                   rewards=shape_rewards([t.reward for t in trajs], cfg.reward))
    engine = TrainEngine(TrainEngineConfig(
        path=str(tiny_dir), optimizer=OptimizerConfig(lr=1e-2), mb=MicroBatchConfig(n_mbs=2),
    ))
    try:
        engine.train_batch(batch, make_policy_loss(cfg.ppo, version=0, prox_from_forward=True),
                           policy_loss_weight)  # now the samples are one version stale
        engine.optimizer.zero_grad(set_to_none=True)
        fused_stats: dict = {}
        fused = make_policy_loss(cfg.ppo, version=1, stats=fused_stats, prox_from_forward=True)
        engine.forward_backward(batch, fused, policy_loss_weight)
        g_fused = _grads(engine)
        engine.optimizer.zero_grad(set_to_none=True)

        set_prox_logprobs(batch, engine.forward_logprobs(batch, loss_tokens_only=True).logprobs)
        mm = batch_logprob_mismatch(batch, current_version=1)
        sep_stats: dict = {}
        engine.forward_backward(batch, make_policy_loss(cfg.ppo, version=1, stats=sep_stats), policy_loss_weight)
        g_sep = _grads(engine)
        engine.optimizer.zero_grad(set_to_none=True)

        assert any(g.abs().max() > 0 for g in g_fused)
        for a, b in zip(g_fused, g_sep, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        f, s = summarize_stats(fused_stats), summarize_stats(sep_stats)
        assert abs(f["imp_weight"] - 1) > 1e-4  # stale samples: a real behaviour correction
        for key in ("imp_weight", "ratio", "loss", "behave_approx_kl", "clip_frac"):
            assert f[key] == pytest.approx(s[key], rel=1e-5, abs=1e-7), key
        assert f["ratio_max"] == 1.0 and f["approx_kl"] == 0.0
        assert f["prox_behave_absdiff"] == pytest.approx(mm["mismatch/mean"], rel=1e-4)
        assert f["prox_behave_absdiff_max"] == pytest.approx(mm["mismatch/max"], rel=1e-4)

        # The RL worker step fuses only with one minibatch; both report the same mismatch keys.
        for n_mb in (1, 2):
            shard = SequenceBatch([t.to_tensors() for t in trajs])
            add_advantages(shard, cfg.advantage, group_ids=[t.group_id for t in trajs],
                           rewards=shape_rewards([t.reward for t in trajs], cfg.reward))
            out = ppo_update(engine, shard, cfg, version=2, temperature=1.0,
                             n_minibatches=n_mb)
            assert (PROX_LOGPROBS in shard.seqs[0]) == (n_mb > 1)
            assert out["mismatch/n_tokens"] == 48 and out["mismatch/current_n_tokens"] == 0
            assert out["mismatch/mean"] > 1e-4 and math.isfinite(out["train/loss"])
    finally:
        engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()
