"""Built-in workflows: RLVR groups and multi-turn token bookkeeping (no re-tokenisation)."""

from __future__ import annotations

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
