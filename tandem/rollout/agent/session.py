"""One agent episode's record: every model call the agent made through the proxy, with the exact
tokens, logprobs and weight versions, how the calls chain, and the rewards; exported as trajectories.

A call whose messages extend an earlier call's messages and answer is its child: its prompt is the
parent's ids as they were plus only the new messages tokenised, so nothing generated is ever
re-tokenised. A retried call supersedes its earlier attempt; a cancelled one is never recorded.
Rewards (a number for the last call, or a dict by call id) flow backwards with `discount`; export
is one trajectory per chain (`concat`) or per call (`individual`). See docs/agents.md, "What is
recorded" and "Rewards and trajectories"."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.data.trajectory import PROMPT_VERSION, Trajectory

ExportStyle = Literal["concat", "individual"]


class SessionError(ValueError):
    """The agent's result does not fit the session (unknown call id, no call made, not a number)."""


def canonical_message(message: dict[str, Any]) -> dict[str, Any]:
    """What decides whether two messages are the same turn: role, text content (None, "" and a
    list of text parts with the same text are equal) and tool calls by name and parsed arguments
    (call ids, `refusal: None` and other SDK fields are not rendered and do not count)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):
                args = json.loads(args)
        calls.append({"name": fn.get("name"), "arguments": args})
    out: dict[str, Any] = {"role": message.get("role"), "content": content or ""}
    if calls:
        out["tool_calls"] = calls
    return out


def request_fingerprint(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        sampling: dict[str, Any]) -> str:
    """Equal for the same request sent again (an SDK retry)."""
    blob = json.dumps([[canonical_message(m) for m in messages], tools or [], sampling], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class Interaction:
    """One model call: what was asked, what came back, and how it was made."""

    id: str
    messages: list[dict[str, Any]]  # canonical messages of the request
    answer: dict[str, Any]  # canonical message of the answer
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # per output token
    sent_version: int  # the controller's weight version when the call was sent
    finish_reason: str
    fingerprint: str
    tools_key: str = ""  # the tools the call rendered (a chain keeps its tools)
    text: str = ""  # the output decoded
    parent: Interaction | None = None
    reward: float | None = None
    dropped: str | None = None  # why it is not exported (a retried call)
    created: float = field(default_factory=time.time)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The conversation including this call's answer: what a child's messages start with."""
        return [*self.messages, self.answer]


class AgentSession:
    """The calls of one episode, in the order they were made (one event loop: no locking)."""

    def __init__(self, key: str, item_id: str, discount: float = 1.0, max_calls: int = 64):
        self.key, self.item_id, self.discount, self.max_calls = key, item_id, discount, max_calls
        self.calls: list[Interaction] = []
        self.closed = False

    @property
    def live(self) -> list[Interaction]:
        return [c for c in self.calls if c.dropped is None]

    def parent_for(self, messages: list[dict[str, Any]], tools_key: str = "") -> Interaction | None:
        """The live call with the same tools and the longest history that `messages` extends
        (strictly: at least one new message after it), or None."""
        canon = [canonical_message(m) for m in messages]
        best: Interaction | None = None
        for call in self.live:
            hist = call.history
            if call.tools_key != tools_key:
                continue
            if len(hist) < len(canon) and canon[: len(hist)] == hist and (best is None or len(hist) > len(best.history)):
                best = call
        return best

    def supersede(self, fingerprint: str) -> Interaction | None:
        """A retried request: drop the latest live call with the same request; returns it."""
        for call in reversed(self.live):
            if call.fingerprint == fingerprint:
                call.dropped = "retried by the client"
                return call
        return None

    def record(self, call: Interaction) -> None:
        if self.closed:
            raise SessionError(f"session of item {self.item_id!r} is closed; the episode already ended")
        self.calls.append(call)

    # -- rewards ---------------------------------------------------------------------------------
    def assign_rewards(self, result: float | int | dict[str, float]) -> None:
        """Set rewards from the agent's return value, then discount them backwards."""
        live = self.live
        if not live:
            raise SessionError("the agent made no model call through its client, so there is nothing to train on")
        if isinstance(result, bool) or not isinstance(result, int | float | dict):
            raise SessionError(f"the agent returned {type(result).__name__}; return a number (the episode's reward) "
                               "or a dict {completion id: reward}")
        if isinstance(result, dict):
            by_id = {c.id: c for c in live}
            for call_id, value in result.items():
                if call_id not in by_id:
                    raise SessionError(f"reward for unknown call id {call_id!r}; the calls are {list(by_id)}")
                by_id[call_id].reward = _number(value, call_id)
        else:
            live[-1].reward = _number(result, "the episode")
        carried = 0.0
        for call in reversed(live):
            carried = (call.reward or 0.0) + self.discount * carried
            call.reward = carried

    # -- export ----------------------------------------------------------------------------------
    def export(self, style: ExportStyle, group_id: str, prompt_id: str) -> list[Trajectory]:
        """Trajectories of the live calls (after `assign_rewards`)."""
        live = self.live
        if style == "individual":
            chosen = live
        else:
            parents = {id(c.parent) for c in live if c.parent is not None}
            chosen = [c for c in live if id(c) not in parents]
        return [self._trajectory(c, style, group_id, prompt_id) for c in chosen]

    def _trajectory(self, last: Interaction, style: ExportStyle, group_id: str, prompt_id: str) -> Trajectory:
        chain = [last]
        if style == "concat":
            while chain[-1].parent is not None:
                chain.append(chain[-1].parent)  # type: ignore[arg-type]
            chain.reverse()
        ids = [*last.prompt_ids, *last.output_ids]
        mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [PROMPT_VERSION] * len(ids)
        for call in chain:
            start = len(call.prompt_ids)
            if ids[start : start + len(call.output_ids)] != call.output_ids:  # chaining guarantees it
                raise AssertionError(f"call {call.id}: its output is not where its child's prompt has it")
            for k, (lp, v) in enumerate(zip(call.logprobs, call.versions, strict=True)):
                mask[start + k], logprobs[start + k], versions[start + k] = 1, lp, v
        return Trajectory(
            input_ids=ids, loss_mask=mask, logprobs=logprobs, versions=versions, reward=float(last.reward or 0.0),
            prompt_id=prompt_id, group_id=group_id, num_turns=len(chain),
            finish_reasons=[c.finish_reason for c in chain],
            timing={"start": chain[0].created, "end": time.time()},
            info={"calls": [c.id for c in chain], "sent_versions": [c.sent_version for c in chain],
                  "call_rewards": [c.reward for c in chain], "session_calls": len(self.calls),
                  "dropped_calls": sum(c.dropped is not None for c in self.calls)},
        )


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SessionError(f"the reward of {what} is {value!r}; rewards must be numbers")
    return float(value)
