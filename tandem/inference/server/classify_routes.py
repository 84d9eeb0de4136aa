"""The routes of a sequence classifier (`tandem serve --is-embedding`, a reward model), as SGLang
and vLLM serve them (docs/rewards.md, "Reward models"):

- `POST /classify`, SGLang's native route for reward models: `text` (a string or a list of them)
  or `input_ids` (a list of ids or a list of such lists), optional `rid`; each sequence is answered
  with `embedding` (its label scores, raw: a reward model's one number is `embedding[0]`) and
  `meta_info` (`id`, `prompt_tokens`, `weight_version`): one object for one sequence, a list for a
  list.
- `POST /v1/classify`, vLLM's classification API (SGLang serves it too): `input` (a string, a list
  of strings, a list of ids or a list of such lists), `model` optional -> `data`: per sequence
  `index`, `label` (the most probable), `probs` (softmax over the labels; one label: its sigmoid, as
  vLLM does) and `num_classes`, with `usage`.

A request is scored whole in one forward; bad input is a 400 naming the field."""

from __future__ import annotations

import time
import uuid
from typing import Any

import torch
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from tandem.inference.errors import RequestError
from tandem.inference.server.http_api import ApiError, get_field, read_json
from tandem.inference.server.routes import state_of
from tandem.inference.server.state import ServerState

router = APIRouter()


def _sequences(state: ServerState, value: Any, name: str) -> tuple[list[list[int]], bool]:
    """The sequences a field holds (text encoded with the model's tokenizer, no special tokens
    added: send the chat-templated text), and whether it held one (not a list of them)."""
    if isinstance(value, str):
        return [state.encode(value)], True
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [state.encode(v) for v in value], False
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [list(value)], True
    if (isinstance(value, list) and value and all(isinstance(s, list) for s in value)
            and all(isinstance(t, int) and not isinstance(t, bool) for s in value for t in s)):
        return [list(s) for s in value], False
    raise ApiError(f"field {name!r} must be a string, a list of strings, a list of token ids or a list of lists "
                   "of token ids, and not empty")


async def _classify(state: ServerState, sequences: list[list[int]]) -> list[list[float]]:
    try:
        return await state.engine_loop.call(lambda engine: engine.classify(sequences))
    except RequestError as exc:
        raise ApiError(str(exc)) from exc


def _check_classifier(state: ServerState) -> None:
    state.check_ready(generation=False)
    if not state.args.is_embedding:
        raise ApiError(f"this server generates with {state.args.model_path}; classification needs a classifier "
                       "served with --is-embedding (a ...ForSequenceClassification reward model)")


@router.post("/classify")
async def classify(request: Request) -> Response:
    state = state_of(request)
    _check_classifier(state)
    body = await read_json(request, allow_empty=False)
    if ("text" in body) == ("input_ids" in body):
        raise ApiError("send 'text' (a string or a list of strings) or 'input_ids' (a list of token ids or a list "
                       "of lists), one of them")
    field = "text" if "text" in body else "input_ids"
    sequences, single = _sequences(state, body[field], field)
    rid = get_field(body, "rid", str) or uuid.uuid4().hex
    scores = await _classify(state, sequences)
    version = str(state.engine.weight_version)
    items = [{"embedding": s, "meta_info": {"id": rid if single else f"{rid}-{i}", "prompt_tokens": len(ids),
                                            "weight_version": version}}
             for i, (ids, s) in enumerate(zip(sequences, scores, strict=True))]
    return JSONResponse(items[0] if single else items)


@router.post("/v1/classify")
async def classify_openai(request: Request) -> Response:
    state = state_of(request)
    _check_classifier(state)
    body = await read_json(request, allow_empty=False)
    if "input" not in body:
        raise ApiError("field 'input' is required: a string, a list of strings, a list of token ids or a list of "
                       "lists of token ids")
    get_field(body, "model", str)  # a name, when given (any: the server serves one model)
    sequences, _ = _sequences(state, body["input"], "input")
    scores = torch.tensor(await _classify(state, sequences), dtype=torch.float64)
    probs = torch.sigmoid(scores) if scores.shape[1] == 1 else torch.softmax(scores, dim=-1)
    labels = state.engine.labels
    tokens = sum(len(s) for s in sequences)
    return JSONResponse({
        "id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": state.args.model_name,
        "data": [{"index": i, "label": labels[int(p.argmax())], "probs": p.tolist(), "num_classes": len(labels)}
                 for i, p in enumerate(probs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    })
