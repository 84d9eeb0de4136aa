"""vLLM servers: token-in/token-out through `POST /v1/completions` (protocol.md section 4).

Tokens come back as strings "token_id:123" because of `return_tokens_as_token_ids`. vLLM has no
weight version of its own: a `weight_version` field is used when a server extension adds one (top
level or in the choice), otherwise the client's last known version applies.
"""

from __future__ import annotations

from typing import Any

from tandem.rollout.backends.base import Backend, parse_version
from tandem.rollout.types import Chunk, GenerationParams

_PREFIX = "token_id:"


def _token_id(token: str) -> int:
    if not token.startswith(_PREFIX):
        raise ValueError(f"expected a 'token_id:N' token (return_tokens_as_token_ids), got {token!r}")
    return int(token[len(_PREFIX) :])


class VLLMBackend(Backend):
    path = "/v1/completions"

    def __init__(self, model: str | None = None):
        self.model = model  # vLLM checks it against the served model name when given

    def build(self, rid: str, input_ids: list[int], params: GenerationParams, max_new_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(input_ids),
            "max_tokens": max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_tokens": min(params.min_new_tokens, max_new_tokens),
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "n": 1,
            "stream": False,
            "request_id": rid,
        }
        if self.model is not None:
            body["model"] = self.model
        return body

    def parse(self, body: dict[str, Any]) -> Chunk:
        choice = body["choices"][0]
        lp = choice.get("logprobs") or {}
        ids = [_token_id(t) for t in lp.get("tokens") or []]
        logprobs = [float(x) for x in lp.get("token_logprobs") or []]
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(logprobs)} logprobs in a vLLM response")
        finish = choice.get("finish_reason") or "length"
        if finish not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish reason {finish!r}")
        version = parse_version(body.get("weight_version", choice.get("weight_version")))
        return Chunk(ids, logprobs, finish, version)
