"""The engine thread: the only code that touches the `LLMEngine`, bridged to an asyncio loop.

HTTP handlers never call the engine. They hand it closures (`call`) or requests (`add`) through a
command queue guarded by a condition variable; the thread sleeps on that condition whenever it has
neither commands nor unfinished requests (an idle server burns no CPU), runs the commands between
model steps, then steps. Results go back with `loop.call_soon_threadsafe`: one callback per step
resolves each finished request's future and feeds streaming requests' queues.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.inference.classifier import ClassifierEngine
from tandem.inference.engine import LLMEngine
from tandem.inference.outputs import RequestOutput, TokenDelta
from tandem.inference.request import GenerationRequest
from tandem.inference.server.args import ServerArgs

log = logging.getLogger("tandem.serve")


@dataclass
class PendingRequest:
    """A request in the engine, as seen from the asyncio side."""

    rid: str
    n: int
    future: asyncio.Future  # -> list[RequestOutput] sorted by sample index
    queue: asyncio.Queue | None = None  # streaming: ("delta", TokenDelta) / ("final", RequestOutput)
    outputs: list[RequestOutput] = field(default_factory=list)


class EngineLoop:
    def __init__(self, args: ServerArgs, loop: asyncio.AbstractEventLoop):
        self.args, self.loop = args, loop
        self.engine: LLMEngine | None = None
        self.error: str | None = None  # set when the engine failed to load or its thread died
        self.ready = threading.Event()
        self.hold = False  # engine thread only: no steps (paused in place, memory released)
        self._cond = threading.Condition()
        self._commands: deque[tuple[Callable[[LLMEngine], Any], asyncio.Future | None]] = deque()
        self._pending: dict[str, PendingRequest] = {}  # engine thread only
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)

    # ------------------------------------------------------------------ asyncio side
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread between steps; -> a future of its result/exception."""
        fut = self.loop.create_future()
        self._push(fn, fut)
        return fut

    def add(self, request: GenerationRequest) -> tuple[PendingRequest, asyncio.Future]:
        """Queue `request`. -> (its PendingRequest, a future that fails with RequestError if the
        engine rejects it and resolves to None once it is in). Enqueued synchronously, so a caller
        that does not await in between keeps its order against other commands."""
        pending = PendingRequest(request.rid, request.params.n, self.loop.create_future(),
                                 asyncio.Queue() if request.stream else None)

        def add(engine: LLMEngine) -> None:
            engine.add_request(request)
            self._pending[request.rid] = pending

        return pending, self.call(add)

    def abort(self, rid: str | None = None, abort_all: bool = False, exact: bool = False) -> asyncio.Future:
        return self.call(lambda e: e.abort(rid, abort_all=abort_all, exact=exact))

    def set_hold(self, hold: bool) -> asyncio.Future:
        def apply(_: LLMEngine) -> None:
            self.hold = hold
        return self.call(apply)

    # ------------------------------------------------------------------ engine thread
    def _push(self, fn: Callable[[LLMEngine], Any], fut: asyncio.Future | None) -> None:
        with self._cond:
            self._commands.append((fn, fut))
            self._cond.notify()

    def _run(self) -> None:
        a = self.args
        try:
            if a.num_threads:
                torch.set_num_threads(a.num_threads)
            if a.is_embedding:  # a reward model: commands only (`ClassifierEngine.classify`), never a step
                self.engine = ClassifierEngine(a.model_path, device=a.device, dtype=a.torch_dtype,
                                               max_num_batched_tokens=a.max_num_batched_tokens)
            else:
                self.engine = LLMEngine(a.model_path, max_num_seqs=a.max_num_seqs,
                                        max_num_batched_tokens=a.max_num_batched_tokens,
                                        kv_cache_tokens=a.kv_cache_tokens, block_size=a.block_size,
                                        device=a.device, dtype=a.torch_dtype, seed=a.seed,
                                        batch_invariant=a.batch_invariant)
        except Exception as exc:  # the first line (what /health reports) says why
            self.error = f"engine failed to load: {exc}\n" + traceback.format_exc()
            log.error(self.error)
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop(self.engine)
        except Exception:
            self.error = "engine thread died:\n" + traceback.format_exc()
            log.error(self.error)
            self.loop.call_soon_threadsafe(self._fail_all, self.error)

    def _loop(self, engine: LLMEngine) -> None:
        while True:
            with self._cond:
                while not self._commands and not self._stopping and (self.hold or not engine.has_unfinished()):
                    self._cond.wait()
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
            for fn, fut in commands:
                try:
                    result, exc = fn(engine), None
                except Exception as e:  # answered to the caller; the engine stays consistent
                    result, exc = None, e
                if fut is not None:
                    self.loop.call_soon_threadsafe(_resolve, fut, result, exc)
            if not self.hold and engine.has_unfinished():
                outputs = engine.step()
                deltas = engine.pop_deltas()
                if outputs or deltas:
                    self._dispatch(outputs, deltas)

    def _dispatch(self, outputs: list[RequestOutput], deltas: list[TokenDelta]) -> None:
        events: list[tuple[PendingRequest, str, Any]] = []
        finished: list[PendingRequest] = []
        for d in deltas:
            p = self._pending.get(d.rid)
            if p is not None and p.queue is not None:
                events.append((p, "delta", d))
        for out in outputs:
            p = self._pending.get(out.rid)
            if p is None:
                continue
            p.outputs.append(out)
            if p.queue is not None:
                events.append((p, "final", out))
            if len(p.outputs) == p.n:
                del self._pending[out.rid]
                finished.append(p)
        self.loop.call_soon_threadsafe(_deliver, events, finished)

    def _fail_all(self, message: str) -> None:
        for p in list(self._pending.values()):
            if not p.future.done():
                p.future.set_exception(RuntimeError(message))
            if p.queue is not None:
                p.queue.put_nowait(("error", message))


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _deliver(events: list[tuple[PendingRequest, str, Any]], finished: list[PendingRequest]) -> None:
    for p, kind, item in events:
        p.queue.put_nowait((kind, item))
    for p in finished:
        if not p.future.done():
            p.future.set_result(sorted(p.outputs, key=lambda o: o.index))
