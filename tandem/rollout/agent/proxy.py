"""The agent proxy: an OpenAI-compatible server in the process that runs the episodes, on the
event loop that runs them, generating through the fleet and recording every call in the session
whose key authenticates it (`Authorization: Bearer <session key>`, i.e. the client's api_key).

    POST /v1/chat/completions   stream or not, tools (Qwen's tool-call format), usage, the weight version
    GET  /v1/models

Sampling is the run's (`gen.*`): another temperature / top_p / top_k is a 400 naming the field, and
`max_tokens` may only lower `gen.max_new_tokens`. A call waits out a weight update's pause and
resumes on the new weights; a stream is sent once the call has finished. See docs/agents.md."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import uuid
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tandem.fleet.generation import GenerationParams
from tandem.openai_compat.chat import (
    SSE_DONE,
    ChatStream,
    ChoiceOutput,
    chat_completion,
    parse_tool_calls,
    sse,
)
from tandem.openai_compat.request import SAMPLING_FIELDS, ChatRequest, OpenAIRequestError, parse_chat_request
from tandem.openai_compat.tokens import token_text_of
from tandem.rollout.agent.session import AgentSession, Interaction, canonical_message, request_fingerprint
from tandem.rollout.asgi_server import EventServer, listen_socket
from tandem.rollout.chat_tokens import ChatTokens, TemplateNotPrefixStable
from tandem.rollout.client import InferenceClient
from tandem.rollout.types import ModelRequest

logger = logging.getLogger(__name__)

MODEL_NAME = "policy"
RETRY_HEADER = "x-stainless-retry-count"  # the openai client's attempt number (0: first)
# The run decides these; an agent may repeat the run's value but not change it.
_FIXED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
_ALLOWED = {"max_new_tokens", "stop_token_ids", "seed", "min_new_tokens", "ignore_eos", "n", *_FIXED}
_OPENAI_NAME = {target: name for name, (target, _) in SAMPLING_FIELDS.items()}  # for messages


class ProxyError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}},
                            self.status)


class AgentProxy:
    """Serves the sessions of the episodes running on one event loop (start it on that loop)."""

    def __init__(self, client: InferenceClient, tokenizer: Any, max_tokens: int | None = None,
                 host: str = "127.0.0.1"):
        self.client, self.tokenizer, self.max_tokens = client, tokenizer, max_tokens
        self.sessions: dict[str, tuple[AgentSession, GenerationParams]] = {}
        self._templates: dict[str, ChatTokens] = {}
        self._token_text = token_text_of(tokenizer)  # logprob entries' token texts
        self._sock, self.address = listen_socket(host, 0)
        self._server = EventServer(self._app())
        self._task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        return f"{self.address}/v1"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server.ready = ready = loop.create_future()
        self._task = loop.create_task(self._server.serve(sockets=[self._sock]))
        await asyncio.wait({self._task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            self._task.result()  # raises why it could not serve
            raise RuntimeError("the agent proxy stopped while starting")
        logger.info("agent proxy on %s", self.address)

    async def aclose(self) -> None:
        self._server.request_stop()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10.0)
        self._sock.close()

    def open_session(self, item_id: str, params: GenerationParams, discount: float = 1.0,
                     max_calls: int = 64) -> AgentSession:
        """A new session; its `key` is the api_key of the episode's client."""
        session = AgentSession(secrets.token_hex(16), item_id, discount, max_calls)
        self.sessions[session.key] = (session, params)
        return session

    def close_session(self, session: AgentSession) -> None:
        session.closed = True
        self.sessions.pop(session.key, None)

    # -- the app ---------------------------------------------------------------------------------
    def _app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            try:
                return await self._chat(request)
            except ProxyError as exc:
                return exc.response()
            except OpenAIRequestError as exc:
                return ProxyError(400, str(exc), exc.field).response()

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            try:
                self._session_of(request)
            except ProxyError as exc:
                return exc.response()
            return JSONResponse({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0,
                                                             "owned_by": "tandem"}]})

        return app

    def _session_of(self, request: Request) -> tuple[AgentSession, GenerationParams]:
        given = request.headers.get("authorization", "")
        key = given[7:] if given.lower().startswith("bearer ") else ""
        found = self.sessions.get(key)  # 128-bit random keys: a lookup, not a scan of every session
        if found is not None:
            return found
        raise ProxyError(401, "unknown or ended session: use the client the episode was given (its api_key is "
                         "the session key)", kind="authentication_error")

    async def _chat(self, request: Request) -> Response:
        session, run_params = self._session_of(request)
        try:
            body = await request.json()
        except ValueError as exc:
            raise ProxyError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "the body must be a JSON object")
        req = parse_chat_request(body)
        params = self._params(req, run_params)
        if req.top_logprobs:
            raise ProxyError(400, "top_logprobs is not available through the agent proxy (the fleet returns the "
                             "sampled token's logprob only); drop it or set it to 0", "top_logprobs")
        if len(session.live) >= session.max_calls:
            raise ProxyError(429, f"this episode made {session.max_calls} calls, the limit (rollout.agent.max_calls)",
                             kind="rate_limit_error")
        fingerprint = request_fingerprint(req.messages, req.tools, req.sampling)
        if _retry_count(request) > 0 and (old := session.supersede(fingerprint)) is not None:
            logger.debug("session %s: call %s retried by the client; the attempt is dropped", session.key[:8], old.id)
        call = await self._generate(request, session, req, params, fingerprint)
        if call is None:  # the client went away: nobody will see or train on it
            return Response(status_code=499)
        return self._answer(req, call)

    def _params(self, req: ChatRequest, run: GenerationParams) -> GenerationParams:
        extra = set(req.sampling) - _ALLOWED
        if extra:
            name = _OPENAI_NAME.get(sorted(extra)[0], sorted(extra)[0])
            raise ProxyError(400, f"{name} is not supported by the agent proxy (the run's gen.* settings decide "
                             "sampling); drop it", name)
        for key, attr in _FIXED.items():
            if key in req.sampling and req.sampling[key] != getattr(run, attr):
                raise ProxyError(400, f"{key}={req.sampling[key]!r} differs from the run's gen.{attr}="
                                 f"{getattr(run, attr)!r}: the trainer recomputes logprobs with the run's value; drop "
                                 "the field", key)
        if req.sampling.get("n", 1) != 1:
            raise ProxyError(400, "n must be 1 through the agent proxy: each call is one turn of the episode", "n")
        budget = min(int(req.sampling.get("max_new_tokens", run.max_new_tokens)), run.max_new_tokens)
        return dataclasses.replace(
            run, max_new_tokens=budget, stop_token_ids=list(req.sampling.get("stop_token_ids", run.stop_token_ids)),
            seed=req.sampling.get("seed", run.seed), min_new_tokens=int(req.sampling.get("min_new_tokens", 0)),
            ignore_eos=bool(req.sampling.get("ignore_eos", run.ignore_eos)))

    def _template(self, req: ChatRequest, key: str) -> ChatTokens:
        if key not in self._templates:
            self._templates[key] = ChatTokens(self.tokenizer, req.template_tools, req.chat_template_kwargs)
        return self._templates[key]

    def _prompt(self, session: AgentSession, req: ChatRequest, tools_key: str) -> tuple[list[int], Interaction | None]:
        template = self._template(req, tools_key)
        parent = session.parent_for(req.messages, tools_key)
        if parent is not None:
            history = req.messages[: len(parent.history)]
            try:
                tail = template.continuation_ids(parent.output_ids, history, req.messages[len(history):])
                return [*parent.prompt_ids, *parent.output_ids, *tail], parent
            except TemplateNotPrefixStable:
                logger.warning("session %s: the chat template renders the history differently once it grows; "
                               "this call starts a new chain", session.key[:8])
        return template.prompt_ids(req.messages), None

    async def _generate(self, request: Request, session: AgentSession, req: ChatRequest, params: GenerationParams,
                        fingerprint: str) -> Interaction | None:
        tools_key = request_fingerprint([], req.template_tools, req.chat_template_kwargs)  # how prompts render
        ids, parent = self._prompt(session, req, tools_key)
        sent_version = self.client.version.value
        rid = f"agent-{session.key[:8]}-{uuid.uuid4().hex[:12]}"
        work = asyncio.ensure_future(self.client.agenerate(ModelRequest(ids, params, self.max_tokens, rid=rid)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            return None
        resp = work.result()
        text = self.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
        content, calls = parse_tool_calls(text) if req.parse_tools else (text, [])
        answer: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            answer["tool_calls"] = calls
        call = Interaction(
            id=f"chatcmpl-{uuid.uuid4().hex}", messages=[canonical_message(m) for m in req.messages],
            answer=canonical_message(answer), prompt_ids=ids, output_ids=resp.output_ids,
            logprobs=resp.output_logprobs, versions=resp.output_versions, sent_version=sent_version,
            finish_reason=resp.finish_reason, fingerprint=fingerprint, tools_key=tools_key, parent=parent,
            text=text,
        )
        session.record(call)
        return call

    def _answer(self, req: ChatRequest, call: Interaction) -> Response:
        choice = ChoiceOutput(index=0, output_ids=call.output_ids, text=call.text,
                              logprobs=call.logprobs if req.logprobs else None, top_logprobs=None,
                              finish_reason=call.finish_reason, matched_stop=None)
        parse_tools = req.parse_tools
        token_text = self._token_text
        created = int(call.created)
        if not req.stream:
            body = chat_completion(id=call.id, model=req.model or MODEL_NAME, created=created, choices=[choice],
                                   prompt_tokens=len(call.prompt_ids), token_text=token_text,
                                   parse_tools=parse_tools, weight_version=call.sent_version, top_logprobs=0)
            return JSONResponse(body)
        stream = ChatStream(call.id, req.model or MODEL_NAME, created, parse_tools, token_text, 0,
                            req.include_usage, call.sent_version)

        async def events():
            for chunk in stream.delta(0, call.output_ids, choice.logprobs, None, call.text):
                yield sse(chunk)
            for chunk in stream.finish(choice):
                yield sse(chunk)
            if (usage := stream.usage_chunk(len(call.prompt_ids), len(call.output_ids))) is not None:
                yield sse(usage)
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")



def _retry_count(request: Request) -> int:
    try:
        return int(request.headers.get(RETRY_HEADER, "0"))
    except ValueError:
        return 0


async def _disconnected(request: Request) -> None:
    """Returns when the client closed its connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
