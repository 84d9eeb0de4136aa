"""A rank's side of the rendezvous: the group store's port is held from hello to store."""

from __future__ import annotations

import contextlib
import datetime
import errno
import socket
import threading
from multiprocessing.connection import Listener

import torch.distributed as dist

from tandem.launch.rendezvous import Hello, Master, join_controller
from tandem.net import bound_tcp_store, listen_socket


def test_rank_zero_holds_its_store_port_from_hello_to_store(monkeypatch):
    """Catches rank 0 advertising a port it picked and released (`free_port`): between its hello
    and its store's bind, another process (a second launch beside this one) can take the port, and
    the group fails with EADDRINUSE. Here the controller tries to bind the advertised port the
    moment the hello arrives: it must be taken, and the store must then listen on it."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(key, raising=False)  # join_controller sets them; restored afterwards
    authkey = b"k" * 32
    seen: dict[str, object] = {}
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        def controller() -> None:
            with listener.accept() as conn:
                hello = conn.recv()
                seen["hello"] = hello
                try:
                    listen_socket(hello.host, hello.port).close()
                    seen["bind"] = "free"
                except OSError as exc:
                    seen["bind"] = errno.errorcode.get(exc.errno, str(exc.errno))
                conn.send(Master(hello.host, hello.port))
                with contextlib.suppress(EOFError, OSError):
                    conn.recv()  # until the rank closes

        thread = threading.Thread(target=controller, daemon=True)
        thread.start()
        host, port = listener.address
        conn = join_controller(f"{host}:{port}", authkey, rank=0)
        hello = seen["hello"]
        assert isinstance(hello, Hello) and hello.rank == 0 and hello.port > 0
        assert seen["bind"] == "EADDRINUSE", f"the advertised port was {seen['bind']} between hello and store"
        store = bound_tcp_store(hello.host, hello.port, world_size=2, timeout=datetime.timedelta(seconds=30))
        assert store.port == hello.port
        peer = dist.TCPStore(hello.host, hello.port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
        peer.set("k", "v")
        assert store.get("k") == b"v"
        conn.close()
        thread.join(10)
    del peer, store
    with socket.socket() as probe:  # the store is gone with its socket: the port is free again
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((hello.host, hello.port))
