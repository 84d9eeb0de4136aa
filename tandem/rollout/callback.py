"""`RolloutCallback`: the trainer workers' handle on the fleet, through the rollout controller.

It implements `tandem.weights.fleet.Fleet` by POSTing each call to the controller's callback server
(`RolloutController.callback_address()`, authenticated with the run's secret); the controller runs
it on its `HttpFleet` (every server it knows) and answers with the per-server results. Trainer code
cannot tell it from a direct `HttpFleet`.

Calls the trainer overlaps with its own collectives (forming the group, a bucket's transfer, a disk
load) return a `concurrent.futures.Future` right away; the others block. Every call succeeds as a
whole or raises `FleetError` naming the phase and each failing server (or the controller, when the
controller itself could not be reached or refused the secret).

A callback is two strings: pickle it into a worker process, or pass `callback.env()` and rebuild it
there with `RolloutCallback.from_env()`. The request bodies are `tandem.rollout.fleet_wire`'s, the
same module the controller decodes them with.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn

from tandem.rollout.fleet_wire import (  # noqa: F401  (re-exported: the wire forms' old home)
    bucket_from_json,
    bucket_to_json,
    checksums_from_json,
    encode_call,
    meta_from_json,
    meta_to_json,
    result_from_json,
    result_to_json,
    spec_from_json,
    spec_to_json,
)
from tandem.weights.fleet import FleetError, FleetResult, ServerChecksums, ServerResult
from tandem.weights.meta import FlatLayout, ParamSpec, ShmBucket, WeightUpdateMeta

ENV_ADDRESS = "TANDEM_ROLLOUT_CALLBACK_ADDRESS"
ENV_SECRET = "TANDEM_ROLLOUT_CALLBACK_SECRET"
# Extra seconds the callback gives the controller beyond the fleet's own deadline, so that the
# controller's per-server timeout (which names the server) fires first.
MARGIN_S = 10.0


class RolloutCallback:
    def __init__(self, address: str, secret: str, control_timeout_s: float = 60.0):
        self.address = address.rstrip("/")
        self.secret = secret
        self.control_timeout_s = control_timeout_s
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._deadlines: dict[str, float] | None = None

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
    # The controller forwards to `HttpFleet`, which sends each flat bucket as one broadcast.
    supports_flat_buckets = True

    def pause_generation(self) -> FleetResult:
        return self._call("pause_generation", {}, self._deadline("http_s"))

    def continue_generation(self) -> FleetResult:
        return self._call("continue_generation", {}, self._deadline("http_s"))

    def set_version(self, version: int) -> FleetResult:
        return self._call("set_version", encode_call("set_version", version=version), self._deadline("http_s"))

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[FleetResult]:
        return self._async("init_weights_update_group", encode_call("init_weights_update_group", meta=meta),
                           self._deadline("init_group_s"))

    def update_weights_from_distributed(self, meta: WeightUpdateMeta, specs: Sequence[ParamSpec], *,
                                        commit: bool = True, bucket_index: int | None = None,
                                        flat: FlatLayout | None = None) -> Future[FleetResult]:
        body = encode_call("update_weights_from_distributed", meta=meta, specs=specs, commit=commit,
                           bucket_index=bucket_index, flat=flat)
        return self._async("update_weights_from_distributed", body, self._deadline("bucket_s"))

    def update_weights_from_shm(self, meta: WeightUpdateMeta, bucket: ShmBucket, *, commit: bool = True,
                                bucket_index: int | None = None) -> Future[FleetResult]:
        body = encode_call("update_weights_from_shm", meta=meta, bucket=bucket, commit=commit,
                           bucket_index=bucket_index)
        return self._async("update_weights_from_shm", body, self._deadline("bucket_s"))

    def destroy_weights_update_group(self, meta: WeightUpdateMeta) -> FleetResult:
        return self._call("destroy_weights_update_group", encode_call("destroy_weights_update_group", meta=meta),
                          self._deadline("http_s"))

    def update_weights_from_disk(self, meta: WeightUpdateMeta, *, commit: bool = True) -> Future[FleetResult]:
        body = encode_call("update_weights_from_disk", meta=meta, commit=commit)
        return self._async("update_weights_from_disk", body, self._deadline("update_s"))

    def commit_weights(self, meta: WeightUpdateMeta) -> FleetResult:
        return self._call("commit_weights", encode_call("commit_weights", meta=meta),
                          max(self._deadline("http_s"), self._deadline("bucket_s")))

    def discard_weights(self, meta: WeightUpdateMeta) -> FleetResult:
        return self._call("discard_weights", encode_call("discard_weights", meta=meta), self._deadline("http_s"))

    def weight_checksums(self, names: Sequence[str] | None = None) -> dict[str, ServerChecksums]:
        body = encode_call("weight_checksums", names=names)
        status, data = self._request("POST", "/fleet/weight_checksums", body, self._deadline("update_s") + MARGIN_S)
        if status == 200 and isinstance(data, dict) and "checksums" in data:
            return checksums_from_json(data["checksums"])
        self._raise("weight_checksums", status, data)

    @property
    def world_size(self) -> int:
        return int(self.info()["world_size"])

    def info(self) -> dict[str, Any]:
        """The controller's view: servers and their health, world size, version, fleet deadlines."""
        status, data = self._request("GET", "/fleet/info", None, self.control_timeout_s)
        if status != 200 or not isinstance(data, dict):
            self._raise("info", status, data)
        with self._lock:
            self._deadlines = data.get("deadlines", self._deadlines)
        return data

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    # -- mechanics --------------------------------------------------------------------------------
    def _async(self, phase: str, body: dict[str, Any], timeout: float) -> Future[FleetResult]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="rollout-callback")
            pool = self._pool
        return pool.submit(self._call, phase, body, timeout)

    def _deadline(self, name: str) -> float:
        """The controller fleet's deadline `name` (fetched once), so this side never gives up first."""
        if self._deadlines is None:
            with contextlib.suppress(FleetError):  # the call itself reports an unreachable controller
                self.info()
        return float((self._deadlines or {}).get(name, self.control_timeout_s))

    def _call(self, phase: str, body: dict[str, Any], timeout: float) -> FleetResult:
        status, data = self._request("POST", f"/fleet/{phase}", body, timeout + MARGIN_S)
        if status == 200 and isinstance(data, dict) and "results" in data:
            return result_from_json(data).raise_for_failures()
        self._raise(phase, status, data)

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
