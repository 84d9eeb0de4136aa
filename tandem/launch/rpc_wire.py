"""The RPC wire format between the controller and worker processes (`rpc.py`, `rpc_server.py`).

A message is a header frame (the out-of-band buffer sizes, then pickle protocol 5) followed by one
raw frame per tensor: CPU tensors travel as out-of-band buffers, never through JSON and never
through `torch.save`, and are received straight into the buffers the new tensors are built on
(`Channel`). CUDA tensors are copied to the CPU on the way; a view sends only its elements.

A request is `(call_id, method, args, kwargs)`; a reply `(call_id, OK, value)` or `(call_id, ERR,
Failure)`.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import socket
import struct
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

OK, ERR = "ok", "error"


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.layout == torch.strided and not obj.is_quantized:
            return _reduce_tensor(obj)
        return NotImplemented


def _reduce_tensor(t: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    requires_grad = t.requires_grad
    flat = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    data: Any = pickle.PickleBuffer(flat.view(torch.uint8).numpy()) if flat.numel() else b""
    return _rebuild_tensor, (data, t.dtype, tuple(t.shape), requires_grad)


def _rebuild_tensor(data: Any, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool) -> torch.Tensor:
    if memoryview(data).nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:  # shares memory with the received buffer (a bytearray, so the tensor is writable)
        t = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
    return t.requires_grad_(requires_grad) if requires_grad else t


def dumps(obj: Any) -> list[Any]:
    """Frames of one message: header (buffer sizes + pickle) then each out-of-band buffer."""
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
    raws = [b.raw() for b in buffers]
    header = struct.pack(f"<I{len(raws)}Q", len(raws), *(r.nbytes for r in raws)) + f.getvalue()
    return [header, *raws]


class Channel:
    """One end of a message connection: a `multiprocessing.connection.Connection` for headers
    (length-prefixed frames) plus a duplicate of its socket for the raw tensor bytes, which are
    received straight into their final buffers (no intermediate copies)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))
        self.sock.setblocking(True)
        if self.sock.family in (socket.AF_INET, socket.AF_INET6):
            # A message is several writes (length, header, tensor frames) and then a read: with
            # Nagle on, each later write waits for the peer's delayed ACK (~40 ms per call).
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def fileno(self) -> int:
        return self.conn.fileno()

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def send(self, frames: Sequence[Any]) -> None:
        self.conn.send_bytes(frames[0])
        for raw in frames[1:]:
            self.sock.sendall(raw)

    def recv(self) -> Any:
        header = self.conn.recv_bytes()
        (n,) = struct.unpack_from("<I", header)
        sizes = struct.unpack_from(f"<{n}Q", header, 4)
        buffers = []
        for size in sizes:
            buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                k = self.sock.recv_into(view[got:], min(size - got, 1 << 24))
                if k == 0:
                    raise EOFError("connection closed in the middle of a message")
                got += k
            buffers.append(buf)
        return pickle.loads(memoryview(header)[4 + 8 * n:], buffers=buffers)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(OSError):
            self.conn.close()


def frames_nbytes(frames: Sequence[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


@dataclass
class Failure:
    """A reply's error: what the worker raised, formatted, and pickled when it pickles."""

    exc_type: str
    message: str
    traceback: str
    exc: bytes | None  # the pickled exception, when it pickles


def failure_of(exc: BaseException) -> Failure:
    """The `Failure` a reply carries for `exc`."""
    try:
        pickled: bytes | None = pickle.dumps(exc, protocol=5)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Failure(f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb, pickled)

