"""The teacher of on-policy distillation: a fleet of servers holding a frozen teacher model that
score the tokens the student sampled (prefill-only logprobs, `InferenceClient.ascore`).

A run with a teacher (`teacher.path`, `algo.distill.kl_coef > 0`) has the executor await
`TeacherScorer.ascore` on every finished episode: each trajectory gets `teacher_logprobs` before it
is accepted, so the teacher's scores travel with it (staleness, dumps, recovery). The fleet is a
`ScoringFleet`: probed, dead servers evicted, a call retried on another server inside
`teacher.request_deadline_s`; an episode whose scoring fails is a failed episode. See
docs/rewards.md, "Distillation"."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tandem.config.fields import config_field as _f
from tandem.data.trajectory import Trajectory
from tandem.rollout.scoring import ScoringFleet, ScoringFleetConfig
from tandem.rollout.types import ScoreRequest


@dataclass
class TeacherConfig(ScoringFleetConfig):
    """The `teacher` section: the model whose per-token logprobs a student is distilled toward
    (`algo.distill.kl_coef`), and the servers that hold it."""

    SECTION: ClassVar[str] = "teacher"

    path: str = _f("", "HF directory of the teacher (a causal LM with the actor's tokenizer). Empty: no teacher.")


class TeacherScorer(ScoringFleet):
    """Scores trajectories with the teacher fleet (the executor's episode scorer)."""

    tokens: int = 0  # generated tokens scored (set per instance by the first `+=`)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "teacher/tokens_total": float(self.tokens)}

    async def ascore(self, trajectories: list[Trajectory], item: Mapping[str, Any] | None = None) -> None:
        """Set `teacher_logprobs` on each trajectory: the teacher's logprob of every token the
        policy generated (loss mask 1), 0.0 elsewhere; each trajectory is one scoring call from its
        first generated token on, the calls concurrent. Raises when one cannot be scored."""
        async with asyncio.TaskGroup() as tg:  # one failure cancels the rest: the episode fails
            for t in trajectories:
                tg.create_task(self._score(t))

    async def _score(self, trajectory: Trajectory) -> None:
        mask = trajectory.loss_mask
        out = [0.0] * len(mask)
        start = next((i for i, m in enumerate(mask) if m), None)
        if start is not None:
            if start == 0:
                raise ValueError("a trajectory whose first token is generated has no context for the teacher to "
                                 "score it from; every episode starts with a prompt")
            scores = await self.client.ascore(ScoreRequest(list(trajectory.input_ids), start))
            for offset, lp in enumerate(scores):
                if mask[start + offset]:
                    out[start + offset] = lp
            self.tokens += sum(mask)
        trajectory.teacher_logprobs = out
        self.scored += 1
