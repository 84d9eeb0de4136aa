"""An LLM judge (`tandem.rollout.judge`) with a real served judge model: the tiny model SFT'd to
answer the judge's template with "yes" (a boxed answer) or "no", served by `tandem serve`. Its verdicts become
rewards with the raw text kept; a verdict the parser refuses fails the episode as a failed reward
(counted, named)."""

from __future__ import annotations

import asyncio
import re

import pytest

from tandem.data.tasks.chat import encode_prompt
from tandem.data.trajectory import Trajectory
from tandem.fleet.ops import Deadlines
from tandem.rollout.errors import RewardError
from tandem.rollout.executor import sole_cause
from tandem.rollout.health import HealthConfig
from tandem.rollout.judge import JudgeConfig, JudgeScorer, parse_number, parse_yes_no
from tests.inference.server_utils import ServerProcess
from tests.rollout.judge_model import TASK, candidates, make_judge_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    return make_judge_model(tmp_path_factory.mktemp("judge"))


@pytest.fixture(scope="module")
def judge_server(judge_model, tmp_path_factory):
    server = ServerProcess(judge_model[1], tmp_path_factory.mktemp("logs"), "--num-threads", "1")
    yield server
    server.stop()


def trajectories(policy_tokenizer, n: int, seed: int) -> list[tuple[dict, Trajectory, bool]]:
    out = []
    for item, answer, correct in candidates(n, seed):
        prompt = encode_prompt(item, policy_tokenizer)
        completion = [*policy_tokenizer.encode(answer, add_special_tokens=False), policy_tokenizer.eos_token_id]
        ids = prompt + completion
        t = Trajectory(ids, [0] * len(prompt) + [1] * len(completion), [0.0] * len(ids), [0] * len(ids),
                       reward=TASK.reward(answer, item))
        out.append((item, t, correct))
    return out


def scorer(server, base, **config) -> JudgeScorer:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(base)
    cfg = JudgeConfig(path=str(base), servers=[server.url], backend="tandem:d1", **config)
    return JudgeScorer([server.url], config=cfg, policy_tokenizer=tok, judge_tokenizer=tok,
                       health=HealthConfig(), grace_s=30.0, deadlines=Deadlines())


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_verdicts_become_rewards_with_the_raw_text_kept(judge_server, judge_model):
    """Catches: the template not filled from the trajectory and the item (the judge would answer
    at chance), the verdict's text lost, the task's reward overwritten without a trace."""
    import transformers

    base, _ = judge_model
    judge = scorer(judge_server, base)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    cases = trajectories(tok, 32, seed=7)

    async def score_all():
        try:
            for item, t, _ in cases:
                await judge.ascore([t], item)
        finally:
            await judge.aclose()
    run(score_all())
    texts = [t.info["judge_text"] for _, t, _ in cases]
    agree = sum((t.reward == 1.0) == correct for _, t, correct in cases)
    print(f"\n[judge] verdicts {sorted(set(texts))}; agrees with the truth on {agree}/{len(cases)}")
    assert all(t.reward in (0.0, 1.0) and t.info["judge_score"] == t.reward for _, t, _ in cases)
    assert all(t.info["task_reward"] == float(correct) for _, t, correct in cases)  # the task's own, kept
    assert agree >= 28  # the judge reads the answer it was shown (it learnt the format: boxed or bare)
    assert judge.scored == len(cases) and judge.unparsed == 0


def test_a_verdict_the_parser_refuses_is_a_failed_reward(judge_server, judge_model):
    base, _ = judge_model
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(base)
    judge = scorer(judge_server, base, parser="number")  # a yes/no judge never writes a number
    item, t, _ = trajectories(tok, 1, seed=3)[0]

    async def one():
        try:
            await judge.ascore([t], item)
        finally:
            await judge.aclose()
    with pytest.raises(ExceptionGroup) as info:  # the scorer's task group; the executor names the sole cause
        run(one())
    error = sole_cause(info.value)
    assert isinstance(error, RewardError) and re.fullmatch(
        r"the judge's verdict '(yes|no)' cannot be read by judge.parser='number': it holds no number", str(error))
    assert judge.unparsed == 1 and "judge_text" not in t.info


def test_the_parsers():
    assert [parse_yes_no(s) for s in ("yes", "Yes.", " no, because", "NO")] == [1.0, 1.0, 0.0, 0.0]
    assert parse_number("Score: 7/10") == 7.0 and parse_number("-2.5 points") == -2.5
    for text in ("maybe", "", "yesterday"):
        with pytest.raises(ValueError):
            parse_yes_no(text)
    with pytest.raises(ValueError, match="no number"):
        parse_number("none")
