"""Tandem and SGLang servers: `POST /generate` with token ids (protocol.md section 2)."""

from __future__ import annotations

from typing import Any

from tandem.rollout.backends.base import Backend, parse_version
from tandem.rollout.types import Chunk, GenerationParams


class NativeBackend(Backend):
    path = "/generate"

    def build(self, rid: str, input_ids: list[int], params: GenerationParams, max_new_tokens: int) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_new_tokens": min(params.min_new_tokens, max_new_tokens),
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
        }
        return {"rid": rid, "input_ids": list(input_ids), "sampling_params": sampling, "return_logprob": True}

    def parse(self, body: dict[str, Any]) -> Chunk:
        meta = body.get("meta_info", {})
        # An abort while queued has no logprob list at all: zero tokens produced.
        pairs = meta.get("output_token_logprobs") or []
        ids = [int(p[1]) for p in pairs]
        if not pairs and body.get("output_ids") and meta.get("finish_reason", {}).get("type") != "abort":
            raise ValueError("server returned tokens without logprobs; was return_logprob honoured?")
        finish = (meta.get("finish_reason") or {}).get("type", "length")
        if finish not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish reason {finish!r}")
        return Chunk(ids, [float(p[0]) for p in pairs], finish, parse_version(meta.get("weight_version")))
