"""`HealthMonitor`: probes every server of a `Membership` on a timer and reports what it saw.

Every `interval_s` (from the start of a round) it sends `GET <address><health_path>` to every
server the membership wants probed, at once, each bounded by `timeout_s`: a 200 is `probe_ok`
(with the body's `weight_version`, if any), anything else `probe_failed`. The probes run on their
own thread and event loop; `stop()` returns at once; `on_round` runs after each round. See
docs/fleet.md, "Elastic membership"."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.aio import new_event_loop
from tandem.config.fields import config_field as _f
from tandem.fleet.control_http import ControlClient, Unreachable
from tandem.fleet.generation import parse_version
from tandem.rollout.membership import Membership

logger = logging.getLogger(__name__)


@dataclass
class HealthConfig:
    interval_s: float = _f(5.0, "Probe every server this often.", gt=0.0)
    timeout_s: float = _f(2.0, "Timeout of one probe.", gt=0.0)
    failure_threshold: int = _f(3, "Failed probes in a row that evict a server.", min=1)


class HealthMonitor:
    def __init__(self, membership: Membership, config: HealthConfig, api_key: str | None = None,
                 health_path: str = "/health", on_round: Callable[[], None] | None = None):
        self.membership, self.config, self.health_path, self.on_round = membership, config, health_path, on_round
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._loop = new_event_loop()
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._client: ControlClient | None = None  # made on the monitor's loop, at its first probe

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),),
                                        name="tandem-health", daemon=True)
        self._thread.start()

    def probe_once(self) -> None:
        """One round now, from the calling thread (before `start`, or in tests)."""
        if self._thread is not None:
            raise RuntimeError("probe_once is for a monitor that is not started")
        self._loop.run_until_complete(self._round())

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            if self._stop is not None:
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)
        else:
            self._loop.run_until_complete(self._close_client())
        if not self._loop.is_closed() and not (self._thread and self._thread.is_alive()):
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        try:
            while not self._stop.is_set():
                began = self._loop.time()
                await self._round()
                left = self.config.interval_s - (self._loop.time() - began)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), max(0.0, left))
        finally:
            await self._close_client()

    async def _round(self) -> None:
        try:
            targets = self.membership.probe_targets()
            await asyncio.gather(*(self._probe(a) for a in targets))
            if self.on_round is not None:
                self.on_round()
        except Exception:  # the monitor never dies of a bug in a callback
            logger.exception("a health round failed")

    async def _probe(self, address: str) -> None:
        if self._client is None:
            self._client = ControlClient(self._headers)
        what = f"GET {self.health_path}"
        timeout = self.config.timeout_s
        sent_at = self.membership.now()
        try:
            reply = await self._client.request("GET", address, self.health_path, timeout=timeout)
        except TimeoutError:
            self.membership.probe_failed(address, f"{what}: no answer within {timeout:g}s")
            return
        except Unreachable as exc:
            self.membership.probe_failed(address, f"{what}: unreachable: {exc}")
            return
        if reply.status != 200:
            self.membership.probe_failed(address, f"{what}: HTTP {reply.status} {reply.text()[:200]}")
            return
        self.membership.probe_ok(address, _version_in(reply.body), sent_at)

    async def _close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _version_in(data: bytes) -> int | None:
    try:
        body: Any = json.loads(data) if data else None
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("weight_version") is None:
        return None
    try:
        return parse_version(body["weight_version"])
    except (TypeError, ValueError):
        return None
