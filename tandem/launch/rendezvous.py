"""How a scheduler's worker ranks find the controller, and each other, wherever they run.

The controller listens on one address (`RankRendezvous`) and hands every rank it starts that
address and the run's key (`TANDEM_RPC_CONNECT`, `TANDEM_RPC_AUTHKEY`). Each rank connects, passes
the HMAC challenge, says hello (rank 0 with a port it already holds for the group's store), gets
MASTER_ADDR / MASTER_PORT back, joins its process group and says ready; the connection then carries
RPC. A rank that dies or drops its connection fails the start at once, naming it. See
docs/launch.md, "The rendezvous"."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait

from tandem.launch.rpc import WorkerProcess
from tandem.launch.scheduler import LaunchError
from tandem.net import listen_socket

ENV_CONNECT = "TANDEM_RPC_CONNECT"  # host:port of the controller's rendezvous listener
HANDSHAKE_S = 10.0  # a connection that does not finish the key's challenge by then is dropped


@dataclass(frozen=True)
class Hello:
    """What a rank says when it connects."""

    rank: int
    host: str  # its address on the network it reaches the controller through
    port: int  # rank 0: the port its group store will listen on, reserved (MASTER_PORT); others: 0
    pid: int
    hostname: str
    where: str  # the scheduler's words for its placement (e.g. "job 12.0 on node1"); "" when local


@dataclass(frozen=True)
class Master:
    """The controller's answer: where the group's store is (rank 0)."""

    addr: str
    port: int


READY = "ready"


class RankRendezvous:
    """The controller's listener for one or more worker groups (one launch at a time)."""

    def __init__(self, host: str, authkey: bytes):
        self.authkey = authkey
        self._sock = listen_socket(host, 0)
        bound = self._sock.getsockname()
        self.address = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"

    def gather(self, procs: Sequence[WorkerProcess], deadline: float,
               failure: Callable[[int, str], LaunchError]) -> tuple[list[Connection], list[Hello]]:
        """Wait until the `len(procs)` ranks of one group have connected, said hello, been told
        their master and said ready; their connections and hellos in rank order. `procs[r]` is
        rank r's process (its sentinel ends the wait at its death); `failure(rank, what)` makes the
        error raised for a rank that dies, drops its connection or misses the deadline."""
        world = len(procs)
        conns: dict[int, Connection] = {}
        hellos: dict[int, Hello] = {}
        unknown: list[Connection] = []
        try:
            while len(hellos) < world:
                for ready_obj in self._wait(procs, set(hellos), unknown, [], deadline, failure, "connect"):
                    if ready_obj is self._sock:
                        if (conn := self._accept()) is not None:
                            unknown.append(conn)
                        continue
                    conn = ready_obj  # type: ignore[assignment]
                    unknown.remove(conn)
                    hello = _recv_or_none(conn)
                    if not isinstance(hello, Hello) or not 0 <= hello.rank < world or hello.rank in hellos:
                        conn.close()  # a stranger with the key, or a duplicate: not one of ours
                        continue
                    conns[hello.rank], hellos[hello.rank] = conn, hello
            master = Master(hellos[0].host, hellos[0].port)
            for r in range(world):
                conns[r].send(master)
            ready: set[int] = set()
            while len(ready) < world:
                pending = [conns[r] for r in range(world) if r not in ready]
                for conn in self._wait(procs, ready, [], pending, deadline, failure, "join its process group"):
                    r = next(r for r, c in conns.items() if c is conn)
                    if _recv_or_none(conn) != READY:
                        raise failure(r, f"exited during startup ({procs[r].exit_status(wait_s=2.0)})")
                    ready.add(r)
        except BaseException:
            for conn in [*unknown, *conns.values()]:
                conn.close()
            raise
        for conn in unknown:
            conn.close()
        return [conns[r] for r in range(world)], [hellos[r] for r in range(world)]

    def _wait(self, procs: Sequence[WorkerProcess], done: set[int], unknown: list[Connection],
              pending: list[Connection], deadline: float, failure: Callable[[int, str], LaunchError],
              what: str) -> list[object]:
        """Block on the listener (while ranks are still to connect), connections and sentinels."""
        sentinels: dict[int, int] = {}
        for r, p in enumerate(procs):
            if r not in done and p.sentinel >= 0:
                sentinels.setdefault(p.sentinel, r)
        watch: list[object] = [*unknown, *pending, *sentinels]
        if not pending:
            watch.append(self._sock)
        left = deadline - time.monotonic()
        ready = wait(watch, left) if left > 0 else []  # type: ignore[arg-type]
        if not ready:
            late = min(r for r in range(len(procs)) if r not in done)
            raise failure(late, f"did not {what} within the startup deadline (ranks waited for: "
                                f"{[r for r in range(len(procs)) if r not in done]})")
        for obj in ready:
            if isinstance(obj, int) and obj in sentinels:
                r = sentinels[obj]
                raise failure(r, f"exited during startup ({procs[r].exit_status(wait_s=2.0)})")
        return ready

    def _accept(self) -> Connection | None:
        """One authenticated connection, or None for a peer that fails (or stalls in) the challenge."""
        try:
            sock, _ = self._sock.accept()
        except OSError:
            return None
        _set_io_timeout(sock.fileno(), HANDSHAKE_S)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except Exception:  # AuthenticationError, EOF, a timeout, a reset
            conn.close()
            return None
        _set_io_timeout(conn.fileno(), 0.0)
        return conn

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def _recv_or_none(conn: Connection) -> object:
    try:
        return conn.recv()
    except Exception:  # EOF, a reset, or bytes that do not unpickle
        return None


def _set_io_timeout(fd: int, seconds: float) -> None:
    """SO_RCVTIMEO/SO_SNDTIMEO on a socket descriptor (0: block forever): a `Connection` reads
    the raw descriptor, so a peer that stalls mid-handshake fails the read instead of hanging."""
    sec = int(seconds)
    tv = struct.pack("ll", sec, int((seconds - sec) * 1e6))
    with socket.socket(fileno=os.dup(fd)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


# ----------------------------------------------------------------------------------- rank side


def join_controller(controller: str, authkey: bytes, rank: int, where: str = "") -> Connection:
    """A worker rank's side up to joining its group: connect to `controller` ('host:port'), pass
    the key's challenge, say hello, and put the master's address into this process's environment
    (MASTER_ADDR, MASTER_PORT, and GLOO_SOCKET_IFNAME for the interface that reaches it, unless
    set). Returns the connection; say `READY` on it once the process group is joined."""
    from multiprocessing.connection import Client

    from tandem.net import (  # torch; the controller side needs none
        address_towards,
        interface_of,
        reserve_store_port,
    )

    host, _, port = controller.rpartition(":")
    host = host.strip("[]")
    conn = Client((host, int(port)), authkey=authkey)
    mine = address_towards(host)
    store_port = reserve_store_port(mine) if rank == 0 else 0  # held open until the group's store takes it
    conn.send(Hello(rank, mine, store_port, os.getpid(), socket.gethostname(), where))
    master = conn.recv()
    if not isinstance(master, Master):
        raise RuntimeError(f"the controller at {controller} answered {master!r} instead of the group's master")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master.addr, str(master.port)
    if "GLOO_SOCKET_IFNAME" not in os.environ and (ifname := interface_of(address_towards(master.addr))):
        os.environ["GLOO_SOCKET_IFNAME"] = ifname  # gloo's default is the host name's address
    return conn
