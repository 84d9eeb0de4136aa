"""The agent session's bookkeeping: chaining by messages, dropped retries, rewards and export."""

from __future__ import annotations

import pytest

from tandem.data.trajectory import PROMPT_VERSION
from tandem.rollout.agent.session import AgentSession, Interaction, SessionError, canonical_message


def _call(cid: str, messages, answer: str, prompt_ids, output_ids, parent=None, version=0, fp=None) -> Interaction:
    return Interaction(
        id=cid, messages=[canonical_message(m) for m in messages],
        answer=canonical_message({"role": "assistant", "content": answer}), prompt_ids=list(prompt_ids),
        output_ids=list(output_ids), logprobs=[-0.5 - i for i in range(len(output_ids))],
        versions=[version] * len(output_ids), sent_version=version, finish_reason="stop",
        fingerprint=fp or cid, parent=parent)


USER = {"role": "user", "content": "2+2?"}


def test_canonical_message_ignores_what_is_not_rendered():
    sdk = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}]}
    ours = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "calc", "arguments": {"x": 1}}}]}
    assert canonical_message(sdk) == canonical_message(ours)
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert canonical_message(parts) == canonical_message({"role": "user", "content": "ab"})
    assert canonical_message({"role": "user", "content": "a"}) != canonical_message({"role": "user", "content": "b"})


def test_chains_take_the_longest_parent_and_export_concat_trains_every_turn():
    s = AgentSession("k", "item")
    first = _call("c1", [USER], "4", [1, 2], [10, 11])
    s.record(first)
    turn2 = [USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "sure?"}]
    assert s.parent_for(turn2) is first
    assert s.parent_for([USER]) is None  # not strictly longer than the history
    assert s.parent_for([{"role": "user", "content": "other"}, {"role": "assistant", "content": "4"}, USER]) is None
    second = _call("c2", turn2, "yes", [1, 2, 10, 11, 20, 21], [12], parent=first, version=1)
    s.record(second)
    turn3 = [*turn2, {"role": "assistant", "content": "yes"}, {"role": "user", "content": "ok"}]
    assert s.parent_for(turn3) is second  # the longest
    s.assign_rewards(1.0)
    [traj] = s.export("concat", "g", "p")
    assert traj.input_ids == [1, 2, 10, 11, 20, 21, 12]
    assert traj.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert traj.logprobs == [0.0, 0.0, -0.5, -1.5, 0.0, 0.0, -0.5]
    assert traj.versions == [PROMPT_VERSION] * 2 + [0, 0] + [PROMPT_VERSION] * 2 + [1]
    assert traj.reward == 1.0 and traj.num_turns == 2 and traj.info["calls"] == ["c1", "c2"]
    individual = s.export("individual", "g", "p")
    assert [t.input_ids for t in individual] == [[1, 2, 10, 11], [1, 2, 10, 11, 20, 21, 12]]
    assert individual[1].loss_mask == [0] * 6 + [1]  # one call's own output only


def test_rewards_discount_backwards_and_by_call_id():
    s = AgentSession("k", "item", discount=0.5)
    for i in range(3):
        s.record(_call(f"c{i}", [USER], "x", [1], [2]))
    s.assign_rewards({"c1": 2.0, "c2": 4.0})
    assert [c.reward for c in s.calls] == [0.0 + 0.5 * (2.0 + 0.5 * 4.0), 2.0 + 0.5 * 4.0, 4.0]
    s2 = AgentSession("k", "item", discount=0.5)
    for i in range(3):
        s2.record(_call(f"c{i}", [USER], "x", [1], [2]))
    s2.assign_rewards(1.0)
    assert [c.reward for c in s2.calls] == [0.25, 0.5, 1.0]
    with pytest.raises(SessionError, match="no model call"):
        AgentSession("k", "i").assign_rewards(1.0)
    s3 = AgentSession("k", "item")
    s3.record(_call("c0", [USER], "x", [1], [2]))
    with pytest.raises(SessionError, match="unknown call id 'nope'"):
        s3.assign_rewards({"nope": 1.0})
    with pytest.raises(SessionError, match="return a number"):
        s3.assign_rewards("1.0")  # type: ignore[arg-type]


def test_a_retried_call_supersedes_the_attempt_it_repeats():
    s = AgentSession("k", "item")
    orphan = _call("c1", [USER], "4", [1, 2], [10], fp="same")
    s.record(orphan)
    assert s.supersede("other") is None
    assert s.supersede("same") is orphan and orphan.dropped
    retry = _call("c2", [USER], "5", [1, 2], [11], fp="same")
    s.record(retry)
    assert s.live == [retry]
    s.assign_rewards(1.0)
    [traj] = s.export("concat", "g", "p")
    assert traj.input_ids == [1, 2, 11] and traj.info["dropped_calls"] == 1
