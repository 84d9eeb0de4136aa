"""A simulated inference fleet for control-plane scale runs (bench/scale.py and its CI test): many
lightweight servers in one process, each an aiohttp app on its own loopback port, speaking the
routes Tandem's controller uses (protocol.md): `/generate` (token ids in and out, logprobs, finish
reasons, the weight version), `/pause_generation` (running requests answer `abort` with their
partial output; new ones wait), `/continue_generation`, `/update_weight_version`,
`/update_weights_from_disk` (staged: control only, no tensors move), `/commit_staged_weights` (with
`abort_all_requests`, running requests answer `abort` first, as a pause would),
`/discard_staged_weights`, `/get_weight_version` and `/health`.

    python bench/_simfleet.py --servers N [--ttft-ms 0] [--token-ms 0] [--length uniform:1:64]

prints one JSON line, {"ports": [...]}, then takes commands on stdin, one JSON object a line, and
answers each with one JSON line: {"op": "kill"|"stop"|"cont", "index": I} (kill: the server closes
its port and drops its connections, as a SIGKILLed one; stop: it answers nothing and produces
nothing, as a SIGSTOPped one; cont: it goes on), {"op": "start", "count": K} (K new servers:
{"ports": [...]}), {"op": "latency", "ttft_ms": T, "token_ms": P} and {"op": "stats"} (request
counts over all servers, and each server's generation requests in flight). `SimFleetProcesses` is the driver's side: N servers over several such
processes, addressed by one index.

Generation is deterministic: each next token is `(last * 7 + 3) % 50000`, so a request resubmitted
with its partial output continues the same chain on any server. A request takes `ttft-ms` plus
`token-ms` per token, and produces a length drawn from `--length` (`fixed:N`, `uniform:A:B`,
`lognormal:MU:SIGMA`), cut at its `max_new_tokens` (then `length`, else `stop`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import select
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp import web

VOCAB = 50_000


def next_token(last: int) -> int:
    return (last * 7 + 3) % VOCAB


def chain(last: int, n: int) -> list[int]:
    """The `n` tokens the fleet produces after a sequence ending in `last`."""
    out = []
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


def length_sampler(spec: str, seed: int):
    """`fixed:N`, `uniform:A:B` or `lognormal:MU:SIGMA` -> a function drawing one length (>= 1)."""
    kind, *args = spec.split(":")
    rng = random.Random(seed)
    try:
        values = [float(a) for a in args]
        if kind == "fixed" and len(values) == 1:
            return lambda: max(1, int(values[0]))
        if kind == "uniform" and len(values) == 2:
            return lambda: rng.randint(max(1, int(values[0])), max(1, int(values[1])))
        if kind == "lognormal" and len(values) == 2:
            return lambda: max(1, round(rng.lognormvariate(values[0], values[1])))
    except ValueError:
        pass
    raise SystemExit(f"--length {spec!r}: use fixed:N, uniform:A:B or lognormal:MU:SIGMA")


class SimServer:
    """One simulated server: its app, version, pause state and whether it is stopped."""

    def __init__(self, fleet: SimFleet):
        self.fleet = fleet
        self.version = 0
        self.staged: int | None = None
        self.running = asyncio.Event()  # cleared while paused: new requests wait
        self.running.set()
        self.abort = asyncio.Event()  # set by a pause: running requests answer abort
        self.awake = asyncio.Event()  # cleared while stopped: nothing is answered or produced
        self.awake.set()
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.handling: set[asyncio.Task] = set()  # generation requests in flight

    async def start(self) -> int:
        app = web.Application(middlewares=[self._while_awake])
        app.router.add_post("/generate", self.generate)
        for path, handler in (("/pause_generation", self.pause), ("/continue_generation", self.cont),
                              ("/update_weight_version", self.set_version),
                              ("/update_weights_from_disk", self.load_disk), ("/commit_staged_weights", self.commit),
                              ("/discard_staged_weights", self.discard)):
            app.router.add_post(path, handler)
        app.router.add_get("/get_weight_version", self.get_version)
        app.router.add_get("/health", self.get_version)
        self.runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0, backlog=1024).start()
        self.port = self.runner.addresses[0][1]
        return self.port

    async def kill(self) -> None:
        """As a SIGKILL: requests in flight get no answer (their connections close), and the port
        refuses connections from now on."""
        if self.runner is not None:
            for task in list(self.handling):
                task.cancel()
            await self.runner.cleanup()
            self.runner = None

    @web.middleware
    async def _while_awake(self, request: web.Request, handler: Any) -> web.StreamResponse:
        await self.awake.wait()
        self.fleet.counts[request.path] += 1
        return await handler(request)

    # -- generation ---------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        task = asyncio.current_task()
        assert task is not None
        self.handling.add(task)
        try:
            return await self._generate(request)
        finally:
            self.handling.discard(task)

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        start = time.monotonic()
        budget = int(body.get("sampling_params", {}).get("max_new_tokens", 128))
        await self.running.wait()
        abort, fleet = self.abort, self.fleet
        want = min(budget, fleet.draw_length())
        version = self.version
        produced = want
        finish = "length" if want == budget else "stop"
        seconds = (fleet.ttft_s + fleet.token_s * want)
        if seconds > 0:
            try:
                await asyncio.wait_for(abort.wait(), seconds)
                produced = min(want, int((time.monotonic() - start - fleet.ttft_s) / fleet.token_s)
                               if fleet.token_s > 0 else 0)
                finish = "abort"
            except TimeoutError:
                pass
            while not self.awake.is_set():  # stopped mid-request: the answer waits for cont
                await self.awake.wait()
        ids = body.get("input_ids") or [0]
        out = chain(ids[-1], max(0, produced))
        fleet.counts["generate/" + finish] += 1
        if finish == "stop":
            reason: dict[str, Any] = {"type": "stop", "matched": out[-1]}
        elif finish == "length":
            reason = {"type": "length", "length": len(out)}
        else:
            reason = {"type": "abort", "message": "paused"}
        meta: dict[str, Any] = {"id": body.get("rid", ""), "prompt_tokens": len(ids), "completion_tokens": len(out),
                                "cached_tokens": 0, "weight_version": str(version), "finish_reason": reason,
                                "e2e_latency": time.monotonic() - start}
        if out:
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    # -- control ------------------------------------------------------------------------------------
    @staticmethod
    def _ok() -> web.Response:
        return web.json_response({"success": True, "message": ""})

    async def pause(self, request: web.Request) -> web.Response:
        self.running.clear()
        self.abort.set()
        self.abort = asyncio.Event()
        return self._ok()

    async def cont(self, request: web.Request) -> web.Response:
        self.running.set()
        return self._ok()

    async def set_version(self, request: web.Request) -> web.Response:
        self.version = int((await request.json())["new_version"])
        return self._ok()

    async def load_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        version = int(body.get("weight_version") or self.version)
        if body.get("commit", True) is False:
            self.staged = version
        else:
            self.version = version
        return self._ok()

    async def commit(self, request: web.Request) -> web.Response:
        if self.staged is None:
            return web.json_response({"success": False, "message": "nothing staged"}, status=400)
        body = await request.json()
        if body.get("abort_all_requests"):  # as a pause would, in the same step as the swap
            self.abort.set()
            self.abort = asyncio.Event()
        self.version, self.staged = int(body["weight_version"]), None
        return self._ok()

    async def discard(self, request: web.Request) -> web.Response:
        self.staged = None
        return self._ok()

    async def get_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.version)})


class SimFleet:
    def __init__(self, ttft_ms: float, token_ms: float, length: str, seed: int):
        self.ttft_s, self.token_s = ttft_ms / 1000, token_ms / 1000
        self.draw_length = length_sampler(length, seed)
        self.servers: list[SimServer] = []
        self.counts: Counter[str] = Counter()

    async def add(self, count: int) -> list[int]:
        new = [SimServer(self) for _ in range(count)]
        self.servers += new
        return [await s.start() for s in new]

    async def command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.get("op")
        if op == "start":
            return {"ports": await self.add(int(cmd["count"]))}
        if op == "stats":
            return {"counts": dict(self.counts), "active": [len(s.handling) for s in self.servers]}
        if op == "latency":
            self.ttft_s, self.token_s = float(cmd["ttft_ms"]) / 1000, float(cmd["token_ms"]) / 1000
            return {"ok": True}
        if op in ("kill", "stop", "cont"):
            server = self.servers[int(cmd["index"])]
            if op == "kill":
                await server.kill()
            elif op == "stop":
                server.awake.clear()
            else:
                server.awake.set()
            return {"ok": True}
        return {"error": f"unknown op {op!r}: use start, stats, latency, kill, stop or cont"}


async def serve(args: argparse.Namespace) -> None:
    fleet = SimFleet(args.ttft_ms, args.token_ms, args.length, args.seed)
    print(json.dumps({"ports": await fleet.add(args.servers)}), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():  # EOF: the driver is gone, and so is the fleet
        try:
            reply = await fleet.command(json.loads(line))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


class SimFleetProcesses:
    """`servers` simulated servers spread over `processes` host processes (this module run as a
    script); commands address a server by its index in `addresses`. Every wait is bounded."""

    def __init__(self, servers: int, processes: int = 1, ttft_ms: float = 0.0, token_ms: float = 0.0,
                 length: str = "uniform:1:64", start_timeout_s: float = 120.0):
        counts = [servers // processes + (i < servers % processes) for i in range(processes)]
        self.procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--servers", str(k),
                                        "--ttft-ms", str(ttft_ms), "--token-ms", str(token_ms),
                                        "--length", length, "--seed", str(i)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for i, k in enumerate(counts) if k > 0]
        self.where: list[tuple[int, int]] = []  # server index -> (process, index there)
        self.addresses: list[str] = []
        try:
            for p, proc in enumerate(self.procs):
                self._add(p, self._reply(proc, start_timeout_s)["ports"])
        except BaseException:
            self.close()
            raise

    def _add(self, p: int, ports: list[int]) -> list[str]:
        start = sum(1 for q, _ in self.where if q == p)
        self.where += [(p, start + i) for i in range(len(ports))]
        new = [f"http://127.0.0.1:{port}" for port in ports]
        self.addresses += new
        return new

    @staticmethod
    def _reply(proc: subprocess.Popen, timeout_s: float) -> dict[str, Any]:
        assert proc.stdout is not None
        if not select.select([proc.stdout], [], [], timeout_s)[0]:
            raise TimeoutError(f"a simulated fleet process said nothing within {timeout_s:g} s")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a simulated fleet process exited (code {proc.wait(5)})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the simulated fleet refused a command: {reply['error']}")
        return reply

    def _send(self, p: int, cmd: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
        proc = self.procs[p]
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(cmd) + "\n")
        proc.stdin.flush()
        return self._reply(proc, timeout_s)

    def command(self, op: str, index: int) -> None:
        """`kill`, `stop` or `cont` server `index`."""
        p, local = self.where[index]
        self._send(p, {"op": op, "index": local})

    def start(self, count: int) -> list[str]:
        """`count` new servers (in the first process); -> their addresses."""
        return self._add(0, self._send(0, {"op": "start", "count": count})["ports"])

    def latency(self, ttft_ms: float, token_ms: float) -> None:
        for p in range(len(self.procs)):
            self._send(p, {"op": "latency", "ttft_ms": ttft_ms, "token_ms": token_ms})

    def counts(self) -> tuple[Counter[str], list[int]]:
        """Requests answered by route (and `generate/<finish>`) over all processes, and the
        generation requests each server has in flight (in `addresses`' order)."""
        total: Counter[str] = Counter()
        per_process = []
        for p in range(len(self.procs)):
            stats = self._send(p, {"op": "stats"})
            total.update(stats["counts"])
            per_process.append(stats["active"])
        return total, [per_process[p][i] for p, i in self.where]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def __enter__(self) -> SimFleetProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, required=True)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--token-ms", type=float, default=0.0)
    p.add_argument("--length", default="uniform:1:64")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a port and its connections per server
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
