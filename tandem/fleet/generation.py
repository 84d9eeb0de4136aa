"""What one generation call asks for and what comes back, independent of the server kind (the
adapters in `tandem.fleet.adapters` translate them to each server's routes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class GenerationParams:
    """Sampling parameters; names follow SGLang's `sampling_params` (protocol.md section 2)."""

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
    weight_version: int | None  # None: the server did not say; the client uses its last known version
    # meta_info["routed_experts"] as sent (base64; `tandem.fleet.routes`), when asked for and given.
    routed_experts: str | None = None


def parse_version(value: object) -> int | None:
    """Servers report versions as strings ("3"); anything non-integer ("default") means unknown."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None
