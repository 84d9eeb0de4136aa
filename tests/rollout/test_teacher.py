"""The teacher fleet of on-policy distillation (`tandem.rollout.teacher`) against real `tandem
serve` processes: its scores equal the teacher's own forward in transformers, only generated
tokens get one, and a teacher server SIGKILLed while scoring costs no trajectory."""

from __future__ import annotations

import pytest
import torch
import transformers

from tandem.data.trajectory import Trajectory
from tandem.fleet.ops import Deadlines
from tandem.rollout.health import HealthConfig
from tandem.rollout.teacher import TeacherConfig, TeacherScorer
from tests.inference.conftest import make_model_dir
from tests.inference.server_utils import ServerProcess
from tests.rollout.conftest import run, score_killing_a_server

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("teacher"), "qwen3", seed=3)


@pytest.fixture(scope="module")
def teacher_server(teacher_dir, tmp_path_factory):
    server = ServerProcess(teacher_dir, tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def scorer_for(urls: list[str], teacher_dir, **config) -> TeacherScorer:
    return TeacherScorer(urls, TeacherConfig(path=str(teacher_dir), **config), health=HealthConfig(interval_s=0.5),
                         grace_s=60.0, deadlines=Deadlines(http_s=10.0))


def episode(ids: list[int], mask: list[int]) -> Trajectory:
    return Trajectory(input_ids=ids, loss_mask=mask, logprobs=[-1.0 * m for m in mask],
                      versions=[0 if m else -1 for m in mask])


def test_teacher_logprobs_equal_the_teachers_own_forward(teacher_server, teacher_dir):
    """A two-turn trajectory (feedback tokens between the turns, mask 0): each generated token's
    teacher logprob is log_softmax of the teacher's fp32 logits at the position before it, as
    transformers computes them, within 1e-5; prompt and feedback positions hold 0.0."""
    ids = [3, 17, 25, 9, 40, 41, 42, 7, 8, 50, 51, 52, 53]
    mask = [0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    short = episode([5, 6, 7, 8], [0, 0, 0, 1])
    trajs = [episode(ids, mask), short]
    scorer = scorer_for([teacher_server.url], teacher_dir)
    try:
        run(scorer.ascore(trajs))
    finally:
        scorer.close()
    hf = transformers.AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    for t in trajs:
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([t.input_ids])).logits[0].float(), dim=-1)
        expected = [float(logp[i - 1, tok]) if m else 0.0 for i, (tok, m) in enumerate(zip(t.input_ids, t.loss_mask, strict=True))]
        assert t.teacher_logprobs is not None
        diff = max(abs(a - b) for a, b in zip(t.teacher_logprobs, expected, strict=True))
        assert diff < 1e-5, (t.teacher_logprobs, expected)
        assert all(lp < 0 for lp, m in zip(t.teacher_logprobs, t.loss_mask, strict=True) if m)
    assert scorer.stats()["teacher/scored_total"] == 2 and scorer.stats()["teacher/tokens_total"] == 8


def test_a_trajectory_that_generated_nothing_scores_zeros_without_a_call(teacher_dir):
    """Nothing to score: no server is asked (this one does not exist), every entry is 0.0."""
    t = episode([1, 2, 3], [0, 0, 0])
    scorer = scorer_for(["http://127.0.0.1:9"], teacher_dir)
    try:
        run(scorer.ascore([t]))
    finally:
        scorer.close()
    assert t.teacher_logprobs == [0.0, 0.0, 0.0]


def test_a_teacher_server_killed_while_scoring_loses_no_trajectory(teacher_server, teacher_dir, tmp_path):
    """Two teacher servers; one is SIGKILLed once scoring is under way, calls queued on it. Every
    one of 60 trajectories is still scored (the victim's calls went again to the survivor), the
    same as the surviving server alone scores it."""
    victim = ServerProcess(teacher_dir, tmp_path)
    trajs = [episode([3 + i, 4, 5, 6, *range(10, 10 + 48)], [0, 0, 0, 0] + [1] * 48) for i in range(60)]
    reference = [episode(list(t.input_ids), list(t.loss_mask)) for t in trajs]
    scorer = scorer_for([victim.url, teacher_server.url], teacher_dir, request_deadline_s=60.0)

    resubmitted = score_killing_a_server(scorer, [trajs], victim)
    assert all(t.teacher_logprobs is not None for t in trajs)
    alone = scorer_for([teacher_server.url], teacher_dir)
    try:
        run(alone.ascore(reference), timeout=60)
    finally:
        alone.close()
    for t, r in zip(trajs, reference, strict=True):
        assert max(abs(a - b) for a, b in zip(t.teacher_logprobs, r.teacher_logprobs, strict=True)) < 1e-5
    assert resubmitted > 0  # the kill caught calls in flight or queued on the victim
