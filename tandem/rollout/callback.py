"""`RolloutCallback`: the trainer workers' `Fleet`, reached through the rollout controller.

Every operation, `topology()` and `admit()` go to the controller's callback routes with the run's
secret; the controller runs them on its own fleet. Deadlines and capabilities come from the
controller (read once), so the controller's per-server timeouts fire first. Failures raise
`FleetError` naming the phase and each failing server, or the controller itself. A callback is two
strings: pickle it into a worker process, or pass `callback.env()` and rebuild it there with
`RolloutCallback.from_env()`. See docs/rollout.md, "Controller and callbacks"."""

from __future__ import annotations

import http.client
import json
import os
import select
import threading
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn

from tandem.fleet.adapters import Capabilities
from tandem.fleet.interface import MARGIN_S, Topology
from tandem.fleet.ops import Deadlines, FleetOp
from tandem.fleet.results import FleetError, FleetResult, ServerResult
from tandem.fleet.wire import WireError, from_json, to_json

ENV_ADDRESS = "TANDEM_ROLLOUT_CALLBACK_ADDRESS"
ENV_SECRET = "TANDEM_ROLLOUT_CALLBACK_SECRET"


class RolloutCallback:
    def __init__(self, address: str, secret: str, control_timeout_s: float = 60.0):
        self.address = address.rstrip("/")
        self.secret = secret
        self.control_timeout_s = control_timeout_s
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._info: dict[str, Any] | None = None
        # One kept-alive connection per calling thread: a weight update makes ~6 calls a step, and
        # a new TCP connection each cost ~0.2 ms more a call (connect, and the server's accept).
        self._local = threading.local()
        self._connections: list[http.client.HTTPConnection] = []
        self._url = urllib.parse.urlsplit(self.address)

    # -- construction in another process ------------------------------------------------------------
    def env(self) -> dict[str, str]:
        return {ENV_ADDRESS: self.address, ENV_SECRET: self.secret}

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RolloutCallback:
        environ = os.environ if environ is None else environ
        try:
            return cls(environ[ENV_ADDRESS], environ[ENV_SECRET])
        except KeyError as exc:
            raise RuntimeError(f"{exc.args[0]} is not set: the rollout controller passes it to trainer workers") from None

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "secret": self.secret, "control_timeout_s": self.control_timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return f"RolloutCallback({self.address!r})"  # never the secret

    # -- Fleet ------------------------------------------------------------------------------------
    def send(self, op: FleetOp, request: Any, targets: Sequence[str] | None = None) -> Future[FleetResult]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="rollout-callback")
            pool = self._pool
        return pool.submit(self._call, op, request, None if targets is None else list(targets))

    def topology(self) -> Topology:
        status, data = self._request("GET", "/fleet/topology", None, self.control_timeout_s)
        if status != 200 or not isinstance(data, dict):
            self._raise("topology", status, data)
        try:
            return from_json(Topology, data)
        except WireError as exc:
            self._raise("topology", status, f"malformed answer: {exc}")

    def admit(self, addresses: Sequence[str], version: int) -> None:
        body = {"addresses": list(addresses), "version": version}
        status, data = self._request("POST", "/fleet/admit", body, self.control_timeout_s)
        if status != 200:
            self._raise("admit", status, data)

    @property
    def world_size(self) -> int:
        return int(self.info(refresh=True)["world_size"])

    @property
    def capabilities(self) -> Capabilities:
        return from_json(Capabilities, self.info()["capabilities"])

    @property
    def deadlines(self) -> Deadlines:
        """The controller's fleet deadlines; while it cannot be reached, `control_timeout_s` for
        every phase (the call itself then reports the unreachable controller)."""
        try:
            return from_json(Deadlines, self.info()["deadlines"])
        except FleetError:
            t = self.control_timeout_s
            return Deadlines(init_group_s=t, bucket_s=t, update_s=t, http_s=t)

    def info(self, refresh: bool = False) -> dict[str, Any]:
        """The controller's view: servers and their health, world size, version, capabilities and
        the fleet's deadlines (fetched once unless `refresh`)."""
        with self._lock:
            if self._info is not None and not refresh:
                return self._info
        status, data = self._request("GET", "/fleet/info", None, self.control_timeout_s)
        if status != 200 or not isinstance(data, dict):
            self._raise("info", status, data)
        with self._lock:
            self._info = data
        return data

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            connections, self._connections = self._connections, []
        if pool is not None:
            pool.shutdown(wait=False)
        for conn in connections:
            conn.close()

    # -- mechanics --------------------------------------------------------------------------------
    def _call(self, op: FleetOp, request: Any, targets: list[str] | None) -> FleetResult:
        timeout = self.deadlines.seconds(op.deadline)
        body = {"request": to_json(request), "targets": targets}
        status, data = self._request("POST", f"/fleet/{op.name}", body, timeout + MARGIN_S)
        if status != 200 or not isinstance(data, dict):
            self._raise(op.name, status, data)
        try:
            result = from_json(FleetResult, data)
            results = tuple(ServerResult(r.address, r.success, r.message,
                                         from_json(op.answer, r.value) if r.success else None, r.no_answer)
                            for r in result.results)
        except WireError as exc:
            self._raise(op.name, status, f"malformed answer: {exc}")
        return FleetResult(result.phase, results).raise_for_failures()

    def _raise(self, phase: str, status: int, data: Any) -> NoReturn:
        if status == 0:
            why = f"controller unreachable: {data}"
        elif status == 401:
            why = "the controller rejected the callback secret (401)"
        else:
            why = f"controller answered {status}: {data}"
        raise FleetError(phase, [ServerResult(self.address, False, why)])

    def _request(self, method: str, path: str, body: Any, timeout: float) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.secret}"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        conn = self._connection(timeout)
        try:
            conn.request(method, self._url.path + path, body=data, headers=headers)
            resp = conn.getresponse()
            status, payload = resp.status, resp.read()
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out
            conn.close()  # the next call connects afresh
            return 0, f"{type(exc).__name__}: {exc}"
        if resp.will_close:
            conn.close()
        try:
            return status, json.loads(payload) if payload else None
        except ValueError:
            return status, payload.decode(errors="replace")[:500]

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        """This thread's connection to the controller, with `timeout` for the next call. One the
        controller closed while it sat idle (its socket reads EOF) is replaced before use, so a
        call is never sent on a connection already gone, and never sent twice."""
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None and select.select([conn.sock], [], [], 0)[0]:
            conn.close()  # idle, so anything readable is the server's close (or junk): reconnect
        if conn is None:
            if self._url.scheme != "http" or not self._url.hostname:
                raise ValueError(f"the rollout callback address must be http://host:port, got {self.address!r}")
            conn = http.client.HTTPConnection(self._url.hostname, self._url.port or 80, timeout=timeout)
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn
