"""`HttpFleet`: the `Fleet` interface over HTTP, straight to a list of `tandem serve` addresses.

Every call fans out to all servers at once from one background event-loop thread (aiohttp, one
session, no polling) and collects one `ServerResult` per server; a call succeeds when every server
said so, else `FleetError` names the phase and each failing server with what it answered (HTTP
status and message), that it could not be reached, or that it did not answer in time. Each call's
timeout comes from `Deadlines`: `http_s` for control calls (pause, continue, version, commit,
discard, destroy), `init_group_s` for joining the group, `bucket_s` for one bucket and
`update_s` for a disk load or checksums.

Staged transfers, commit/discard, `timeout_s` on group creation, the shm route and checksums are
tandem-serve extensions of the SGLang protocol (see docs/weight-sync.md).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import aiohttp

from tandem.aio import new_event_loop
from tandem.weights.fleet import FleetError, FleetResult, ServerChecksums, ServerResult
from tandem.weights.meta import Deadlines, FlatLayout, ParamSpec, ShmBucket, WeightUpdateMeta


class HttpFleet:
    supports_flat_buckets = True  # one broadcast per bucket (`flat`), see Fleet

    def __init__(self, addresses: Sequence[str], *, api_key: str | None = None,
                 deadlines: Deadlines | None = None):
        if not addresses:
            raise ValueError("HttpFleet needs at least one server address")
        self.addresses = [a.rstrip("/") if "://" in a else f"http://{a.rstrip('/')}" for a in addresses]
        self.deadlines = deadlines or Deadlines()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._loop = new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-fleet", daemon=True)
        self._thread.start()
        self._closed = False
        # The version every server echoes, as far as this fleet knows: set by a commit or
        # `set_version` that every server acknowledged, forgotten on any other call.
        self._known_version: str | None = None

    # ------------------------------------------------------------------ plumbing
    def _submit(self, coro) -> Future:
        if self._closed:
            coro.close()
            raise RuntimeError("this HttpFleet is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _post(self, address: str, path: str, body: dict[str, Any], timeout: float) -> tuple[ServerResult, Any]:
        if self._session is None:
            # Kept-alive connections (`tandem serve` sets TCP_NODELAY on accepted sockets, so a
            # reply is not held back by Nagle + delayed ACK); no per-host limit: calls fan out.
            self._session = aiohttp.ClientSession(headers=self._headers, connector=aiohttp.TCPConnector(limit=0))
        try:
            async with self._session.post(address + path, json=body,
                                          timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                text = await resp.text()
                try:
                    data = json.loads(text) if text else None
                except ValueError:
                    data = None
                ok = resp.status == 200 and not (isinstance(data, dict) and data.get("success") is False)
                message = data.get("message", "") if isinstance(data, dict) else text[:300]
                if not ok:
                    message = f"HTTP {resp.status}: {message or text[:300]}"
                return ServerResult(address, ok, str(message)), data
        except TimeoutError:
            return ServerResult(address, False, f"no answer within {timeout:.1f}s"), None
        except aiohttp.ClientError as exc:
            return ServerResult(address, False, f"unreachable: {type(exc).__name__}: {exc}"), None

    async def _fanout(self, phase: str, path: str, bodies: Sequence[dict[str, Any]], timeout: float,
                      raise_failures: bool = True) -> tuple[FleetResult, list[Any]]:
        answers = await asyncio.gather(*(self._post(a, path, b, timeout)
                                         for a, b in zip(self.addresses, bodies, strict=True)))
        result = FleetResult(phase, tuple(r for r, _ in answers))
        if raise_failures:
            result.raise_for_failures()
        return result, [d for _, d in answers]

    def _async(self, phase: str, path: str, body: dict[str, Any] | Sequence[dict[str, Any]],
               timeout: float) -> Future[FleetResult]:
        bodies = body if isinstance(body, list) else [body] * len(self.addresses)
        self._known_version = None  # whatever this call does, the version is known again only after it

        async def run() -> FleetResult:
            return (await self._fanout(phase, path, bodies, timeout))[0]

        return self._submit(run())

    def _sync(self, phase: str, path: str, body: dict[str, Any], timeout: float) -> FleetResult:
        # The HTTP timeout bounds each call; the margin only guards against a stuck event loop.
        return self._async(phase, path, body, timeout).result(timeout + 10)

    # ------------------------------------------------------------------ Fleet
    @property
    def world_size(self) -> int:
        return len(self.addresses)

    def pause_generation(self) -> FleetResult:
        return self._sync("pause_generation", "/pause_generation", {"mode": "abort"}, self.deadlines.http_s)

    def continue_generation(self) -> FleetResult:
        return self._sync("continue_generation", "/continue_generation", {}, self.deadlines.http_s)

    def set_version(self, version: int) -> FleetResult:
        """Every server echoes `version` from now on. Right after a commit to that version (which
        set it on every server together with the weights) nothing is sent."""
        if self._known_version == str(version):
            return FleetResult("update_weight_version", tuple(
                ServerResult(a, True, f"weight version is already {version}") for a in self.addresses))
        result = self._sync("update_weight_version", "/update_weight_version", {"new_version": str(version)},
                            self.deadlines.http_s)
        self._known_version = str(version)  # reached only when every server acknowledged
        return result

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[FleetResult]:
        d = self.deadlines
        bodies = [{"master_address": meta.master_address, "master_port": meta.master_port, "rank_offset": 1 + i,
                   "world_size": 1 + self.world_size, "group_name": meta.group_name, "backend": meta.backend,
                   "timeout_s": max(d.init_group_s, d.bucket_s)} for i in range(len(self.addresses))]
        return self._async("init_weights_update_group", "/init_weights_update_group", bodies, d.init_group_s)

    def destroy_weights_update_group(self, meta: WeightUpdateMeta) -> FleetResult:
        return self._sync("destroy_weights_update_group", "/destroy_weights_update_group",
                          {"group_name": meta.group_name}, self.deadlines.http_s)

    @staticmethod
    def _bucket_fields(meta: WeightUpdateMeta, specs: Sequence[ParamSpec], commit: bool,
                       bucket_index: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {"names": [s.name for s in specs], "dtypes": [s.dtype for s in specs],
                                "shapes": [list(s.shape) for s in specs], "flush_cache": True, "commit": commit}
        if bucket_index is not None:
            body["bucket_index"] = bucket_index
        if commit:
            body["weight_version"] = meta.version_name
        return body

    @staticmethod
    def _bucket_phase(route: str, bucket_index: int | None) -> str:
        return route if bucket_index is None else f"{route} (bucket {bucket_index})"

    def update_weights_from_distributed(self, meta: WeightUpdateMeta, specs: Sequence[ParamSpec], *,
                                        commit: bool = True, bucket_index: int | None = None,
                                        flat: FlatLayout | None = None) -> Future[FleetResult]:
        body = {**self._bucket_fields(meta, specs, commit, bucket_index), "group_name": meta.group_name}
        if flat is not None:
            body.update(offsets=list(flat.offsets), nbytes=flat.nbytes)
        return self._async(self._bucket_phase("update_weights_from_distributed", bucket_index),
                           "/update_weights_from_distributed", body, self.deadlines.bucket_s)

    def update_weights_from_shm(self, meta: WeightUpdateMeta, bucket: ShmBucket, *, commit: bool = True,
                                bucket_index: int | None = None) -> Future[FleetResult]:
        body = {**self._bucket_fields(meta, bucket.specs, commit, bucket_index), "offsets": list(bucket.offsets),
                "nbytes": bucket.nbytes}
        body.update({"segment": bucket.segment} if bucket.segment is not None else {"cuda_ipc": bucket.cuda_ipc})
        if bucket.zero_copy:
            body["zero_copy"] = True
        return self._async(self._bucket_phase("update_weights_from_shm", bucket_index), "/update_weights_from_shm",
                           body, self.deadlines.bucket_s)

    def update_weights_from_disk(self, meta: WeightUpdateMeta, *, commit: bool = True) -> Future[FleetResult]:
        body: dict[str, Any] = {"model_path": str(meta.versioned_path()), "commit": commit}
        if commit:
            body["weight_version"] = meta.version_name
        return self._async("update_weights_from_disk", "/update_weights_from_disk", body, self.deadlines.update_s)

    def commit_weights(self, meta: WeightUpdateMeta) -> FleetResult:
        result = self._sync("commit_staged_weights", "/commit_staged_weights", {"weight_version": meta.version_name},
                            max(self.deadlines.http_s, self.deadlines.bucket_s))
        self._known_version = meta.version_name  # reached only when every server committed
        return result

    def discard_weights(self, meta: WeightUpdateMeta) -> FleetResult:
        return self._sync("discard_staged_weights", "/discard_staged_weights", {}, self.deadlines.http_s)

    def weight_checksums(self, names: Sequence[str] | None = None) -> dict[str, ServerChecksums]:
        body = {} if names is None else {"names": list(names)}
        timeout = self.deadlines.update_s

        async def run():
            return await self._fanout("get_weights_checksum", "/get_weights_checksum",
                                      [body] * len(self.addresses), timeout)

        _, data = self._submit(run()).result(timeout + 10)
        return {a: ServerChecksums(d["dtype"], d["checksums"], d.get("weight_version", ""))
                for a, d in zip(self.addresses, data, strict=True)}

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._closed:
            return

        async def shutdown() -> None:
            if self._session is not None:
                await self._session.close()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> HttpFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["FleetError", "HttpFleet"]
