"""A backend adapter translates one generation call to a server's wire format and back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tandem.rollout.types import Chunk, GenerationParams


class Backend(ABC):
    #: the route generation calls are POSTed to
    path: str

    @abstractmethod
    def build(self, rid: str, input_ids: list[int], params: GenerationParams, max_new_tokens: int) -> dict[str, Any]:
        """The JSON body for generating at most `max_new_tokens` after `input_ids`."""

    @abstractmethod
    def parse(self, body: dict[str, Any]) -> Chunk:
        """Tokens, logprobs, finish reason and (when the server says) the weight version."""


def parse_version(value: Any) -> int | None:
    """Servers report versions as strings ("3"); anything non-integer ("default") means unknown."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None
