"""`ControlClient` against real servers on loopback: an aiohttp app (kept-alive connections, chunked
replies, headers, path prefixes) and raw socket servers for what a well-behaved one never does
(a reply that ends with the connection, a kept-alive connection closed under a call, no reply at
all, a malformed reply)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from aiohttp import web

from tandem.aio import run
from tandem.fleet.control_http import ControlClient, Unreachable


class App:
    """An aiohttp server that records each request's connection (its peer port) and headers."""

    def __init__(self) -> None:
        self.peers: list[int] = []
        self.seen: list[dict[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/echo", self.echo)
        app.router.add_get("/prefix/health", self.health)
        app.router.add_get("/chunked", self.chunked)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.address = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self.address

    def _record(self, request: web.Request) -> None:
        self.peers.append(request.transport.get_extra_info("peername")[1])
        self.seen.append(dict(request.headers))

    async def health(self, request: web.Request) -> web.Response:
        self._record(request)
        return web.json_response({"weight_version": 3, "path": request.path})

    async def echo(self, request: web.Request) -> web.Response:
        self._record(request)
        body = await request.read()
        return web.json_response({"got": json.loads(body)}, status=201)

    async def chunked(self, request: web.Request) -> web.StreamResponse:
        self._record(request)
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for part in (b"ab", b"cd", b"ef"):
            await resp.write(part)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def with_app(body):
    app = App()
    address = await app.start()
    client = ControlClient({"Authorization": "Bearer k"})
    try:
        return await body(app, address, client)
    finally:
        client.close()
        await app.stop()


def test_calls_reuse_a_kept_alive_connection_and_send_headers_and_bodies():
    async def body(app, address, client):
        first = await client.request("GET", address, "/health", timeout=5)
        second = await client.request("GET", address, "/health", timeout=5)
        posted = await client.request("POST", address, "/echo", json.dumps({"v": [1, 2]}).encode(), timeout=5)
        return app, first, second, posted

    app, first, second, posted = run(with_app(body))
    assert (first.status, json.loads(first.body)) == (200, {"weight_version": 3, "path": "/health"})
    assert second.body == first.body
    assert (posted.status, json.loads(posted.body)) == (201, {"got": {"v": [1, 2]}})
    assert len(set(app.peers)) == 1, f"three calls in a row took {len(set(app.peers))} connections"
    assert all(h["Authorization"] == "Bearer k" for h in app.seen)
    assert app.seen[2]["Content-Type"] == "application/json"


def test_concurrent_calls_to_one_server_take_one_connection_each():
    async def body(app, address, client):
        replies = await asyncio.gather(*(client.request("GET", address, "/health", timeout=5) for _ in range(5)))
        again = await asyncio.gather(*(client.request("GET", address, "/health", timeout=5) for _ in range(5)))
        return app, replies + again

    app, replies = run(with_app(body))
    assert all(r.status == 200 for r in replies)
    assert len(set(app.peers[:5])) == 5
    assert set(app.peers[5:]) == set(app.peers[:5]), "the second round did not reuse the first's connections"


def test_a_chunked_reply_and_an_address_with_a_path_prefix():
    async def body(app, address, client):
        chunked = await client.request("GET", address, "/chunked", timeout=5)
        prefixed = await client.request("GET", address + "/prefix", "/health", timeout=5)
        return chunked, prefixed

    chunked, prefixed = run(with_app(body))
    assert (chunked.status, chunked.body) == (200, b"abcdef")
    assert json.loads(prefixed.body)["path"] == "/prefix/health"


def test_a_refused_connection_raises_unreachable_naming_the_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused

    async def body():
        client = ControlClient()
        try:
            await client.request("GET", f"http://127.0.0.1:{port}", "/health", timeout=5)
        finally:
            client.close()

    with pytest.raises(Unreachable, match=f"127.0.0.1:{port}"):
        run(body())


def test_bad_addresses_are_refused_with_the_address_named():
    async def body():
        await ControlClient().request("GET", "ftp://x", "/health", timeout=1)

    with pytest.raises(ValueError, match="ftp://x"):
        run(body())


class RawServer:
    """A socket server whose every connection is handled by `script(reader, writer, n)`, `n` the
    connection's number (from 0); it counts requests by their first line."""

    def __init__(self, script):
        self.script, self.connections, self.requests = script, 0, []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await reader.readexactly(length)
        self.requests.append(head.split(b"\r\n")[0])
        return body

    async def _handle(self, reader, writer) -> None:
        n, self.connections = self.connections, self.connections + 1
        try:
            await self.script(self, reader, writer, n)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self.server.close()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def raw(script, calls):
    async def body():
        server = RawServer(script)
        address = await server.start()
        client = ControlClient()
        try:
            return server, await calls(client, address)
        finally:
            client.close()
            server.close()

    return run(body())


def test_a_call_past_its_timeout_raises_and_closes_its_connection_and_the_next_call_goes_out_fresh():
    closed = []

    async def script(server, reader, writer, n):
        await server.read_request(reader)
        if n == 0:  # no reply; wait for the client to close the connection
            await reader.read()
            closed.append(asyncio.get_running_loop().time())
        else:
            writer.write(OK)
            await writer.drain()
            await reader.read()

    async def calls(client, address):
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await client.request("GET", address, "/slow", timeout=0.3)
        took = loop.time() - start
        after = await client.request("GET", address, "/x", timeout=5)
        await asyncio.sleep(0.2)
        return start, took, after

    server, (start, took, after) = raw(script, calls)
    assert 0.29 <= took < 1.5
    assert after.body == b"ok" and server.connections == 2
    assert closed and closed[0] - start < 1.5, "the timed-out call left its connection open"


def test_a_reply_whose_body_ends_with_the_connection():
    async def script(server, reader, writer, n):
        await server.read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        await writer.drain()

    async def calls(client, address):
        return [await client.request("GET", address, "/x", timeout=5) for _ in range(2)]

    server, replies = raw(script, calls)
    assert [(r.status, r.body) for r in replies] == [(200, b"all of it")] * 2
    assert server.connections == 2  # the first connection ended with its reply: not reused


def kept_alive_then_closed_under_the_second_call(server, reader, writer, n):
    """Each connection answers its first request, then reads the second and closes without a
    reply: a kept-alive connection the server shut as the call went out."""

    async def go():
        await server.read_request(reader)
        writer.write(OK)
        await writer.drain()
        await server.read_request(reader)

    return go()


def test_a_get_on_a_kept_alive_connection_closed_under_it_goes_again_once_on_a_new_one():
    async def calls(client, address):
        first = await client.request("GET", address, "/x", timeout=5)
        second = await client.request("GET", address, "/x", timeout=5)
        return first, second

    server, (first, second) = raw(kept_alive_then_closed_under_the_second_call, calls)
    assert first.body == second.body == b"ok"
    assert server.connections == 2
    assert server.requests == [b"GET /x HTTP/1.1"] * 3  # the second went out twice, once per connection


def test_a_post_on_a_kept_alive_connection_closed_under_it_is_not_sent_twice():
    async def calls(client, address):
        await client.request("POST", address, "/commit", b"{}", timeout=5)
        with pytest.raises(Unreachable, match="closed the connection before it replied"):
            await client.request("POST", address, "/commit", b"{}", timeout=5)

    server, _ = raw(kept_alive_then_closed_under_the_second_call, calls)
    assert server.requests == [b"POST /commit HTTP/1.1"] * 2
    assert server.connections == 1


def test_a_connection_closed_in_the_middle_of_a_reply_and_a_malformed_reply_raise_unreachable():
    async def script(server, reader, writer, n):
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial" if n == 0 else b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        if n == 1:
            await asyncio.sleep(5)  # the client must not wait for more of a broken reply

    async def calls(client, address):
        errors = []
        for _ in range(2):
            with pytest.raises(Unreachable) as caught:
                await client.request("GET", address, "/x", timeout=3)
            errors.append(str(caught.value))
        return errors

    _, errors = raw(script, calls)
    assert "in the middle of its reply" in errors[0]
    assert "malformed" in errors[1]
