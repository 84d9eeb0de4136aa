"""What the routes share: the engine loop, the generation gate (pause / memory release), requests
waiting at the gate, the weight receiver, and `run_request`, the one path every generation takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from tandem.inference.errors import RequestError
from tandem.inference.outputs import ABORT_BEFORE_PREFILL, RequestOutput
from tandem.inference.request import GenerationRequest
from tandem.inference.server.args import ServerArgs
from tandem.inference.server.engine_loop import EngineLoop, PendingRequest
from tandem.inference.server.faults import FaultInjector
from tandem.inference.server.http_api import ApiError
from tandem.inference.server.weights.paths import allowed_weight_dirs
from tandem.inference.server.weights.receiver import WeightReceiver


class ClientGone(Exception):
    """The client closed its connection; its request was aborted."""


class ServerState:
    def __init__(self, args: ServerArgs, engine_loop: EngineLoop, faults: FaultInjector | None = None):
        self.args, self.engine_loop = args, engine_loop
        self.paused = False
        self.released: set[str] = set()  # memory tags released: "kv_cache", "weights"
        self.gate = asyncio.Event()  # open while generation may start
        self.gate.set()
        self.waiting: dict[str, asyncio.Future] = {}  # rid -> abort signal, requests held at the gate
        self.host_memory: dict[str, Any] = {}  # what /release_memory_occupation set aside
        self.weights: WeightReceiver = WeightReceiver(engine_loop, lambda: "weights" in self.released)
        self.weight_dirs = allowed_weight_dirs(args)  # where /update_weights_from_disk may read
        self.faults = faults  # fault injection (tests only; see faults.py); None in production
        self.started = time.time()

    # ------------------------------------------------------------------ status
    @property
    def engine(self):
        return self.engine_loop.engine

    def check_ready(self, generation: bool = True) -> None:
        """503 while the engine loads or after it broke; with `generation` (a route of a generating
        server: generation, weights, memory, pause), 400 on a server of a classifier."""
        if self.engine_loop.error:
            raise ApiError("the engine is broken; see the server log", 503)
        if not self.engine_loop.ready.is_set() or self.engine is None:
            raise ApiError("the server is starting; poll /health", 503)
        if generation and self.args.is_embedding:
            raise ApiError(f"this server serves a sequence classifier ({self.args.model_path}, started with "
                           "--is-embedding): it scores sequences on POST /classify and /v1/classify and generates "
                           "nothing; this route needs a server started without --is-embedding")

    @property
    def tokenizer(self) -> Any | None:
        return self.engine.detokenizer.tokenizer if self.engine is not None else None

    def update_gate(self) -> None:
        if self.paused or self.released:
            self.gate.clear()
        else:
            self.gate.set()

    def abort_waiting(self, rid: str | None, abort_all: bool) -> int:
        """Answer requests held at the gate whose rid starts with `rid` (or all) with abort."""
        hit = [r for r in self.waiting if abort_all or (rid is not None and r.startswith(rid))]
        for r in hit:
            if not self.waiting[r].done():
                self.waiting[r].set_result(None)
        return len(hit)

    # ------------------------------------------------------------------ generation
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError("this model has no tokenizer; send input_ids instead of text")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    async def wait_gate(self, req: GenerationRequest) -> list[RequestOutput] | None:
        """Hold a new request while generation is paused or memory released. -> None when it may
        go on, or its abort outputs when `/abort_request` hit it while waiting."""
        if self.gate.is_set():
            return None
        aborted = asyncio.get_running_loop().create_future()
        self.waiting[req.rid] = aborted
        try:
            while not self.gate.is_set():
                gate = asyncio.ensure_future(self.gate.wait())
                await asyncio.wait({gate, aborted}, return_when=asyncio.FIRST_COMPLETED)
                gate.cancel()
                if aborted.done():
                    prompt = len(req.input_ids)
                    experts = self.engine.unknown_routed_experts(prompt - 1) if req.return_routed_experts else None
                    return [_queued_abort(req.rid, i, prompt, self.engine.weight_version, req.return_logprob,
                                          experts) for i in range(req.params.n)]
        finally:
            self.waiting.pop(req.rid, None)
        return None

    async def submit(self, req: GenerationRequest) -> PendingRequest | list[RequestOutput]:
        """Gate, then add to the engine. -> the PendingRequest, or final outputs (aborted at the gate).
        RequestError becomes a 400."""
        if req.rid in self.waiting:
            raise ApiError(f"request id {req.rid!r} is already in flight")
        held = await self.wait_gate(req)
        if held is not None:
            return held
        pending, added = self.engine_loop.add(req)
        try:
            await added
        except RequestError as exc:
            raise ApiError(str(exc)) from exc
        return pending

    async def run_request(self, request: Request, req: GenerationRequest) -> list[RequestOutput]:
        """Run one non-streaming request (`req.stream` false) to completion; abort it if the client
        disconnects. A request the engine failed (its logits were not finite) raises ApiError 500."""
        rid = req.rid
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            submit = asyncio.ensure_future(self.submit(req))
            await asyncio.wait({submit, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not submit.done():  # gone while held at the gate
                submit.cancel()
                self.engine_loop.abort(rid, exact=True)  # in case it got as far as the engine
                raise ClientGone(rid)
            pending = submit.result()
            if isinstance(pending, list):
                return pending
            await asyncio.wait({pending.future, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not pending.future.done():
                self.engine_loop.abort(rid, exact=True)
                raise ClientGone(rid)
            outs = pending.future.result()
            if (failed := failure(outs)) is not None:
                raise ApiError(failed, 500)
            return outs
        finally:
            watcher.cancel()

    async def stream_request(self, pending: PendingRequest) -> AsyncIterator[tuple[str, Any]]:
        """Events of a streaming request until each sample's final output; aborts it if the
        consumer stops early (the client disconnected)."""
        async with contextlib.aclosing(self.stream_batches(pending)) as batches:
            async for batch in batches:
                for event in batch:
                    yield event

    async def stream_batches(self, pending: PendingRequest) -> AsyncIterator[list[tuple[str, Any]]]:
        """As `stream_request`, but the events that arrived together as one list: those of one
        engine step, so a sample's last token and its final output always share a list."""
        finals = 0
        try:
            while finals < pending.n:
                batch = [await pending.queue.get()]
                while not pending.queue.empty():
                    batch.append(pending.queue.get_nowait())
                if (error := next((item for kind, item in batch if kind == "error"), None)) is not None:
                    raise RuntimeError(error)
                finals += sum(kind == "final" for kind, _ in batch)
                yield batch
        finally:
            if finals < pending.n:
                self.engine_loop.abort(pending.rid, exact=True)


def failure(outputs: list[RequestOutput]) -> str | None:
    """The engine's message when it failed this request (finish reason "error"), else None."""
    return next((o.finish_reason["message"] for o in outputs if o.finish_reason.get("type") == "error"), None)


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closed the connection (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _queued_abort(rid: str, index: int, prompt_tokens: int, version: int, return_logprob: bool,
                  routed_experts: Any = None) -> RequestOutput:
    """SGLang's answer for a request aborted before its prefill: no tokens, an empty logprob list."""
    return RequestOutput(rid=rid, index=index, output_ids=[], output_logprobs=[] if return_logprob else None,
                         finish_reason={"type": "abort", "message": ABORT_BEFORE_PREFILL},
                         prompt_tokens=prompt_tokens, cached_tokens=0, weight_version=version, e2e_latency=0.0,
                         text="", routed_experts=routed_experts)
