"""Addresses and listeners: which hosts are loopback, and a `TCPStore` that listens on one address.

torch's `TCPStore` server listens on every interface whatever host it is given, so a trainer's
rendezvous store would be reachable from the network even when the run is meant to stay on this
machine. `bound_tcp_store` binds the listening socket itself, on the given address only, and hands
torch its file descriptor (`master_listen_fd`).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket

import torch.distributed as dist


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and 'localhost' (names are not resolved)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


_RESERVED: dict[tuple[str, int], socket.socket] = {}  # (host, port) -> listening socket, for bound_tcp_store


def reserve_store_port(host: str) -> int:
    """A port of `host` that the kernel picked, already listening, for a `bound_tcp_store(host,
    port)` made later in this process: it takes the socket over. Picking a free port, closing it
    and binding it again later would let another process take it in between (EADDRINUSE when
    launches run side by side)."""
    sock = listen_socket(host, 0)
    port = sock.getsockname()[1]
    _RESERVED[(host.strip("[]"), port)] = sock
    return port


def bound_tcp_store(host: str, port: int, *, world_size: int | None = None,
                    timeout: datetime.timedelta = datetime.timedelta(seconds=300)) -> dist.TCPStore:
    """The server side of a `TCPStore`, listening on `host` only; `store.port` is the port (useful
    with port 0; a port from `reserve_store_port` uses the socket it holds). The store owns the
    socket from here on."""
    sock = _RESERVED.pop((host.strip("[]"), port), None) or listen_socket(host, port)
    try:
        store = dist.TCPStore(host.strip("[]"), sock.getsockname()[1], world_size, is_master=True,
                              timeout=timeout, wait_for_workers=False, master_listen_fd=sock.fileno(),
                              use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor; the Python object must not
    return store


def address_towards(host: str) -> str:
    """This machine's address on the interface that reaches `host` (the route the kernel picks;
    nothing is sent): what a process should bind and advertise to a peer at `host`. Loopback for
    a loopback `host`."""
    if is_loopback(host):
        return "::1" if ":" in host.strip("[]") else "127.0.0.1"
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host.strip("[]"), 9))  # UDP connect: a route lookup, no packet
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds the IPv4 `address` ('lo' for 127.0.0.1),
    or None (IPv6, or no interface has it): what GLOO_SOCKET_IFNAME needs to bind there."""
    import fcntl
    import struct

    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if raw[20:24] == wanted:
                return name
    if ipaddress.ip_address(address).is_loopback:
        return next((n for _, n in socket.if_nameindex() if n == "lo"), None)
    return None
