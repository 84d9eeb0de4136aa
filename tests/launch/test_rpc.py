"""The RPC layer without processes: wire format, and `serve` + `WorkerGroup` over socket pairs
with threads standing in for workers (a pipe stands in for the process sentinel)."""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch

from tandem.launch import (
    GroupBrokenError,
    RemoteError,
    RPCTimeoutError,
    WorkerCrashedError,
    WorkerGroup,
)
from tandem.launch.rpc import method_name
from tandem.launch.rpc_server import ExitAfterReply, serve
from tandem.launch.rpc_wire import Channel, dumps


def _pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def test_tensors_round_trip_exactly():
    a, b = _pair()
    ca, cb = Channel(a), Channel(b)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    obj = {"view": base[:, ::2], "t": base.t(), "bf16": torch.randn(5).bfloat16(), "bool": torch.tensor([True, False]),
           "empty": torch.zeros(0, 3), "scalar": torch.tensor(7, dtype=torch.int64), "grad": torch.ones(3, requires_grad=True),
           "c64": torch.randn(2, dtype=torch.complex64), "nested": [(1, "x", torch.ones(2, dtype=torch.uint8))]}
    frames = dumps(obj)
    assert len(frames) == 1 + 8  # header + one raw frame per non-empty tensor (empty ones go in-band)
    t = threading.Thread(target=ca.send, args=(frames,))
    t.start()
    back = cb.recv()
    t.join()
    for key in ("view", "t", "bf16", "bool", "empty", "scalar", "grad", "c64"):
        assert back[key].dtype == obj[key].dtype and torch.equal(back[key].detach(), obj[key].detach()), key
    assert back["grad"].requires_grad and back["nested"][0][:2] == (1, "x")
    back["view"].add_(1)  # received tensors are writable
    ca.close()
    cb.close()


def test_small_buffers_share_a_write_and_arrive_aligned_and_exact():
    """Runs of buffers under 64 KiB go as one socket write (each at a 64-byte aligned offset) and
    arrive as views of one buffer; bigger ones go alone. Every tensor comes back equal, dtype and
    shape kept, writable, and its data aligned for its dtype; a packed run ends before 4 MiB."""
    from tandem.launch.rpc_wire import _runs

    a, b = _pair()
    ca, cb = Channel(a), Channel(b)
    gen = torch.Generator().manual_seed(0)
    obj = [torch.randn(n, generator=gen).to(dtype) for n, dtype in
           [(3, torch.float32), (5, torch.bfloat16), (7, torch.float64), (40_000, torch.float32), (1, torch.int64),
            (2, torch.int8), (9, torch.float32)]] + [torch.randint(0, 9, (1000,), generator=gen) for _ in range(600)]
    frames = dumps(obj)
    runs = _runs([memoryview(f).nbytes for f in frames[1:]])
    # The 160 KB tensor is a write of its own; the small ones after it run on into the 600 x 8000
    # bytes until a write would pass 4 MiB (3 + 524), the rest in a last write.
    assert [len(r) for r in runs] == [3, 1, 527, 76]
    assert all(offset % 64 == 0 for run in runs for _, offset in run)
    t = threading.Thread(target=ca.send, args=(frames,))
    t.start()
    back = cb.recv()
    t.join()
    for x, y in zip(obj, back, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        assert y.data_ptr() % y.element_size() == 0
    back[0].add_(1)  # writable, and only its own slice of the shared buffer changes
    assert torch.equal(back[1], obj[1]) and torch.equal(back[0], obj[0] + 1)
    ca.close()
    cb.close()


def test_a_sequence_batch_travels_as_columns():
    """On the RPC wire a SequenceBatch is one tensor per key (per-token values concatenated,
    scalars stacked), keys it cannot pack (mixed dtypes, Python values) as they are; it comes
    back equal. Plain pickle (multiprocessing's too) keeps the sequences as they are."""
    from tandem.data.batch import SequenceBatch

    seqs = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long),
             "routed": torch.zeros(n, 2, 3, dtype=torch.int16), "reward": torch.tensor(float(n)),
             "mixed": torch.ones(n, dtype=torch.float32 if n % 2 else torch.float64), "note": n / 2}
            for n in (3, 8, 1, 5)]
    batch = SequenceBatch(seqs)
    frames = dumps(batch)
    assert len(frames) == 1 + 4 + 4  # four packed keys, and the four "mixed" tensors one by one
    assert "_unpack_batch" not in str(pickle.dumps(batch))
    a, b = _pair()
    ca, cb = Channel(a), Channel(b)
    t = threading.Thread(target=ca.send, args=(frames,))
    t.start()
    back = cb.recv()
    t.join()
    assert isinstance(back, SequenceBatch) and back.lengths == batch.lengths
    for x, y in zip(seqs, back.seqs, strict=True):
        assert x.keys() == y.keys() and x["note"] == y["note"]
        for key in x.keys() - {"note"}:
            assert x[key].dtype == y[key].dtype and x[key].shape == y[key].shape and torch.equal(x[key], y[key]), key
    ca.close()
    cb.close()


def test_tcp_channels_disable_nagle():
    """A message is several writes then a read: with Nagle on, every call after the first small
    write waits for the peer's delayed ACK (~40 ms on Linux loopback). Both ends set TCP_NODELAY."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    channels = [Channel(Connection(client.detach())), Channel(Connection(accepted.detach()))]
    for ch in channels:
        assert ch.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    t = threading.Thread(target=channels[0].send, args=(dumps({"x": torch.ones(3)}),))
    t.start()
    assert torch.equal(channels[1].recv()["x"], torch.ones(3))
    t.join()
    for ch in channels:
        ch.close()


class _Thing:
    def __init__(self, rank: int):
        self.rank = rank

    def hello(self, x):
        return self.rank, x

    def boom(self):
        raise KeyError(f"boom on {self.rank}")

    def _secret(self):
        return "never served"

    def boom_on(self, rank: int):
        if self.rank == rank:
            raise ValueError("only me")
        return self.rank

    def boom_or_slow(self):
        if self.rank == 0:
            raise ValueError("rank 0 fails")
        time.sleep(6.0)
        return self.rank

    def slow(self, seconds: float):
        time.sleep(seconds)
        return self.rank

    def unpicklable(self):
        return lambda: 1

    def bye(self):
        return ExitAfterReply("bye")


class _FakeProc:
    """A thread 'process': its sentinel is a pipe that becomes readable when it ends."""

    def __init__(self, conn: Connection, obj: object):
        self.pid = None
        self._r, self._w = os.pipe()
        self.done = False
        self.thread = threading.Thread(target=self._run, args=(conn, obj), daemon=True)
        self.thread.start()

    def _run(self, conn, obj):
        try:
            serve(conn, obj)
        finally:
            conn.close()
            self.done = True
            os.write(self._w, b"x")

    @property
    def sentinel(self) -> int:
        return self._r

    def exit_status(self, wait_s: float = 0.0) -> str:
        self.thread.join(wait_s)
        return "exit code 0" if self.done else "still running"

    def log_tail(self, lines: int = 40) -> str:
        return "fake log"


def _group(n: int = 2, **kw) -> tuple[WorkerGroup, list[_FakeProc]]:
    conns, procs = [], []
    for r in range(n):
        ours, theirs = _pair()
        conns.append(ours)
        procs.append(_FakeProc(theirs, _Thing(r)))
    return WorkerGroup("fake", conns, procs, **kw), procs


def test_calls_errors_and_exit():
    group, _ = _group(error_grace_s=0.5)
    assert group.call(_Thing.hello, 5) == [(0, 5), (1, 5)]
    assert group.call_per_rank(_Thing.hello, [("a",), ("b",)]) == [(0, "a"), (1, "b")]
    big = [torch.randn(600_000), torch.randn(600_000)]  # > 1 MiB each: the sender threads write them
    assert [x[1].shape for x in group.call_per_rank(_Thing.hello, [(t,) for t in big])] == [(600_000,)] * 2
    assert group.submit(_Thing.hello, 1).result(timeout=10) == [(0, 1), (1, 1)]
    with pytest.raises(RemoteError) as info:
        group.call(_Thing.boom)
    assert info.value.rank == 0 and "rank(s) [1] raised too" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError) and "in boom" in info.value.remote_traceback
    with pytest.raises(RemoteError, match="private"):
        group.call(_Thing._secret)
    with pytest.raises(RemoteError, match="cannot be sent"):
        group.call(_Thing.unpicklable)
    assert group.call(_Thing.hello, 1)[0] == (0, 1)  # every rank answered each time: still usable
    with pytest.raises(ValueError):
        group.call_per_rank(_Thing.hello, [(1,)])
    assert group.call(_Thing.bye) == ["bye", "bye"]
    with pytest.raises(WorkerCrashedError):  # they left: the next call sees it before sending
        group.call(_Thing.hello, 1)
    group.close()


def test_methods_are_named_by_function():
    """A request names the function on the served class; a string, a bound method or a plain
    function is refused in the controller, before anything is sent."""
    assert method_name(_Thing.hello) == "hello"
    for bad in ("hello", _Thing(0).hello, _pair):
        with pytest.raises(TypeError, match=r"Worker\.ping"):
            method_name(bad)
    group, _ = _group()
    with pytest.raises(TypeError):
        group.call("hello", 1)
    with pytest.raises(TypeError):
        group.submit("hello", 1)
    assert group.call(_Thing.hello, 2) == [(0, 2), (1, 2)]  # nothing was sent: still in step
    group.close()


def test_stuck_rank_after_an_error_breaks_the_group():
    group, _ = _group(error_grace_s=0.3)
    start = time.monotonic()
    with pytest.raises(RemoteError, match=r"rank\(s\) \[1\] never answered"):
        group.call(_Thing.boom_or_slow)  # rank 0 raises, rank 1 is "inside a collective" for 6 s
    assert time.monotonic() - start < 4.0  # the 0.3 s grace, with room for a loaded machine; not the 6 s
    with pytest.raises(GroupBrokenError):
        group.call(_Thing.hello, 1)
    group.close()


def test_deadline():
    group, _ = _group()
    with pytest.raises(RPCTimeoutError) as info:
        group.call(_Thing.slow, 2.0, rpc_timeout=0.2)
    assert info.value.pending == [0, 1]
    with pytest.raises(GroupBrokenError):
        group.call(_Thing.hello, 1)
    group.close()
