"""How the bytes of a weight update travel: `disk`, `broadcast` (the `distributed` update type)
and `shared_memory` (`shm`), each a `Transport` owning its buffers and in-flight state."""

from __future__ import annotations

from tandem.fleet.interface import Fleet
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.source import WeightSource
from tandem.weights.transports.base import Transport, TransportOptions
from tandem.weights.transports.broadcast import BroadcastTransport
from tandem.weights.transports.disk import DiskTransport
from tandem.weights.transports.shared_memory import SharedMemoryTransport

_TRANSPORTS: dict[str, type[Transport]] = {
    "disk": DiskTransport, "distributed": BroadcastTransport, "shm": SharedMemoryTransport}


def make_transport(meta: WeightUpdateMeta, source: WeightSource, fleet: Fleet | None, rank: int, world_size: int,
                   options: TransportOptions) -> Transport:
    return _TRANSPORTS[meta.type](source, fleet, rank, world_size, options)


__all__ = ["Transport", "TransportOptions", "make_transport"]
