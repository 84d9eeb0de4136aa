"""Helpers for tests of `tandem serve`: a real server subprocess, and small HTTP clients."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

LISTENING = re.compile(r"tandem serve: listening on (http://\S+)")


class ServerProcess:
    """`tandem serve --port 0 ...` in a subprocess behind `tandem.launch.guard`, as the product
    starts its servers: it dies with the test process even when that is SIGKILLed (a pytest worker
    killed by a timeout or a Ctrl-C left its module servers running, one found 28 min later).

    `url` is set once /health answers 200 (with `wait_healthy=False`: once the listening line is
    printed); with `wait=False` the constructor only starts the process and `wait_ready` waits.
    The guard's signal fires when the *thread* that started the server ends, so servers are
    started on the main thread; to start several at once, start each with `wait=False`."""

    def __init__(self, model: Path, log_dir: Path, *extra: str, api_key: str | None = None, timeout: float = 60,
                 env: dict[str, str] | None = None, wait_healthy: bool = True, wait: bool = True):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("start ServerProcess on the main thread: its guard would kill the server when this "
                               "thread ends; start it with wait=False and call wait_ready() from the thread instead")
        self.log = log_dir / f"serve-{os.getpid()}-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "tandem.launch.guard", str(os.getpid()), "--",
               sys.executable, "-m", "tandem.cli", "serve", "--model", str(model), "--port", "0",
               "--num-threads", "1", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.pid = self.proc.pid  # the guard execs the server: one process
        self.api_key = api_key
        self.url = ""
        if wait:
            self.wait_ready(timeout, healthy=wait_healthy)

    def wait_ready(self, timeout: float = 60, healthy: bool = True) -> ServerProcess:
        """Wait for the listening line (then, with `healthy`, for /health to answer 200)."""
        self.url = self._wait_url(timeout)
        if healthy:
            self._wait_healthy(timeout)
        return self

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (m := LISTENING.search(self.log.read_text())) is not None:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log.read_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"no listening line in {timeout}s:\n{self.log.read_text()}")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, _ = request(self.url, "GET", "/health")
            if status == 200:
                return
            time.sleep(0.1)
        raise TimeoutError(f"server not healthy in {timeout}s:\n{self.log.read_text()}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return request(self.url, "GET", path, headers=self.headers(), **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return request(self.url, "POST", path, body, headers=self.headers(), **kw)

    def ok(self, path: str, body: Any = None, method: str = "POST", timeout: float = 60) -> Any:
        status, data = request(self.url, method, path, body, headers=self.headers(), timeout=timeout)
        assert status == 200, (path, status, data)
        return data

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode


def request(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
            raw: bytes | None = None, timeout: float = 60) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, payload = err.code, err.read()
    except (urllib.error.URLError, ConnectionError):
        return 0, None
    try:
        return status, json.loads(payload) if payload else None
    except ValueError:
        return status, payload.decode()


def sse_events(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> list[Any]:
    """POST and collect the `data:` events of an SSE stream (the last one must be [DONE])."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    events = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_for(predicate, timeout: float = 30, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    raise TimeoutError("condition not reached")
