"""Built-in workflows: RLVR groups and multi-turn token bookkeeping (no re-tokenisation)."""

from __future__ import annotations

import pickle

import pytest

from tandem.data.trajectory import Trajectory, stack_group
from tandem.rollout import (
    Feedback,
    GenerationParams,
    InferenceClient,
    MultiTurnWorkflow,
    RewardRunner,
    RLVRWorkflow,
)
from tandem.rollout.errors import RewardError
from tandem.rollout.workflows import GroupWorkflow, RewardFeedback
from tandem.user_code import UserFunction
from tests.rollout import rewards
from tests.rollout.conftest import run
from tests.rollout.fake_server import chain

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tandem.models.tiny import init_model

    path = init_model(tmp_path_factory.mktemp("tiny"), preset="tiny")
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def runner():
    r = RewardRunner(max_workers=2, timeout_s=2.0)
    yield r
    r.close()


async def episode(workflow, client, item):
    try:
        return await workflow.arun_episode(client, item)
    finally:
        await client.aclose()


def test_rlvr_group(make_server, runner, tokenizer):
    server = make_server(vocab_size=len(tokenizer))
    wf = RLVRWorkflow(rewards.parity_reward, GenerationParams(max_new_tokens=6), n_samples=3, tokenizer=tokenizer, reward_runner=runner)
    group = run(episode(wf, InferenceClient([server.address]), {"prompt": "What is 2+2?", "id": "q1", "answer": 4}))
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)["input_ids"]
    assert len(group) == 3 and len(server.log) == 3  # three concurrent samples
    expected = chain(prompt_ids[-1], 6, len(tokenizer))
    for t in group:
        assert t.input_ids == prompt_ids + expected
        assert t.reward == float(expected[-1] % 2 == 0)
        assert t.prompt_id == "q1" and t.group_id == group[0].group_id
        assert t.loss_mask.count(1) == 6
    packed = stack_group(group)
    assert packed["cu_seqlens"].tolist() == [0, len(group[0].input_ids), 2 * len(group[0].input_ids), 3 * len(group[0].input_ids)]
    assert Trajectory.from_dict(group[0].to_dict()) == group[0]


def test_rlvr_failed_reward_fails_the_group(make_server, runner):
    """A missing reward breaks the group's baseline: the episode fails with the reward's error (so
    the executor counts it towards an error storm)."""
    server = make_server()
    wf = RLVRWorkflow(rewards.raising_reward, GenerationParams(max_new_tokens=3), n_samples=2, reward_runner=runner)
    with pytest.raises(RewardError, match=r"2/2 rewards of the group failed; the first: raising_reward: "
                                          r"ValueError: the grader crashed"):
        run(episode(wf, InferenceClient([server.address]), {"input_ids": [5, 6, 7]}))


def test_multi_turn_keeps_token_ids_end_to_end(make_server, tokenizer):
    vocab = len(tokenizer)
    server = make_server(vocab_size=vocab)
    seen: list[list[dict]] = []

    async def feedback(messages, item):
        seen.append(list(messages))
        turn = sum(m["role"] == "assistant" for m in messages)
        return Feedback(None if turn == 3 else f"try again ({turn})", reward=float(turn))

    wf = MultiTurnWorkflow(tokenizer, feedback, GenerationParams(max_new_tokens=5), max_turns=5)
    traj = run(episode(wf, InferenceClient([server.address]), {"prompt": "Say hi", "id": "m1"}))

    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}], add_generation_prompt=True)["input_ids"]
    outs = [e.output_ids for e in server.log]
    assert len(outs) == 3 and traj.num_turns == 3
    # Independent encoding of each feedback: close the assistant turn unless the model did
    # (<|im_end|> generated), then the ChatML user turn and the next assistant header.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    fbs = []
    for turn, out in enumerate(outs[:2], start=1):
        close = "\n" if out[-1] == im_end else "<|im_end|>\n"
        text = f"{close}<|im_start|>user\ntry again ({turn})<|im_end|>\n<|im_start|>assistant\n"
        fbs.append(tokenizer.encode(text, add_special_tokens=False))
    assert traj.input_ids == prompt_ids + outs[0] + fbs[0] + outs[1] + fbs[1] + outs[2]
    # The server saw exactly those ids each turn: nothing was re-tokenised in between.
    assert server.log[1].input_ids == prompt_ids + outs[0] + fbs[0]
    assert server.log[2].input_ids == prompt_ids + outs[0] + fbs[0] + outs[1] + fbs[1]
    expected_mask = [0] * len(prompt_ids) + [1] * 5 + [0] * len(fbs[0]) + [1] * 5 + [0] * len(fbs[1]) + [1] * 5
    assert traj.loss_mask == expected_mask
    assert all(v == -1 for v, m in zip(traj.versions, traj.loss_mask, strict=True) if not m)
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if not m)
    assert traj.reward == 3.0 and traj.info["turn_rewards"] == [1.0, 2.0, 3.0]
    assert [m["role"] for m in seen[-1]] == ["user", "assistant", "user", "assistant", "user", "assistant"]


def test_multi_turn_feedback_when_model_closed_its_turn(tokenizer):
    wf = MultiTurnWorkflow(tokenizer, lambda messages, item: Feedback(None))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    closed = wf.feedback_ids([40, 41, im_end], "ok")
    open_ = wf.feedback_ids([40, 41], "ok")
    assert open_[0] == im_end and closed == open_[1:]


def _two_turn_item(wf: MultiTurnWorkflow, tokenizer, turn_tokens: int) -> dict:
    """An item whose first answer (from the fake server) is wrong and whose second is right under
    `first_token_reward`. The fake server continues from the last token alone, and every turn ends
    in the same assistant header; the item's prompt ids end in another token, so the answers differ."""
    vocab = len(tokenizer)
    prompt_ids = [*tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}],
                                                 add_generation_prompt=True)["input_ids"], 5]
    first = chain(prompt_ids[-1], turn_tokens, vocab)
    second = chain(wf.feedback_ids(first, "No. Again.")[-1], 1, vocab)
    assert first[0] != second[0]
    return {"prompt": "Say hi", "id": "m1", "input_ids": prompt_ids, "answer": "x", "good": [second[0]]}


def test_reward_feedback_asks_again_after_a_wrong_answer(make_server, runner, tokenizer):
    """Each turn is scored alone by the reward in the pool: wrong -> the retry message, right -> done;
    a group of 3 such conversations shares one group_id."""
    server = make_server(vocab_size=len(tokenizer))
    feedback = RewardFeedback(rewards.first_token_reward, runner, success_reward=1.0, retry_message="No. Again.")
    wf = MultiTurnWorkflow(tokenizer, feedback, GenerationParams(max_new_tokens=4), max_turns=3)
    item = _two_turn_item(wf, tokenizer, 4)
    group = run(episode(GroupWorkflow(wf, 3), InferenceClient([server.address]), item))
    assert len(group) == 3 and len(server.log) == 6  # 3 conversations of 2 turns
    assert len({t.group_id for t in group}) == 1 and group[0].group_id.startswith("m1:")
    for t in group:
        assert t.num_turns == 2 and t.info["turn_rewards"] == [0.0, 1.0] and t.reward == 1.0
        assert t.prompt_id == "m1" and t.loss_mask.count(1) == 8
    # The reward saw each turn's own ids: the second turn's request carries the retry message.
    assert "No. Again." in tokenizer.decode(server.log[-1].input_ids)


def test_reward_feedback_stops_at_max_turns_and_fails_on_a_failed_reward(make_server, runner, tokenizer):
    server = make_server(vocab_size=len(tokenizer))
    never = RewardFeedback(rewards.first_token_reward, runner, retry_message="No.")
    traj = run(episode(MultiTurnWorkflow(tokenizer, never, GenerationParams(max_new_tokens=3), max_turns=2),
                       InferenceClient([server.address]), {"prompt": "Say hi", "id": "m2"}))
    assert traj.num_turns == 2 and traj.info["turn_rewards"] == [0.0, 0.0]
    broken = RewardFeedback(rewards.raising_reward, runner)
    wf = GroupWorkflow(MultiTurnWorkflow(tokenizer, broken, GenerationParams(max_new_tokens=3)), 2)
    with pytest.raises(ExceptionGroup) as info:  # the TaskGroup's: one failure cancels the siblings
        run(episode(wf, InferenceClient([server.address]), {"prompt": "Say hi", "id": "m3"}))
    errors = [e for e in info.value.exceptions if isinstance(e, RewardError)]
    assert errors and "the reward of turn 1 failed: raising_reward: ValueError: the grader crashed" in str(errors[0])


def test_a_group_with_a_rejected_episode_is_rejected():
    class Sometimes(RLVRWorkflow):
        def __init__(self):
            self.calls = 0

        async def arun_episode(self, client, item):
            self.calls += 1
            if self.calls == 2:
                return None
            return Trajectory([1, 2], [0, 1], [0.0, -0.5], [-1, 0], reward=1.0)

    inner = Sometimes()
    assert run(GroupWorkflow(inner, 3).arun_episode(None, {"id": "q"})) is None
    group = run(GroupWorkflow(Sometimes(), 1).arun_episode(None, {"id": "q"}))
    assert len(group) == 1 and group[0].group_id.startswith("q:")


def test_multi_turn_reward_workflow_pickles(tokenizer, runner, tmp_path):
    """Rollout worker processes get the workflow pickled: the reward (a file's function too) goes as
    its spec and the runner as its settings."""
    (tmp_path / "r.py").write_text("def score(*args, **fields):\n    return 0.5\n")
    feedback = RewardFeedback(UserFunction(f"{tmp_path / 'r.py'}:score"), runner, 0.75, "Again")
    wf = GroupWorkflow(MultiTurnWorkflow(tokenizer, feedback, max_turns=2), 4)
    copy = pickle.loads(pickle.dumps(wf))
    fb = copy.workflow.feedback_fn
    assert (copy.n, copy.workflow.max_turns, fb.success_reward, fb.retry_message) == (4, 2, 0.75, "Again")
    assert fb.reward_fn == feedback.reward_fn and fb.runner.timeout_s == runner.timeout_s
    try:
        result = run(fb([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], {"prompt": "q"},
                        prompt_ids=[1], completion_ids=[2]))
        assert result == Feedback("Again", 0.5)
    finally:
        fb.runner.close()
