"""OpenAI-compatible routes for agent code: /v1/completions, /v1/chat/completions, /v1/models.

The protocol (parsing, templates, tool calls, answer and chunk shapes) is `tandem.openai_compat`;
this module runs requests on the engine. Each prompt of a request is one engine request (rid
`<id>-<prompt>`) with `n` samples, choice index = prompt * n + sample. Streams are SSE ending with
`data: [DONE]`; a client that disconnects aborts its requests (docs/inference.md, "OpenAI routes").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tandem.inference.outputs import RequestOutput
from tandem.inference.request import GenerationRequest
from tandem.inference.sampling_params import SamplingParams
from tandem.inference.server.engine_loop import PendingRequest
from tandem.inference.server.http_api import error_body, read_json
from tandem.inference.server.routes import sampling_params, state_of
from tandem.inference.server.state import ClientGone, ServerState, failure
from tandem.openai_compat import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    SSE_DONE,
    ChatStream,
    ChoiceOutput,
    CompletionStream,
    IncrementalText,
    TokenText,
    chat_completion,
    parse_chat_request,
    parse_completion_request,
    render_chat,
    sse,
    text_completion,
    token_text_of,
)
from tandem.openai_compat.stream import StreamBase

router = APIRouter()
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class Job:
    """One OpenAI request as engine requests."""

    rid: str
    prompts: list[list[int]]
    params: SamplingParams
    logprobs: bool
    top_logprobs: int

    def requests(self, stream: bool) -> list[GenerationRequest]:
        """One engine request per prompt (rid `<id>-<prompt>`), as the engine takes it."""
        return [GenerationRequest(f"{self.rid}-{i}", ids, self.params, return_logprob=self.logprobs, stream=stream,
                                  top_logprobs_num=self.top_logprobs) for i, ids in enumerate(self.prompts)]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def choice(self, out: RequestOutput, prompt: int) -> ChoiceOutput:
        return ChoiceOutput(index=prompt * self.params.n + out.index, output_ids=out.output_ids, text=out.text or "",
                            logprobs=out.output_logprobs if self.logprobs else None,
                            top_logprobs=out.output_top_logprobs if self.top_logprobs else None,
                            finish_reason=FINISH[out.finish_reason["type"]],
                            matched_stop=out.finish_reason.get("matched"), weight_version=str(out.weight_version))


def _params(sampling: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    return sampling_params({"max_new_tokens": default_max_tokens, **sampling}, where="request")


def _token_text(state: ServerState) -> TokenText:
    tok = state.tokenizer
    return (lambda t: f"token_id:{t}") if tok is None else token_text_of(tok)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    req = parse_completion_request(await read_json(request, allow_empty=False))
    prompts = [state.encode(p) if isinstance(p, str) else p for p in req.prompts]
    job = Job(f"cmpl-{uuid.uuid4().hex}", prompts, _params(req.sampling, DEFAULT_COMPLETION_MAX_TOKENS),
              req.logprobs is not None, req.logprobs or 0)
    created, model, token_text = int(time.time()), state.args.model_name, _token_text(state)
    if req.stream:
        stream = CompletionStream(job.rid, model, created, token_text, req.logprobs, req.include_usage,
                                  str(state.engine.weight_version), stop=job.params.stop)
        return await _stream(state, job, stream)
    choices = await _run(request, state, job)
    if choices is None:
        return Response(status_code=499)
    return JSONResponse(text_completion(id=job.rid, model=model, created=created, choices=choices,
                                        prompt_tokens=job.prompt_tokens, token_text=token_text,
                                        weight_version=choices[0].weight_version, logprobs=req.logprobs))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    req = parse_chat_request(await read_json(request, allow_empty=False))
    text = render_chat(state.tokenizer, req.messages, req.template_tools, template_kwargs=req.chat_template_kwargs)
    job = Job(f"chatcmpl-{uuid.uuid4().hex}", [state.encode(text)], _params(req.sampling, DEFAULT_CHAT_MAX_TOKENS),
              req.logprobs, req.top_logprobs)
    created, model, token_text = int(time.time()), state.args.model_name, _token_text(state)
    if req.stream:
        stream = ChatStream(job.rid, model, created, req.parse_tools, token_text, req.top_logprobs, req.include_usage,
                            str(state.engine.weight_version), stop=job.params.stop)
        return await _stream(state, job, stream)
    choices = await _run(request, state, job)
    if choices is None:
        return Response(status_code=499)
    return JSONResponse(chat_completion(id=job.rid, model=model, created=created, choices=choices,
                                        prompt_tokens=job.prompt_tokens, token_text=token_text,
                                        parse_tools=req.parse_tools, weight_version=choices[0].weight_version,
                                        top_logprobs=req.top_logprobs))


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = state_of(request)
    state.check_ready(generation=False)
    return JSONResponse({"object": "list", "data": [{
        "id": state.args.model_name, "object": "model", "created": int(state.started), "owned_by": "tandem",
        "root": state.args.model_path, "max_model_len": state.engine.max_model_len,
    }]})


async def _run(request: Request, state: ServerState, job: Job) -> list[ChoiceOutput] | None:
    """Every prompt to completion -> the choices; None when the client went away (all aborted)."""
    tasks = [state.run_request(request, req) for req in job.requests(stream=False)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            state.engine_loop.abort(job.rid, abort_all=False)  # the others, by prefix
            if isinstance(r, ClientGone):
                return None
            raise r
    return [job.choice(out, i) for i, outs in enumerate(results) for out in outs]


async def _stream(state: ServerState, job: Job, stream: StreamBase) -> Response:
    results = await asyncio.gather(*[state.submit(req) for req in job.requests(stream=True)],
                                   return_exceptions=True)
    if (error := next((r for r in results if isinstance(r, BaseException)), None)) is not None:
        state.engine_loop.abort(job.rid, abort_all=False)  # those that got in, by prefix
        raise error
    submitted: list[PendingRequest | list[RequestOutput]] = list(results)
    return StreamingResponse(_events(state, job, stream, submitted), media_type="text/event-stream")


async def _events(state: ServerState, job: Job, stream: StreamBase,
                  submitted: list[PendingRequest | list[RequestOutput]]) -> AsyncIterator[str]:
    """The SSE events: per step each choice's new tokens, at its end the rest and its finish
    reason; usage (when asked) and [DONE] last. A sample whose final output comes with its last
    tokens is answered from the final output alone (its text has stop strings trimmed)."""
    detok, params = state.engine.detokenizer, job.params

    def decode(ids: list[int]) -> str:
        if detok.tokenizer is None:
            return ""
        return detok.decode(ids, params.skip_special_tokens, params.spaces_between_special_tokens)

    for index in range(len(job.prompts) * params.n):  # role chunks in order: SDKs index choices by position
        for chunk in stream.delta(index, [], None, None, ""):
            yield sse(chunk)
    so_far: dict[int, IncrementalText] = {}
    completion_tokens = 0
    async with contextlib.aclosing(_merged(state, submitted)) as batches:
        async for prompt, batch in batches:
            ending = {item.index for kind, item in batch if kind == "final"}
            for kind, item in batch:
                index = prompt * params.n + item.index
                if kind == "final":
                    if (failed := failure([item])) is not None:  # the status (200) went out with the first byte
                        yield sse({"error": error_body(failed, 500)})
                        yield SSE_DONE
                        return
                    completion_tokens += item.completion_tokens
                    for chunk in stream.finish(job.choice(item, prompt)):
                        yield sse(chunk)
                elif item.index not in ending:
                    output = so_far.setdefault(index, IncrementalText(decode))
                    for chunk in stream.delta(index, item.token_ids, item.logprobs if job.logprobs else None,
                                              item.top_logprobs if job.top_logprobs else None,
                                              output.add(item.token_ids)):
                        yield sse(chunk)
    if (usage := stream.usage_chunk(job.prompt_tokens, completion_tokens)) is not None:
        yield sse(usage)
    yield SSE_DONE


async def _merged(state: ServerState, submitted: list[PendingRequest | list[RequestOutput]]
                  ) -> AsyncIterator[tuple[int, list[tuple[str, Any]]]]:
    """(prompt index, events of one step) from every prompt's request as they come; requests
    aborted at the gate give their final outputs at once. Closing it early aborts what is left."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(prompt: int, sub: PendingRequest | list[RequestOutput]) -> None:
        try:
            if isinstance(sub, list):
                queue.put_nowait((prompt, [("final", out) for out in sub]))
            else:
                async for batch in state.stream_batches(sub):
                    queue.put_nowait((prompt, batch))
            queue.put_nowait((prompt, None))
        except Exception as exc:
            queue.put_nowait((prompt, exc))

    pumps = [asyncio.ensure_future(pump(i, sub)) for i, sub in enumerate(submitted)]
    try:
        left = len(pumps)
        while left:
            prompt, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            else:
                yield prompt, item
    finally:
        for p in pumps:
            p.cancel()  # a pump still streaming aborts its request (stream_batches)
