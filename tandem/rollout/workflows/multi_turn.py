"""Multi-turn: generate, get feedback, append it, generate again; one trajectory end to end.

Token ids are kept from the first turn to the last: each turn's generated ids are appended as the
server returned them, and only the *new* feedback text is tokenised (once, with the chat template's
turn markers). Earlier turns are never re-tokenised, so the trainer sees exactly the tokens the
policy produced (re-tokenising decoded text can merge or split tokens and silently corrupt logprobs).
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tandem.data.trajectory import PROMPT_VERSION, Trajectory
from tandem.fleet.generation import GenerationParams
from tandem.fleet.routed_experts import RoutedExperts, splice_routed_experts
from tandem.rollout.chat_tokens import ChatTokens
from tandem.rollout.client import InferenceClient
from tandem.rollout.errors import RewardError
from tandem.rollout.reward import RewardFn, RewardRunner
from tandem.rollout.types import ModelRequest
from tandem.rollout.workflows.base import RolloutWorkflow
from tandem.rollout.workflows.rlvr import prompt_ids_of, reward_fields

_PLACEHOLDER = "\u2063tandem-assistant-turn\u2063"


@dataclass
class Feedback:
    message: str | None  # the next user message; None ends the episode
    reward: float = 0.0


FeedbackFn = Callable[..., Feedback | Awaitable[Feedback]]
# Keyword parameters a feedback function may declare to get the turn's token ids as well.
_ID_KEYWORDS = ("prompt_ids", "completion_ids")


class MultiTurnWorkflow(RolloutWorkflow):
    """`feedback_fn(messages, item)` sees the conversation so far (last message: the model's turn).
    A feedback function that declares `prompt_ids` and/or `completion_ids` parameters also gets
    them as keywords: the item's prompt ids and the ids this turn generated, as the server returned
    them (what a reward function takes, see `RewardFeedback`).

    The trajectory's reward is the reward of the last feedback; every turn's reward is kept in
    `info["turn_rewards"]`. A synchronous `feedback_fn` runs in a thread, off the event loop; a
    coroutine function (or an object with an `async def __call__`) is awaited on it.
    """

    def __init__(
        self,
        tokenizer: Any,
        feedback_fn: FeedbackFn,
        params: GenerationParams | None = None,
        max_turns: int = 3,
        max_tokens: int | None = None,
        feedback_role: str = "user",
    ):
        self.tokenizer = tokenizer
        self.feedback_fn = feedback_fn
        self.params = params or GenerationParams()
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.feedback_role = feedback_role
        try:
            params_of = inspect.signature(feedback_fn).parameters
        except (TypeError, ValueError):
            params_of = {}  # type: ignore[assignment]
        self._id_keywords = tuple(k for k in _ID_KEYWORDS if k in params_of)
        self._turns = ChatTokens(tokenizer)

    def feedback_ids(self, generated: list[int], message: str) -> list[int]:
        """Tokens that close the model's turn (unless it already did), add `message`, open the next turn.
        The history is a placeholder: only what the template writes after a turn matters."""
        history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}]
        return self._turns.continuation_ids(generated, history, [{"role": self.feedback_role, "content": message}])

    async def _feedback(self, messages: list[dict[str, str]], item: dict[str, Any], prompt_ids: list[int],
                        completion_ids: list[int]) -> Feedback:
        given = {"prompt_ids": prompt_ids, "completion_ids": completion_ids}
        kwargs = {k: list(given[k]) for k in self._id_keywords}
        fn = self.feedback_fn
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):  # async __call__
            return await fn(messages, item, **kwargs)
        result = await asyncio.to_thread(fn, messages, item, **kwargs)
        return await result if inspect.isawaitable(result) else result

    async def arun_episode(self, client: InferenceClient, item: dict[str, Any]) -> Trajectory | None:
        start = time.time()
        messages = list(item.get("messages") or [{"role": "user", "content": item["prompt"]}])
        ids = prompt_ids_of(item, self.tokenizer)
        prompt_ids = list(ids)
        mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [PROMPT_VERSION] * len(ids)
        rid = uuid.uuid4().hex  # one rid for all turns: same server while it lives
        finishes: list[str] = []
        turn_rewards: list[float] = []
        routed: RoutedExperts | None = None  # with routed experts: each turn's rows cover every token so far
        for turn in range(self.max_turns):
            resp = await client.agenerate(ModelRequest(list(ids), self.params, max_tokens=self.max_tokens, rid=rid))
            if resp.routed_experts is not None:
                routed = splice_routed_experts(routed or [], resp.routed_experts)
            ids += resp.output_ids
            mask += [1] * len(resp.output_ids)
            logprobs += resp.output_logprobs
            versions += resp.output_versions
            finishes.append(resp.finish_reason)
            text = self.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": text})
            fb = await self._feedback(messages, item, prompt_ids, resp.output_ids)
            turn_rewards.append(float(fb.reward))
            if fb.message is None or turn == self.max_turns - 1:
                break
            messages.append({"role": self.feedback_role, "content": fb.message})
            fb_ids = self.feedback_ids(resp.output_ids, fb.message)
            ids += fb_ids
            mask += [0] * len(fb_ids)
            logprobs += [0.0] * len(fb_ids)
            versions += [PROMPT_VERSION] * len(fb_ids)
            if self.max_tokens is not None and len(ids) >= self.max_tokens:
                break  # no room for another turn
        if routed is not None:  # feedback after the last turn was never forwarded
            layout = client.config.routed_expert_layout
            assert layout is not None
            routed += [layout.unknown_row() for _ in range(len(ids) - len(routed))]
        return Trajectory(
            input_ids=ids,
            loss_mask=mask,
            logprobs=logprobs,
            versions=versions,
            reward=turn_rewards[-1],
            prompt_id=str(item.get("id", rid)),
            group_id=rid,
            num_turns=len(finishes),
            finish_reasons=finishes,
            timing={"start": start, "end": time.time()},
            info={"turn_rewards": turn_rewards},
            routed_experts=routed,
        )


class RewardFeedback:
    """Feedback from a reward function, for `MultiTurnWorkflow`: each model turn is scored on its
    own against the item (prompt: the item's prompt, completion: that turn's text and ids) by
    `reward_fn` in `runner`'s worker processes, under its timeout. A reward of at least
    `success_reward` ends the episode; a lower one sends `retry_message`. A reward that fails
    (raises, hangs, returns a non-number) fails the episode with `RewardError`. Picklable (rollout
    worker processes): the runner pickles as its settings."""

    def __init__(self, reward_fn: RewardFn, runner: RewardRunner, success_reward: float = 1.0,
                 retry_message: str = "That is not right. Try again."):
        self.reward_fn = reward_fn
        self.runner = runner
        self.success_reward = success_reward
        self.retry_message = retry_message

    async def __call__(self, messages: list[dict[str, str]], item: dict[str, Any], prompt_ids: list[int],
                       completion_ids: list[int]) -> Feedback:
        turn = sum(m["role"] == "assistant" for m in messages)
        result = await self.runner.ascore(self.reward_fn, item.get("prompt") or "", messages[-1]["content"],
                                          prompt_ids, completion_ids, **reward_fields(item))
        if result.value is None:
            raise RewardError(f"the reward of turn {turn} failed: {result.error}")
        done = result.value >= self.success_reward
        return Feedback(None if done else self.retry_message, result.value)
