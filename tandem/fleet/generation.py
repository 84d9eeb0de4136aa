"""What one generation call asks for and what comes back, independent of the server kind (the
adapters in `tandem.fleet.adapters` translate them to each server's routes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class GenerationParams:
    """Sampling parameters; names follow SGLang's `sampling_params` (docs/inference.md, "SGLang fields")."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None  # per-request sampling seed (SGLang's sampling_seed, vLLM's seed); None: the server's


@dataclass
class Chunk:
    """What one generation call returned, parsed by the server's adapter."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int | None  # one version for the whole call; None: the server did not say
    # meta_info["routed_experts"] as sent (base64; `tandem.fleet.routed_experts`), when asked for and given.
    routed_experts: str | None = None
    # One version per output token, where the server labels each token with the weights that
    # sampled it (vLLM's `weight_versions` spans); None entries: tokens it could not label.
    token_versions: list[int | None] | None = None

    def versions(self, count: int, known: int) -> list[int]:
        """The weight version of each of the first `count` output tokens: the server's per-token
        labels, else its one version for the call, else `known` (the client's version as the answer
        is read, which may already be the next one when the answer lags behind a weight update)."""
        if self.token_versions is not None:
            return [known if v is None else v for v in self.token_versions[:count]]
        return [known if self.weight_version is None else self.weight_version] * count


def parse_version(value: object) -> int | None:
    """Servers report versions as strings ("3"); anything non-integer ("default") means unknown."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None
