"""Typed errors of the rollout client."""

from __future__ import annotations

from tandem.errors import TandemError


class RolloutError(TandemError):
    """Base class for rollout failures."""


class PromptTooLongError(RolloutError, ValueError):
    """The prompt leaves no generation budget under `max_tokens`."""


class GenerationDeadlineError(RolloutError, TimeoutError):
    """A request did not finish before its deadline (names the rid and every server tried)."""

    def __init__(self, rid: str, deadline_s: float, servers: list[str], last_error: str = ""):
        self.rid, self.deadline_s, self.servers, self.last_error = rid, deadline_s, servers, last_error
        tried = ", ".join(servers) or "none (no server was reachable)"
        msg = f"request {rid} missed its {deadline_s:g}s deadline; servers tried: {tried}"
        super().__init__(msg + (f"; last error: {last_error}" if last_error else ""))


class ServerRequestError(RolloutError):
    """A server rejected a request (4xx): retrying the same body cannot help."""

    def __init__(self, server: str, status: int, message: str):
        self.server, self.status = server, status
        super().__init__(f"{server} answered {status}: {message}")


class NoServerError(RolloutError):
    """The pool has no server at all."""


class EpisodeFailureStorm(RolloutError):
    """`count` episodes in a row failed: the rollouts stop instead of burning the dataset."""

    def __init__(self, count: int, first_error: str):
        self.count, self.first_error = count, first_error
        super().__init__(
            f"{count} episodes in a row failed (rollout.max_consecutive_failures); the first error: {first_error}. "
            "Fix the cause (the reward function, the servers' log, the generation settings) and rerun"
        )


class RewardError(RolloutError):
    """A reward function raised, hung or returned a non-number for an episode's sample."""
