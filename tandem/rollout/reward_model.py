"""A reward model as the run's reward: a fleet of classifier servers (`tandem serve
--is-embedding`, or SGLang's) scoring each finished episode's sequences.

With `reward_model.path`, the executor awaits `RewardModelScorer.ascore` on every episode a
workflow returned: one `/classify` call scores the episode's trajectories (prompt + completion, the
whole sequence), and each trajectory's reward becomes the score (`reward_model.mode=replace`) or
the workflow's reward plus it (`add`); both numbers stay in `info` (`task_reward`,
`reward_model_score`). Evaluation keeps the task's reward (the ground truth). The fleet is a
`ScoringFleet`: probed, dead servers evicted, a call retried on another server inside
`reward_model.request_deadline_s`. See docs/rewards.md, "Reward models"."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tandem.config.fields import config_field as _f
from tandem.data.trajectory import Trajectory
from tandem.rollout.scoring import ScoringFleet, ScoringFleetConfig
from tandem.rollout.types import ClassifyRequest

MODES = ("replace", "add")


@dataclass
class RewardModelConfig(ScoringFleetConfig):
    """The `reward_model` section: a sequence classifier whose score is the episode's reward."""

    SECTION: ClassVar[str] = "reward_model"
    LAUNCH_ARGS: ClassVar[tuple[str, ...]] = ("--is-embedding",)

    path: str = _f("", "HF directory of the reward model (...ForSequenceClassification with one label, or the "
                       "critic's ...ForTokenClassification layout; the actor's tokenizer). Empty: no reward model.")
    mode: str = _f("replace", "replace: the reward is the model's score (the task's reward is kept in info); add: the "
                              "workflow's reward plus the score.", choices=MODES)


class RewardModelScorer(ScoringFleet):
    """Sets each trajectory's reward from the reward-model fleet (the executor's episode scorer)."""

    def __init__(self, *args, mode: str = "replace", **kwargs):
        super().__init__(*args, **kwargs)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    async def ascore(self, trajectories: list[Trajectory], item: Mapping[str, Any] | None = None) -> None:
        """One call for the episode's sequences; raises (the episode fails) when it cannot be made
        or a score is not finite."""
        scores = await self.client.aclassify(ClassifyRequest([list(t.input_ids) for t in trajectories]))
        for t, score in zip(trajectories, scores, strict=True):
            if not math.isfinite(score):
                raise ValueError(f"the reward model scored a sequence {score}: not a finite number")
            t.info["task_reward"], t.info["reward_model_score"] = t.reward, score
            t.reward = score if self.mode == "replace" else t.reward + score
        self.scored += len(trajectories)
