"""`RolloutCallback` keeps one connection to the controller per calling thread, and replaces one
the controller closed while it sat idle before sending on it (a call is never lost or sent twice).
Real sockets: a keep-alive HTTP/1.1 server on 127.0.0.1 that counts connections and requests."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tandem.fleet.results import FleetError
from tandem.rollout.callback import RolloutCallback

pytestmark = pytest.mark.timeout(30)


class _Counting(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.requests: list[str] = []
        self.close_after_next = False  # answer normally, then drop the connection without saying so


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Counting

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        body = json.dumps({"world_size": len(self.server.requests)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.server.close_after_next:
            self.server.close_after_next = False
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server():
    srv = _Counting()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_calls_share_one_connection_and_survive_an_idle_close(server):
    host, port = server.server_address
    callback = RolloutCallback(f"http://{host}:{port}", "secret")
    assert [callback.world_size for _ in range(3)] == [1, 2, 3]
    assert server.connections == 1
    server.close_after_next = True
    assert callback.world_size == 4  # answered, then the server closed the idle connection
    assert callback.world_size == 5  # sent on a new connection, once
    assert server.connections == 2 and len(server.requests) == 5
    callback.close()


def test_a_controller_that_is_gone_is_reported():
    probe = _Counting()
    host, port = probe.server_address
    probe.server_close()  # nothing listens there any more
    with pytest.raises(FleetError, match="controller unreachable: ConnectionRefusedError"):
        RolloutCallback(f"http://{host}:{port}", "secret").info()
