"""How Ulysses context parallelism splits a model's attention heads over `cp` ranks (torch-free, so
the run config can check a model before anything starts; see `tandem.parallel.context_parallel`)."""

from __future__ import annotations

import math

from tandem.errors import ConfigError


def check_heads(n_heads: int, n_kv_heads: int, cp: int, key: str = "actor.backend") -> None:
    """Raise `ConfigError` (naming `key`, where cp was set) when Ulysses cannot split the model's
    heads over `cp` ranks."""
    if n_heads % cp:
        raise ConfigError(
            f"{key}: context parallelism splits attention heads over the cp ranks, and the model's {n_heads} "
            f"query heads are not divisible by cp={cp}; choose a cp that divides {n_heads}"
        )
    if n_heads % n_kv_heads:
        raise ConfigError(f"query heads ({n_heads}) must be a multiple of key/value heads ({n_kv_heads})")


def kv_repeats(n_heads: int, n_kv_heads: int, cp: int) -> int:
    """How often each KV head is repeated so that `cp` divides the KV head count (1 when it does)."""
    check_heads(n_heads, n_kv_heads, cp)
    # lcm: the fewest KV heads that cp divides and that still divide H (cp and H_kv both do), so each
    # query head keeps reading (a copy of) its own KV head and k/v traffic grows by the repeat only.
    return math.lcm(n_kv_heads, cp) // n_kv_heads
