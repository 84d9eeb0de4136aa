"""PPO's models on real trainer ranks (two gloo processes): the reference beside the actor, the
critic beside it or on ranks of its own, one full step through `TrainerModels.update`, and the
critic's state saved and loaded."""

from __future__ import annotations

import pytest
import torch

from tandem.data.trajectory import Trajectory
from tandem.launch import LocalScheduler
from tandem.rl.batch import build_training_batch
from tandem.rl.config import load_run_config
from tandem.rl.dispatch import split_for_ranks
from tandem.rl.models import start_models
from tests.launch.procs import CHILD_ENV, alive

pytestmark = pytest.mark.slow


def _trajectories(n: int = 8) -> list[Trajectory]:
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(n):
        prompt = torch.randint(3, 500, (4 + i % 3,), generator=gen).tolist()
        out = torch.randint(3, 500, (3 + i % 4,), generator=gen).tolist()
        trajs.append(Trajectory.from_generation(prompt, out, [-6.2] * len(out), [0] * len(out),
                                                reward=float(i % 2), group_id=f"g{i // 4}"))
    return trajs


def _logprobs(controller, shards):
    return [lp for out in controller.compute_logprobs(shards, loss_tokens_only=True) for lp in out.logprobs]


@pytest.mark.parametrize("critic_backend", ["", "archon:d1"], ids=["colocated", "own-rank"])
def test_reference_and_critic_beside_a_two_rank_actor(model_dir, tmp_path, critic_backend):
    """Catches: a reference that is not the actor's initial policy (or that the update moves), a
    critic whose first values are not 0, that does not learn, or whose saved state does not come
    back on load; with the critic on a rank of its own, values attached to the wrong sequences."""
    cfg = load_run_config(None, [f"actor.path={model_dir}", "actor.backend=archon:d2", "algo.name=ppo",
                                 "algo.ppo.kl_ctl=0.05", "critic.optimizer.lr=0.01",
                                 *([f"critic.backend={critic_backend}"] if critic_backend else [])])
    sched = LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=10)
    try:
        models = start_models(cfg, sched)
        assert models.reference is not None and models.critic is not None
        assert models.critic.dp_size == (1 if critic_backend else 2)
        assert (models.critic.group is models.actor.group) == (not critic_backend)
        tb, _ = build_training_batch(_trajectories(), cfg.algo, version=0)
        shards, _ = split_for_ranks(tb.batch, 2)
        ref_before = _logprobs(models.reference, shards)
        actor_before = _logprobs(models.actor, shards)
        assert all(torch.equal(a, r) for a, r in zip(actor_before, ref_before, strict=True))  # step 0: the same policy
        critic_shards = split_for_ranks(tb.batch, models.critic.dp_size)[0]
        assert all(not v.any() for out in models.critic.compute_values(critic_shards) for v in out)

        stats = models.update(tb, cfg, version=0)
        print(f"\n[ppo step] value loss {stats['critic/value_loss']:.4f}, kl_ref {stats['ppo/kl_ref']:.4f}, "
              f"policy loss {stats['train/loss']:.4f}")
        assert stats["critic/value_loss"] > 0 and stats["critic/grad_norm"] > 0 and stats["train/grad_norm"] > 0
        # KL(behave || ref) of logprobs -6.2 against the reference's: measured, not zero.
        assert stats["ppo/kl_ref"] != 0.0
        # The update trained the sequences' own values: V, A and R sit on their generated tokens.
        for seq in tb.batch.seqs:
            gen = seq["loss_mask"].bool()
            assert not seq["values"][~gen].any() and not seq["advantages"][~gen].any()
        assert all(torch.equal(a, b) for a, b in zip(ref_before, _logprobs(models.reference, shards), strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(actor_before, _logprobs(models.actor, shards), strict=True))
        values = models.critic.compute_values(critic_shards)
        assert any(v.any() for out in values for v in out)

        models.save(tmp_path / "ckpt" / "trainer")
        models.update(tb, cfg, version=1)  # moves the critic on
        assert not all(torch.equal(a, b) for x, y in zip(values, models.critic.compute_values(critic_shards),
                                                         strict=True) for a, b in zip(x, y, strict=True))
        models.load(tmp_path / "ckpt" / "trainer")
        back = models.critic.compute_values(critic_shards)
        assert all(torch.equal(a, b) for x, y in zip(values, back, strict=True) for a, b in zip(x, y, strict=True))
    finally:
        sched.shutdown()
    assert not [p.pid for p in sched.processes if alive(p.pid)]
