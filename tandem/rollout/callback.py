"""`RolloutCallback`: the trainer workers' `Fleet`, reached through the rollout controller.

Every operation, `topology()` and `admit()` go to the controller's callback routes with the run's
secret; the controller runs them on its own fleet. Deadlines and capabilities come from the
controller (read once), so the controller's per-server timeouts fire first. Failures raise
`FleetError` naming the phase and each failing server, or the controller itself. A callback is two
strings: pickle it into a worker process, or pass `callback.env()` and rebuild it there with
`RolloutCallback.from_env()`. See docs/rollout.md, "Controller and callbacks"."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
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
        if pool is not None:
            pool.shutdown(wait=False)

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
        req = urllib.request.Request(
            self.address + path, data=data, method=method,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.secret}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, payload = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, payload = err.code, err.read()
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            return 0, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        try:
            return status, json.loads(payload) if payload else None
        except ValueError:
            return status, payload.decode(errors="replace")[:500]
