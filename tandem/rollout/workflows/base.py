"""The workflow interface: how one episode turns an item into trajectories."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from tandem.data.trajectory import Trajectory

if TYPE_CHECKING:
    from tandem.rollout.client import InferenceClient

EpisodeResult = Trajectory | list[Trajectory] | None


class RolloutWorkflow(ABC):
    """Subclass and implement `arun_episode`; the executor runs many episodes concurrently.

    Return one trajectory, a group (e.g. n samples of one prompt; the group is one episode for the
    staleness bound), or None to reject the episode. Raising also rejects it (logged with traceback).
    Everything runs on the executor's event loop: await I/O, never block.
    """

    @abstractmethod
    async def arun_episode(self, client: InferenceClient, item: Any) -> EpisodeResult: ...

    def close(self) -> None:
        """Release resources (reward processes); the executor does not own the workflow."""
        return None


def as_trajectories(result: EpisodeResult) -> list[Trajectory] | None:
    """Normalise a workflow's return value: None (rejected) or a non-empty list."""
    if result is None:
        return None
    if isinstance(result, Trajectory):
        return [result]
    result = list(result)
    if not all(isinstance(t, Trajectory) for t in result):
        raise TypeError(f"a workflow returned {[type(t).__name__ for t in result]}, expected Trajectory items")
    return result or None
