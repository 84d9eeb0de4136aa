"""A reward model as the episode's reward (`tandem.rollout.reward_model`) against real `tandem serve
--is-embedding` processes: the rewards it sets equal transformers' score of each sequence, in both
modes, and a reward server SIGKILLed while scoring costs no episode."""

from __future__ import annotations

import pytest
import torch
import transformers

from tandem.data.trajectory import Trajectory
from tandem.fleet.ops import Deadlines
from tandem.rollout.health import HealthConfig
from tandem.rollout.reward_model import RewardModelConfig, RewardModelScorer
from tests.inference.server_utils import ServerProcess
from tests.inference.test_classifier_serving import _hf_classifier
from tests.rollout.conftest import run, score_killing_a_server

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return _hf_classifier(tmp_path_factory.mktemp("rm"), "reward", "sequence", 1)


@pytest.fixture(scope="module")
def rm_server(rm_dir, tmp_path_factory):
    server = ServerProcess(rm_dir, tmp_path_factory.mktemp("logs"), "--is-embedding")
    yield server
    server.stop()


def scorer_for(urls: list[str], rm_dir, mode: str = "replace", **config) -> RewardModelScorer:
    return RewardModelScorer(urls, RewardModelConfig(path=str(rm_dir), **config), mode=mode,
                             health=HealthConfig(interval_s=0.5), grace_s=60.0, deadlines=Deadlines(http_s=10.0))


def episode(ids: list[int], generated: int, reward: float) -> Trajectory:
    mask = [0] * (len(ids) - generated) + [1] * generated
    return Trajectory(input_ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids), versions=[-1] * len(ids),
                      reward=reward)


def hf_scores(rm_dir, sequences: list[list[int]]) -> list[float]:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(torch.tensor([ids])).logits[0, 0]) for ids in sequences]


@pytest.mark.parametrize("mode", ["replace", "add"])
def test_rewards_are_the_models_scores(rm_server, rm_dir, mode):
    """A group of three samples (one /classify call): each reward is transformers' score of its
    whole sequence (replace) or the workflow's reward plus it (add), within 1e-5; the task's
    reward and the score stay in info."""
    group = [episode([5, 6, 7, 40, 41], 2, 1.0), episode([5, 6, 7, 90], 1, 0.0), episode([5, 6, 7, 8, 9, 10], 3, 0.5)]
    task = [t.reward for t in group]
    scorer = scorer_for([rm_server.url], rm_dir, mode)
    try:
        run(scorer.ascore(group))
    finally:
        scorer.close()
    want = hf_scores(rm_dir, [t.input_ids for t in group])
    for t, r, s in zip(group, task, want, strict=True):
        assert abs(t.info["reward_model_score"] - s) < 1e-5 and t.info["task_reward"] == r
        assert abs(t.reward - (s if mode == "replace" else r + s)) < 1e-5
    assert scorer.stats()["reward_model/scored_total"] == 3


def test_a_reward_server_killed_while_scoring_loses_no_episode(rm_server, rm_dir, tmp_path):
    """Two reward servers, one SIGKILLed once scoring is under way with calls queued on it: every
    one of 80 episodes is scored (the victim's calls went again to the survivor), each reward the
    survivor's score of it."""
    victim = ServerProcess(rm_dir, tmp_path, "--is-embedding")
    groups = [[episode([3 + i % 200, 4, 5, *range(10, 10 + 60)], 60, 0.0)] for i in range(80)]
    scorer = scorer_for([victim.url, rm_server.url], rm_dir, request_deadline_s=60.0)

    resubmitted = score_killing_a_server(scorer, groups, victim)
    assert resubmitted > 0
    want = hf_scores(rm_dir, [g[0].input_ids for g in groups])
    assert max(abs(g[0].reward - s) for g, s in zip(groups, want, strict=True)) < 1e-5
