"""A group of episodes of one item: `n` runs of a workflow, concurrently, as one GRPO group.

Group-relative advantages compare the samples of one prompt (`group_id`). RLVR makes its group
itself; a workflow that makes one trajectory per episode (multi-turn, an agent) is wrapped in
`GroupWorkflow(workflow, n)`: the `n` episodes share a fresh `group_id` and come back as one
episode for the executor (and the staleness bound). If one of them fails, the others are
cancelled and the group fails with its error; if one is rejected (None), the group is rejected:
a group with a member missing has no baseline to compare with.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from tandem.data.trajectory import Trajectory
from tandem.rollout.client import InferenceClient
from tandem.rollout.workflows.base import RolloutWorkflow, as_trajectories


class GroupWorkflow(RolloutWorkflow):
    def __init__(self, workflow: RolloutWorkflow, n: int):
        if n < 1:
            raise ValueError(f"a group needs at least one episode, got n={n}")
        self.workflow = workflow
        self.n = n

    async def arun_episode(self, client: InferenceClient, item: Any) -> list[Trajectory] | None:
        async with asyncio.TaskGroup() as tg:  # one failure cancels its siblings
            tasks = [tg.create_task(self.workflow.arun_episode(client, item)) for _ in range(self.n)]
        results = [as_trajectories(t.result()) for t in tasks]
        if any(r is None for r in results):
            return None
        prompt_id = str(item.get("id", "")) if isinstance(item, dict) else ""
        group_id = f"{prompt_id or uuid.uuid4().hex}:{uuid.uuid4().hex[:8]}"
        group = [t for r in results for t in r or ()]
        for t in group:
            t.group_id = group_id
        return group

    def close(self) -> None:
        self.workflow.close()
