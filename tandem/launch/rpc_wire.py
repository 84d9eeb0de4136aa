"""The RPC wire format between the controller and worker processes (`rpc.py`, `rpc_server.py`).

A message is a header frame (the out-of-band buffer sizes, then pickle protocol 5) followed by the
raw bytes of each tensor: CPU tensors travel as out-of-band buffers, never through JSON and never
through `torch.save`, and are received straight into the buffers the new tensors are built on
(`Channel`). On the socket, consecutive small buffers go as one write (each at a 64-byte aligned
offset of it) and are received as one, so a batch of many short sequences costs a few system calls
rather than two per tensor. CUDA tensors are copied to the CPU on the way; a view sends only its
elements.

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
    """Tensors as out-of-band buffers; a type with `__wire_reduce__` (a batch of many small
    tensors packs them) reduces with it on this wire only."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.layout == torch.strided and not obj.is_quantized:
            return _reduce_tensor(obj)
        wire = getattr(type(obj), "__wire_reduce__", None)
        if wire is not None:
            return wire(obj)
        return NotImplemented


def _reduce_tensor(t: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    requires_grad = t.requires_grad
    if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        flat = t.detach().view(-1)  # the common case, without four no-op calls per tensor
    else:
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
        raws = frames[1:]
        sizes = [memoryview(r).nbytes for r in raws]
        for run in _runs(sizes):
            if len(run) == 1:
                self.sock.sendall(raws[run[0][0]])
                continue
            last, end = run[-1]
            packed = bytearray(end + sizes[last])
            for i, offset in run:
                packed[offset:offset + sizes[i]] = memoryview(raws[i]).cast("B")
            self.sock.sendall(packed)

    def recv(self) -> Any:
        header = self.conn.recv_bytes()
        (n,) = struct.unpack_from("<I", header)
        sizes = struct.unpack_from(f"<{n}Q", header, 4)
        buffers: list[Any] = []
        for run in _runs(sizes):
            last, offset = run[-1]
            packed = self._recv_exactly(offset + sizes[last])
            if len(run) == 1:
                buffers.append(packed)
            else:  # views of one received buffer (writable: the tensors built on them are too)
                view = memoryview(packed)
                buffers += [view[offset:offset + sizes[i]] for i, offset in run]
        return pickle.loads(memoryview(header)[4 + 8 * n:], buffers=buffers)

    def _recv_exactly(self, size: int) -> bytearray:
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            k = self.sock.recv_into(view[got:], min(size - got, 1 << 24))
            if k == 0:
                raise EOFError("connection closed in the middle of a message")
            got += k
        return buf

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(OSError):
            self.conn.close()


_PACK_BELOW = 1 << 16  # buffers under 64 KiB travel packed with their small neighbours
_PACK_MAX = 1 << 22  # at most 4 MiB to a packed write
_ALIGN = 64  # each packed buffer starts at a multiple of this in the packed write


def _runs(sizes: Sequence[int]) -> list[list[tuple[int, int]]]:
    """The socket writes of a message's buffers, as lists of (buffer index, offset in the write):
    consecutive buffers under `_PACK_BELOW` share a write (each at an aligned offset, up to
    `_PACK_MAX` bytes), any other buffer is a write of its own. Sender and receiver both apply it
    to the header's sizes."""
    runs: list[list[tuple[int, int]]] = []
    end = 0  # bytes used in the open run
    for i, size in enumerate(sizes):
        offset = -(-end // _ALIGN) * _ALIGN
        if size < _PACK_BELOW and runs and sizes[runs[-1][-1][0]] < _PACK_BELOW and offset + size <= _PACK_MAX:
            runs[-1].append((i, offset))
            end = offset + size
        else:
            runs.append([(i, 0)])
            end = size
    return runs


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

