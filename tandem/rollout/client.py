"""The inference client: interruptible generation over a pool of servers.

`agenerate` POSTs prompt + everything generated so far with the remaining budget, tags each new
token with the weight version that produced it, and resubmits after an `abort` (a weight update)
until stop/length or the budget is spent. Transport failures are retried with backoff, on another
server when needed (the tokens so far and their versions kept), all inside one deadline per
request; a call to a server the membership evicts is given up at once and resubmitted. With
`ClientConfig.routed_expert_layout` (MoE) the response carries the routed experts
(`splice_routed_experts`). See docs/rollout.md, "The inference client"."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from tandem.fleet.adapters import adapter_for
from tandem.fleet.generation import Chunk, FinishReason
from tandem.fleet.routed_experts import (
    RoutedExpertLayout,
    RoutedExperts,
    decode_routed_experts,
    splice_routed_experts,
)
from tandem.rollout.errors import (
    GenerationDeadlineError,
    NoServerError,
    PromptTooLongError,
    ServerRequestError,
)
from tandem.rollout.frontier import continuation_seed
from tandem.rollout.pool import ServerPool
from tandem.rollout.types import ClassifyRequest, ModelRequest, ModelResponse, ScoreRequest
from tandem.rollout.version import WeightVersion

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ClientConfig:
    server_kind: str = "tandem"  # tandem | sglang | vllm (see tandem.fleet.adapters)
    model: str | None = None  # vLLM served model name, when the server checks it
    vllm_extension: bool = False  # vLLM servers run Tandem's worker extension (tandem.weights.vllm_worker)
    vllm_lora: bool = False  # vLLM servers serve the policy as a LoRA adapter named `model` (VLLMAdapter(lora=True))
    deadline_s: float = 600.0  # default per-request deadline (all calls, retries and waits)
    call_timeout_s: float | None = None  # one HTTP call; None = bounded by the deadline only
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    max_connections: int = 1024  # aiohttp connector limits, per event loop
    max_connections_per_host: int = 0  # 0 = no per-host limit
    api_key: str | None = None
    # Set (a MoE model's layout, `RoutedExpertLayout.of_model`): ask for routed experts (routing replay r3).
    routed_expert_layout: RoutedExpertLayout | None = None

    def __post_init__(self) -> None:
        if isinstance(self.routed_expert_layout, dict):  # crossed a process boundary as `asdict`
            self.routed_expert_layout = RoutedExpertLayout(**self.routed_expert_layout)


class _TransientHTTPError(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:200]}")
        self.status = status


class CallAbandoned(Exception):
    """The server was evicted while the call was in flight (`ServerPool.abandon`)."""


class InferenceClient:
    def __init__(self, pool: ServerPool | list[str], config: ClientConfig | None = None,
                 version: WeightVersion | None = None):
        self.pool = pool if isinstance(pool, ServerPool) else ServerPool(pool)
        self.config = config or ClientConfig()
        self.adapter = adapter_for(self.config.server_kind, self.config.model, self.config.vllm_extension,
                                   self.config.vllm_lora)
        # The version the controller announced last; stands in when a server does not report one.
        self.version = version or WeightVersion()
        # aiohttp sessions are bound to their event loop: one per loop, created on first use.
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
            weakref.WeakKeyDictionary()
        )
        self._sessions_lock = threading.Lock()
        self._counts_lock = threading.Lock()
        self._resubmitted = 0  # calls that failed on a server and went again (elsewhere) with their partial

    @property
    def resubmitted_total(self) -> int:
        """Generation calls resubmitted after their server failed (connection lost, no answer, 5xx)."""
        with self._counts_lock:
            return self._resubmitted

    # -- sessions -------------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        with self._sessions_lock:
            session = self._sessions.get(loop)
            if session is None or session.closed:
                connector = aiohttp.TCPConnector(
                    limit=self.config.max_connections, limit_per_host=self.config.max_connections_per_host
                )
                headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
                session = aiohttp.ClientSession(connector=connector, headers=headers)
                self._sessions[loop] = session
            return session

    async def aclose(self) -> None:
        """Close this event loop's session (call on every loop that used the client)."""
        with self._sessions_lock:
            session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    # -- generation -----------------------------------------------------------------------------
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        sample = self._sample(req, time.monotonic())
        try:
            await self._finish(sample)
        finally:
            self.pool.forget(req.rid)
        return self._response(sample)

    async def agenerate_samples(self, req: ModelRequest, n: int) -> list[ModelResponse]:
        """`n` samples of one prompt. Sample i is `req` with rid `{rid}-{i}` and, when seeded, seed
        `req.params.seed + i`: the rule of a server that samples n at once, so either path draws the
        same tokens. Where the server kind takes n samples per call (`samples_per_call`), the first
        call asks for all n (one request, the prompt prefilled once); each sample it left unfinished
        (a weight update aborted it) then continues alone. Elsewhere: n concurrent `agenerate`."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        seed = req.params.seed
        requests = [dataclasses.replace(
            req, rid=f"{req.rid}-{i}",
            params=req.params if seed is None else dataclasses.replace(req.params, seed=seed + i)) for i in range(n)]
        if n == 1 or not self.adapter.samples_per_call:
            async with asyncio.TaskGroup() as tg:  # one failed sample cancels its siblings
                tasks = [tg.create_task(self.agenerate(r)) for r in requests]
            return [t.result() for t in tasks]
        start = time.monotonic()
        samples = [self._sample(r, start) for r in requests]
        first = samples[0]  # all n share the prompt, the budget and the deadline
        try:
            call = _RequestState(rid=req.rid, deadline=first.state.deadline, deadline_s=first.state.deadline_s)
            body = self.adapter.generate_body(req.rid, list(req.input_ids), req.params, first.budget,
                                              return_routed_experts=self.config.routed_expert_layout is not None,
                                              n=n)
            chunks, server = await self._call(call, body, self._chunks(n))
            for sample in samples:
                sample.state.calls, sample.state.retries = call.calls, call.retries
                sample.state.tried.update(call.tried)
            for sample, chunk in zip(samples, chunks, strict=True):
                self._absorb(sample, chunk, server, len(req.input_ids))
            async with asyncio.TaskGroup() as tg:
                for sample in samples:
                    if sample.finish is None:
                        tg.create_task(self._finish(sample))
        finally:
            self.pool.forget(req.rid)
            for r in requests:
                self.pool.forget(r.rid)
        return [self._response(s) for s in samples]

    async def ascore(self, req: ScoreRequest) -> list[float]:
        """The logprobs of `req.input_ids[req.start:]` under the servers' weights (temperature 1):
        one prefill-only call, retried across transient failures and servers like generation,
        inside the request's deadline. A server that cannot score (its kind, a 4xx) raises."""
        deadline_s = req.deadline_s if req.deadline_s is not None else self.config.deadline_s
        state = _RequestState(rid=req.rid, deadline=time.monotonic() + deadline_s, deadline_s=deadline_s)
        body = self.adapter.score_body(req.rid, list(req.input_ids), req.start)

        def parse(data: Any) -> tuple[list[float], int]:
            return self.adapter.parse_score(data, req.input_ids, req.start), 0

        try:
            scores, _ = await self._call(state, body, parse)
        finally:
            self.pool.forget(req.rid)
        return scores

    async def aclassify(self, req: ClassifyRequest) -> list[float]:
        """Each of `req.sequences`' score (a reward model's first label) from the servers'
        classifier, one call for all of them, retried across transient failures and servers like
        generation inside the request's deadline."""
        deadline_s = req.deadline_s if req.deadline_s is not None else self.config.deadline_s
        state = _RequestState(rid=req.rid, deadline=time.monotonic() + deadline_s, deadline_s=deadline_s)
        body = self.adapter.classify_body(req.rid, [list(s) for s in req.sequences])

        def parse(data: Any) -> tuple[list[float], int]:
            return self.adapter.parse_classify(data, len(req.sequences)), 0

        try:
            scores, _ = await self._call(state, body, parse, self.adapter.classify_path)
        finally:
            self.pool.forget(req.rid)
        return scores

    def _chunks(self, n: int) -> Callable[[Any], tuple[list[Chunk], int]]:
        """How a generate call's answer reads: its `n` samples, and the tokens they brought."""

        def parse(data: Any) -> tuple[list[Chunk], int]:
            chunks = self.adapter.parse_samples(data, n)
            return chunks, sum(len(c.output_ids) for c in chunks)

        return parse

    def _sample(self, req: ModelRequest, start: float) -> _Sample:
        budget = req.params.max_new_tokens
        if req.max_tokens is not None:
            budget = min(req.max_tokens - len(req.input_ids), budget)
        if budget <= 0:
            raise PromptTooLongError(
                f"request {req.rid}: prompt of {len(req.input_ids)} tokens leaves no budget under "
                f"max_tokens={req.max_tokens} (max_new_tokens={req.params.max_new_tokens})"
            )
        deadline_s = req.deadline_s if req.deadline_s is not None else self.config.deadline_s
        return _Sample(req, budget, start, _RequestState(rid=req.rid, deadline=start + deadline_s, deadline_s=deadline_s))

    async def _finish(self, sample: _Sample) -> None:
        """Call until the sample stops or spends its budget: prompt + everything so far, the rest of
        the budget, a seeded request's continuation seed."""
        req, state = sample.req, sample.state
        empty = 0  # consecutive aborts that produced no token
        while sample.finish is None:
            sent = [*req.input_ids, *sample.out_ids]
            params = req.params if req.params.seed is None else dataclasses.replace(
                req.params, seed=continuation_seed(req.params.seed, len(sample.out_ids)))
            body = self.adapter.generate_body(req.rid, sent, params, sample.budget - len(sample.out_ids),
                                              return_routed_experts=self.config.routed_expert_layout is not None)
            (chunk,), server = await self._call(state, body, self._chunks(1))
            new = self._absorb(sample, chunk, server, len(sent))
            if sample.finish is None:
                # A paused server holds resubmissions until it continues, so aborts come one per
                # update; should a server abort with nothing produced, back off instead of spinning.
                empty = 0 if new else empty + 1
                if empty:
                    await asyncio.sleep(self._backoff(empty - 1, state))

    def _absorb(self, sample: _Sample, chunk: Chunk, server: str, num_sent: int) -> int:
        """Add one call's tokens (each tagged with its weight version) to `sample`; sets its finish
        reason when it stopped or spent its budget. Returns the number of new tokens."""
        sample.state.servers_used.append(server)
        remaining = sample.budget - len(sample.out_ids)
        new = chunk.output_ids[:remaining]  # a server never owes us more than the budget
        if self.config.routed_expert_layout is not None:
            sample.routed = splice_routed_experts(sample.routed,
                                                  self._routed_experts(chunk, server, num_sent, len(new)))
        sample.out_ids += new
        sample.out_lp += chunk.logprobs[: len(new)]
        sample.out_ver += chunk.versions(len(new), self.version.value)
        if chunk.finish_reason in ("stop", "length"):
            sample.finish = chunk.finish_reason
        elif len(sample.out_ids) >= sample.budget:  # aborted exactly when the budget ran out: that is length
            sample.finish = "length"
        else:
            sample.state.aborts += 1  # paused for a weight update: `_finish` resubmits prompt + partial
        return len(new)

    def _response(self, sample: _Sample) -> ModelResponse:
        req, state, routed = sample.req, sample.state, sample.routed
        if self.config.routed_expert_layout is not None:  # the last token was never forwarded: unknown
            total = len(req.input_ids) + len(sample.out_ids)
            unknown = self.config.routed_expert_layout.unknown_row
            routed = routed[:total] + [unknown() for _ in range(total - len(routed))]
        assert sample.finish is not None
        return ModelResponse(
            rid=req.rid,
            input_ids=list(req.input_ids),
            output_ids=sample.out_ids,
            output_logprobs=sample.out_lp,
            output_versions=sample.out_ver,
            finish_reason=sample.finish,
            servers=state.servers_used,
            num_calls=state.calls,
            num_aborts=state.aborts,
            num_retries=state.retries,
            latency_s=time.monotonic() - sample.start,
            routed_experts=routed if self.config.routed_expert_layout is not None else None,
        )

    def _routed_experts(self, chunk: Chunk, server: str, num_sent: int, num_new: int) -> RoutedExperts:
        """The chunk's rows for the `num_sent + num_new - 1` tokens the server forwarded."""
        layout = self.config.routed_expert_layout
        assert layout is not None
        if chunk.routed_experts is None and chunk.finish_reason == "abort":
            return []  # aborted before it ran: nothing computed (the next chunk brings the rows)
        if chunk.routed_experts is None:
            raise ServerRequestError(server, 200, "the server answered without meta_info.routed_experts although "
                                     "return_routed_experts was asked (an SGLang server needs "
                                     "--enable-return-routed-experts; a dense model has no routes)")
        rows = num_sent + len(chunk.output_ids) - 1
        return decode_routed_experts(chunk.routed_experts, rows, layout)[: num_sent + num_new - 1]

    async def _call(self, state: _RequestState, body: dict[str, Any],
                    parse: Callable[[Any], tuple[T, int]], path: str | None = None) -> tuple[T, str]:
        """One call to `path` (default: the generate route; `parse` reads its answer: what it
        holds, and the tokens generated), retried across transient failures until the deadline."""
        rid = state.rid
        attempt = 0
        while True:
            left = state.deadline - time.monotonic()
            if left <= 0:
                raise state.deadline_error()
            try:
                server = self.pool.choose(rid)
            except NoServerError as exc:  # nobody may serve right now: wait for the fleet
                state.last_error = str(exc)
                await asyncio.sleep(self._backoff(attempt, state))
                attempt += 1
                continue
            state.tried.setdefault(server, None)
            timeout = left if self.config.call_timeout_s is None else min(left, self.config.call_timeout_s)
            abandoned = asyncio.get_running_loop().create_future()
            try:
                with self.pool.lease(server, _setter(abandoned)):
                    state.calls += 1
                    data = await self._post_unless(abandoned, server, path or self.adapter.generate_path, body,
                                                   timeout)
                result, tokens = parse(data)
                self.pool.mark_success(server, tokens)
                return result, server
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, _TransientHTTPError, TimeoutError,
                    CallAbandoned) as exc:
                state.last_error = f"{server}: {type(exc).__name__}: {exc}".rstrip(": ")
                if time.monotonic() >= state.deadline:
                    # Out of time, not necessarily the server's fault: do not mark it.
                    raise state.deadline_error() from exc
                # Connection failures and hung calls take the server out of routing at once.
                self.pool.mark_error(server, connection_failed=not isinstance(exc, _TransientHTTPError))
                with self._counts_lock:
                    self._resubmitted += 1
                delay = self._backoff(attempt, state)
                logger.debug("request %s: %s; retry in %.2fs", rid, state.last_error, delay)
                attempt += 1
                state.retries += 1
                await asyncio.sleep(delay)

    def _backoff(self, attempt: int, state: _RequestState) -> float:
        delay = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2**attempt)
        return min(delay, max(0.0, state.deadline - time.monotonic()))

    async def _post_unless(self, abandoned: asyncio.Future[None], server: str, path: str, body: dict[str, Any],
                           timeout: float) -> dict[str, Any]:
        """`_post`, given up (`CallAbandoned`) once `abandoned` is set: the server was evicted."""
        post = asyncio.ensure_future(self._post(server, path, body, timeout))
        post.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "exception never retrieved"
        try:
            await asyncio.wait((post, abandoned), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not post.done():  # given up, or this request cancelled: the call ends before we go on
                post.cancel()
                await asyncio.wait((post,))
        if post.cancelled():
            raise CallAbandoned("the server was evicted while this call was in flight")
        return post.result()

    async def _post(self, server: str, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        session = self._session()
        async with session.post(server + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status >= 500:
                raise _TransientHTTPError(resp.status, await resp.text())
            if resp.status >= 400:
                raise ServerRequestError(server, resp.status, await resp.text())
            return await resp.json()


def _setter(fut: asyncio.Future[None]) -> Callable[[], None]:
    """A thread-safe callback that completes `fut` on its loop (a no-op once that loop is closed)."""
    loop = fut.get_loop()

    def complete() -> None:
        if not fut.done():
            fut.set_result(None)

    def call() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed after its call ended
            loop.call_soon_threadsafe(complete)

    return call


@dataclass
class _Sample:
    """One sample's progress: its request, token budget, and what its calls returned so far."""

    req: ModelRequest
    budget: int
    start: float
    state: _RequestState
    out_ids: list[int] = field(default_factory=list)
    out_lp: list[float] = field(default_factory=list)
    out_ver: list[int] = field(default_factory=list)
    routed: RoutedExperts = field(default_factory=list)
    finish: FinishReason | None = None  # set once it stopped or spent its budget


@dataclass
class _RequestState:
    rid: str
    deadline: float
    deadline_s: float
    calls: int = 0
    aborts: int = 0
    retries: int = 0
    last_error: str = ""
    tried: dict[str, None] = field(default_factory=dict)  # ordered set of servers tried
    servers_used: list[str] = field(default_factory=list)

    def deadline_error(self) -> GenerationDeadlineError:
        return GenerationDeadlineError(self.rid, self.deadline_s, list(self.tried), self.last_error)
