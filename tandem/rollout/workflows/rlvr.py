"""RLVR: n samples of one prompt, generated concurrently, each scored by a verifiable reward."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from tandem.data.trajectory import Trajectory
from tandem.fleet.generation import GenerationParams
from tandem.rollout.client import InferenceClient
from tandem.rollout.errors import RewardError
from tandem.rollout.frontier import STREAM_INDEX, sampling_seed, stream_index_of
from tandem.rollout.reward import RewardFn, RewardRunner
from tandem.rollout.types import ModelRequest
from tandem.rollout.workflows.base import RolloutWorkflow

# Item keys the workflow reads itself; everything else goes to the reward function as keywords.
_RESERVED = ("input_ids", "messages", "prompt", "id", STREAM_INDEX)


def reward_fields(item: dict[str, Any]) -> dict[str, Any]:
    """The item's fields that reach the reward function as keywords (all but the reserved ones)."""
    return {k: v for k, v in item.items() if k not in _RESERVED}


def prompt_ids_of(item: dict[str, Any], tokenizer: Any) -> list[int]:
    """Prompt token ids: given (`input_ids`), or rendered from `messages` / `prompt` (and `tools`) with the
    chat template."""
    if "input_ids" in item:
        return list(item["input_ids"])
    if tokenizer is None:
        raise ValueError("an item without input_ids needs a tokenizer to render its messages")
    messages = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
    ids = tokenizer.apply_chat_template(messages, tools=item.get("tools") or None, add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a dict


class RLVRWorkflow(RolloutWorkflow):
    def __init__(
        self,
        reward_fn: RewardFn,
        params: GenerationParams | None = None,
        n_samples: int = 4,
        tokenizer: Any = None,
        max_tokens: int | None = None,
        reward_runner: RewardRunner | None = None,
        seed: int | None = None,
    ):
        """`seed` (rollout.seed_sampling): sample i of an item drawn from the run's stream is seeded
        `sampling_seed(seed, stream index, i)`, so the item drawn again after a resume gets the same
        tokens; None: the servers' own randomness."""
        self.seed = seed
        self.reward_fn = reward_fn
        self.params = params or GenerationParams()
        self.n_samples = n_samples
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._own_runner = reward_runner is None
        self.reward_runner = reward_runner or RewardRunner()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    async def arun_episode(self, client: InferenceClient, item: dict[str, Any]) -> list[Trajectory] | None:
        start = time.time()
        prompt_ids = prompt_ids_of(item, self.tokenizer)
        prompt_id = str(item.get("id", uuid.uuid4().hex))
        group_id = f"{prompt_id}:{uuid.uuid4().hex[:8]}"
        # One call for the n samples where the server takes them together (the prompt prefilled
        # once); sample i is seeded `sampling_seed(seed, stream index, i)`.
        responses = await client.agenerate_samples(
            ModelRequest(prompt_ids, self._params(item), max_tokens=self.max_tokens), self.n_samples)
        prompt_text = item.get("prompt") or self._decode(prompt_ids)
        fields = reward_fields(item)
        t_reward = time.time()
        # The group in one call to one reward worker: one round trip instead of n.
        rewards = await self.reward_runner.ascore_group(
            self.reward_fn, prompt_text, prompt_ids, [(self._decode(r.output_ids), r.output_ids) for r in responses],
            **fields)
        failed = [r.error for r in rewards if not r.ok]
        if failed:
            # One missing reward breaks the group's baseline: the whole episode fails (the executor
            # logs it once per distinct error and ends the run on a storm of them).
            raise RewardError(f"{len(failed)}/{len(rewards)} rewards of the group failed; the first: {failed[0]}")
        end = time.time()
        return [
            r.to_trajectory(
                reward=float(rw.value),
                prompt_id=prompt_id,
                group_id=group_id,
                timing={"start": start, "end": end, "generate": r.latency_s, "reward": end - t_reward},
            )
            for r, rw in zip(responses, rewards, strict=True)
        ]

    def _params(self, item: dict[str, Any]) -> GenerationParams:
        """The group's parameters: seeded with sample 0's seed (sample i's is that + i)."""
        index = stream_index_of(item)
        if self.seed is None or index is None:
            return self.params
        return dataclasses.replace(self.params, seed=sampling_seed(self.seed, index, 0))

    def close(self) -> None:
        if self._own_runner:
            self.reward_runner.close()
