"""A protocol-faithful fake inference server for rollout tests (real HTTP on 127.0.0.1).

Implements `POST /generate` (protocol.md section 2; `sampling_params.n` > 1 answers a list of n
samples with their `index`, one request as the server counts them), a vLLM-shaped `POST /inference/v1/generate`, and the
control routes the rollout side uses (`/pause_generation`, `/continue_generation`,
`/update_weight_version`, `/commit_staged_weights` (sets the version; there are no weights), `/get_weight_version`, `/health`). Generation is deterministic: each
next token is `(last * 7 + 3) % vocab_size`, so a resubmitted prompt + partial continues the same
chain on any server, and its logprob is `-(token % 97 + 1) / 100`.

Scripted answers (`replies`: token id lists, one per generation request, in order) stand in
for a model that must say something exact (a tool call). Fault modes: `fail_first` (answer 500 to the first N generation requests), `hang` (never answer),
`token_delay_s` (slow server), `abort_when_done` (report `abort` after producing the full budget)
and, only as a subprocess (`python -m tests.rollout.fake_server`), `--die-after K` (the process
exits shortly after its K-th generation request, in the middle of requests).

In-process use: `FakeServer(...).start()` runs the app on its own event loop in a daemon thread.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


def next_token(last: int, vocab_size: int) -> int:
    return (last * 7 + 3) % vocab_size


def chain(last: int, n: int, vocab_size: int) -> list[int]:
    """The tokens a fake server produces after a sequence ending in `last`."""
    out = []
    for _ in range(n):
        last = next_token(last, vocab_size)
        out.append(last)
    return out


def token_logprob(token: int) -> float:
    return -(token % 97 + 1) / 100


@dataclass
class FakeConfig:
    vocab_size: int = 1000
    token_delay_s: float = 0.0
    eos_token_id: int | None = None
    fail_first: int = 0
    hang: bool = False
    abort_when_done: bool = False
    version: int = 0
    vllm_report_version: bool = False  # vLLM labels tokens with the version set; else "default"
    abort_answer_delay_s: float = 0.0  # an aborted vLLM request answers this much later (a lagging answer)
    die_after: int | None = None  # subprocess only
    die_delay_s: float = 0.2
    # Scripted answers: the k-th generation produces replies[k] (then stops, as on an EOS) instead
    # of the chain; once they are used up, the chain again.
    replies: list[list[int]] = field(default_factory=list)
    # Checks real servers make: the API key every generation must carry (401 without it, as
    # `tandem serve --api-key` and vLLM answer), and the served model name a vLLM completion
    # names when it names one (404 for another, as vLLM answers).
    api_key: str | None = None
    served_model_name: str | None = None


@dataclass
class LogEntry:
    route: str
    rid: str
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finish: str = ""
    version: int = 0


class FakeServer:
    def __init__(self, **config: Any):
        self.config = FakeConfig(**config)
        self.version = self.config.version
        self.log: list[LogEntry] = []
        self.num_requests = 0
        self.health_probes = 0  # GET /health answered
        self._progress = threading.Condition()
        self._tokens = 0  # tokens produced in total (tests wait on it)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- app ------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self._h_generate)
        app.router.add_post("/inference/v1/generate", self._h_vllm_generate)
        app.router.add_post("/pause_generation", self._h_pause)
        app.router.add_post("/continue_generation", self._h_continue)
        app.router.add_post("/update_weight_version", self._h_update_version)
        app.router.add_post("/commit_staged_weights", self._h_commit)
        app.router.add_get("/get_weight_version", self._h_get_version)
        app.router.add_get("/health", self._h_health)
        return app

    async def _setup(self, port: int = 0) -> int:
        self._running = asyncio.Event()
        self._running.set()
        self._abort = asyncio.Event()
        self._runner = web.AppRunner(self.app(), shutdown_timeout=0.1, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- generation core ------------------------------------------------------------------------
    async def _produce(self, route: str, rid: str, input_ids: list[int], max_new: int, stop_ids: set[int],
                       sibling: bool = False) -> LogEntry | None:
        """One sample; `sibling`: sample 1.. of a request for n samples, which counts (and fails,
        hangs or dies) as part of sample 0's request."""
        cfg = self.config
        if not sibling:
            with self._progress:
                self.num_requests += 1
                self._progress.notify_all()
            if cfg.die_after is not None and self.num_requests >= cfg.die_after:
                asyncio.get_running_loop().call_later(cfg.die_delay_s, os._exit, 1)
            if self.num_requests <= cfg.fail_first:
                return None
            if cfg.hang:
                await asyncio.Event().wait()
        await self._running.wait()  # paused: new requests wait inside the server until continue
        abort = self._abort
        # The version that produced the tokens, read as they are produced: an update applied
        # right after a pause must not relabel the partial output of the aborted requests.
        entry = LogEntry(route, rid, list(input_ids), version=self.version)
        self.log.append(entry)
        last = input_ids[-1] if input_ids else 0
        finish = "length"
        scripted = list(cfg.replies.pop(0)) if cfg.replies else None
        for _ in range(max_new):
            if abort.is_set():
                finish = "abort"
                break
            if cfg.token_delay_s > 0:
                try:
                    await asyncio.wait_for(abort.wait(), cfg.token_delay_s)
                    finish = "abort"
                    break
                except TimeoutError:
                    # wait_for yields once more while it cancels its inner wait: a pause can land
                    # there, and the token made after it would carry the version set after the
                    # pause (a suite run at 830c8af labelled a whole partial with version 1).
                    if abort.is_set():
                        finish = "abort"
                        break
            last = scripted.pop(0) if scripted else next_token(last, cfg.vocab_size)
            entry.output_ids.append(last)
            entry.version = self.version
            with self._progress:
                self._tokens += 1
                self._progress.notify_all()
            if last == cfg.eos_token_id or last in stop_ids or scripted == []:
                finish = "stop"
                break
        if cfg.abort_when_done and finish == "length":
            finish = "abort"
        entry.finish = finish
        return entry

    def _refusal(self, request: web.Request, body: dict[str, Any]) -> web.Response | None:
        key = self.config.api_key
        if key is not None and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"object": "error", "message": "invalid API key", "code": 401}, status=401)
        model = body.get("model")
        if self.config.served_model_name is not None and model is not None and model != self.config.served_model_name:
            return web.json_response({"object": "error", "message": f"The model `{model}` does not exist.",
                                      "code": 404}, status=404)
        return None

    async def _h_generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if (refused := self._refusal(request, body)) is not None:
            return refused
        sp = body.get("sampling_params", {})
        rid = body.get("rid", "")
        n = int(sp.get("n", 1))  # SGLang's n samples of one prompt: a list of n answers with their index
        start = time.monotonic()
        entries = await asyncio.gather(*(self._produce(
            "generate", rid, body["input_ids"], sp.get("max_new_tokens", 128), set(sp.get("stop_token_ids") or []),
            sibling=i > 0) for i in range(n)))
        if entries[0] is None:
            return web.json_response({"object": "error", "message": "injected failure", "code": 500}, status=500)
        answers = [self._sglang_answer(rid, entry, body, start) for entry in entries]
        if n == 1:
            return web.json_response(answers[0])
        return web.json_response([{**answer, "index": i} for i, answer in enumerate(answers)])

    @staticmethod
    def _sglang_answer(rid: str, entry: LogEntry, body: dict[str, Any], start: float) -> dict[str, Any]:
        if entry.finish == "stop":
            reason: dict[str, Any] = {"type": "stop", "matched": entry.output_ids[-1]}
        elif entry.finish == "length":
            reason = {"type": "length", "length": len(entry.output_ids)}
        else:
            reason = {"type": "abort", "message": "paused for a weight update"}
        meta: dict[str, Any] = {
            "id": rid, "prompt_tokens": len(entry.input_ids), "completion_tokens": len(entry.output_ids),
            "cached_tokens": 0, "weight_version": str(entry.version), "e2e_latency": time.monotonic() - start,
            "finish_reason": reason,
        }
        if body.get("return_logprob") and not (entry.finish == "abort" and not entry.output_ids):
            meta["output_token_logprobs"] = [[token_logprob(t), t, None] for t in entry.output_ids]
        return {"text": "", "output_ids": entry.output_ids, "meta_info": meta}

    async def _h_vllm_generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if (refused := self._refusal(request, body)) is not None:
            return refused
        sp = body.get("sampling_params") or {}
        if not (isinstance(body.get("token_ids"), list) and sp.get("logprobs") == 0 and body.get("output_mode") == "tokens"):
            return web.json_response({"object": "error", "message": "token ids expected", "code": 400}, status=400)
        entry = await self._produce(
            "vllm-generate", body.get("request_id", ""), body["token_ids"], sp.get("max_tokens", 16),
            set(sp.get("stop_token_ids") or []),
        )
        if entry is None:
            return web.json_response({"object": "error", "message": "injected failure", "code": 500}, status=500)
        if entry.finish == "abort" and self.config.abort_answer_delay_s:
            await asyncio.sleep(self.config.abort_answer_delay_s)
        n = len(entry.output_ids)
        # vLLM labels tokens with the version last set; "default" before any was.
        label = str(entry.version) if self.config.vllm_report_version else "default"
        choice: dict[str, Any] = {
            "index": 0, "finish_reason": entry.finish, "token_ids": entry.output_ids,
            "logprobs": {"content": [{"token_id": t, "logprob": token_logprob(t), "top_logprobs": []}
                                     for t in entry.output_ids]},
            "weight_versions": [{"version": label, "start": 0, "end": n}] if n else [],
        }
        return web.json_response({"request_id": entry.rid, "model": "fake", "choices": [choice]})

    # -- control --------------------------------------------------------------------------------
    def _do_pause(self) -> None:
        self._running.clear()
        self._abort.set()  # every running request answers abort with its partial output
        self._abort = asyncio.Event()

    async def _h_pause(self, request: web.Request) -> web.Response:
        self._do_pause()
        return web.json_response({"success": True, "message": ""})

    async def _h_continue(self, request: web.Request) -> web.Response:
        self._running.set()
        return web.json_response({"success": True, "message": ""})

    async def _h_commit(self, request: web.Request) -> web.Response:
        """tandem serve's commit with nothing to swap in here: it sets the version, first answering
        the running requests `abort` when asked (`abort_all_requests`), as a pause would."""
        body = await request.json()
        if body.get("abort_all_requests"):
            self._abort.set()
            self._abort = asyncio.Event()
        self.version = int(body["weight_version"])
        return web.json_response({"success": True, "message": ""})

    async def _h_update_version(self, request: web.Request) -> web.Response:
        self.version = int((await request.json())["new_version"])
        return web.json_response({"success": True, "message": ""})

    async def _h_get_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.version)})

    async def _h_health(self, request: web.Request) -> web.Response:
        self.health_probes += 1
        return web.json_response({"requests": self.num_requests})  # tests read how busy it was

    # -- in-process handle (thread-safe, blocking) -----------------------------------------------
    def start(self) -> FakeServer:
        if self.config.die_after is not None:
            raise ValueError("die_after would kill the test process; run the server as a subprocess")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fake-server")
        self._thread.start()
        self._run(self._setup())
        return self

    def _run(self, coro: Any, timeout: float = 10.0) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def pause(self) -> None:
        self._run(self._call(self._do_pause))

    def continue_generation(self) -> None:
        self._run(self._call(self._running.set))

    def set_version(self, version: int) -> None:
        self.version = version

    def wait_for_tokens(self, n: int, timeout: float = 10.0) -> None:
        """Block until the server has produced at least `n` tokens in total."""
        with self._progress:
            if not self._progress.wait_for(lambda: self._tokens >= n, timeout):
                raise TimeoutError(f"server produced {self._tokens} < {n} tokens in {timeout}s")

    def wait_for_requests(self, n: int, timeout: float = 10.0) -> None:
        """Block until at least `n` generation requests have arrived (paused ones included)."""
        with self._progress:
            if not self._progress.wait_for(lambda: self.num_requests >= n, timeout):
                raise TimeoutError(f"server received {self.num_requests} < {n} requests in {timeout}s")

    def entries(self, rid: str) -> list[LogEntry]:
        return [e for e in self.log if e.rid == rid]

    def stop(self) -> None:
        if self._loop is None:
            return
        if self._runner is not None:
            self._run(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(5)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--die-after", type=int, default=None)
    p.add_argument("--die-delay", type=float, default=0.2)
    p.add_argument("--version", type=int, default=0)
    args = p.parse_args(argv)
    server = FakeServer(token_delay_s=args.token_delay, die_after=args.die_after, die_delay_s=args.die_delay,
                        version=args.version)

    async def serve() -> None:
        port = await server._setup(0)
        print(f"PORT {port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
