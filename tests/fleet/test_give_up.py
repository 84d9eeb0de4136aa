"""`HttpFleet.abandon`: a call waiting on a server that its owner gave up (evicted) answers at
once, as a `no_answer` failure naming why, instead of at the operation's deadline; a collective
spoiled by that member fails for every member at once; later calls go out as usual; and a call
unanswered for `slow_call_s` is logged once, then again when it ends. Real sockets: one server
answers every POST, the other accepts connections and never answers (a stopped process)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tandem.fleet import ops
from tandem.fleet.http import HttpFleet
from tandem.fleet.results import FleetError

pytestmark = pytest.mark.timeout(60)

PATIENT = ops.Deadlines(init_group_s=30.0, bucket_s=30.0, update_s=60.0, http_s=30.0)


class _Answers(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"success": True, "message": "ok"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def answering():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def silent():
    """Accepts connections (the kernel's backlog) and never reads or answers, like a SIGSTOPped server."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_a_call_in_flight_is_given_up_at_once(answering, silent):
    with HttpFleet([answering, silent], deadlines=PATIENT) as fleet:
        start = time.monotonic()
        future = fleet.send(ops.PAUSE, ops.PauseGeneration())
        time.sleep(0.3)
        assert not future.done()  # the silent one holds it
        fleet.abandon(silent, "evicted: 2 probes failed in a row")
        with pytest.raises(FleetError) as info:
            future.result(5)
        elapsed = time.monotonic() - start
    assert elapsed < 2.0, elapsed  # not the 30 s deadline
    (failure,) = info.value.failures
    assert failure.address == silent and failure.no_answer
    assert "given up after" in failure.message and "evicted: 2 probes failed in a row" in failure.message
    assert [r.address for r in info.value.results if r.success] == [answering]


def test_given_up_between_the_send_and_the_call(answering, silent):
    """Abandoned right after `send` returned, before the call reached its event loop: still given up."""
    with HttpFleet([silent], deadlines=PATIENT) as fleet:
        future = fleet.send(ops.PAUSE, ops.PauseGeneration())
        fleet.abandon(silent, "gone")
        with pytest.raises(FleetError) as info:
            future.result(5)
    assert info.value.failures[0].no_answer and "gone" in info.value.failures[0].message


def test_later_calls_go_out_as_usual(answering, silent):
    short = ops.Deadlines(init_group_s=1.0, bucket_s=1.0, update_s=5.0, http_s=0.5)
    with HttpFleet([answering, silent], deadlines=short) as fleet:
        fleet.abandon(silent, "evicted")
        fleet.abandon(answering, "evicted")
        assert fleet.send(ops.PAUSE, ops.PauseGeneration(), [answering]).result(5).values()
        start = time.monotonic()
        with pytest.raises(FleetError) as info:
            fleet.send(ops.PAUSE, ops.PauseGeneration(), [silent]).result(5)
        assert time.monotonic() - start >= 0.4  # waited for its deadline: the old abandonment is spent
        assert "no answer within 0.5s" in info.value.failures[0].message


def test_a_collective_spoiled_by_a_given_up_member_fails_for_all(silent):
    """join_group to two silent members (the group cannot form without either): giving up one
    ends both calls, and only the given-up one is blamed (`no_answer`)."""
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen(8)
    second = f"http://127.0.0.1:{other.getsockname()[1]}"
    try:
        with HttpFleet([silent, second], deadlines=PATIENT) as fleet:
            start = time.monotonic()
            future = fleet.send(ops.JOIN_GROUP, ops.JoinGroup("127.0.0.1", 29501, "g", "gloo", (1, 1), 30.0))
            time.sleep(0.2)
            fleet.abandon(silent, "evicted: stopped")
            with pytest.raises(FleetError) as info:
                future.result(5)
            assert time.monotonic() - start < 2.0
    finally:
        other.close()
    by_address = {r.address: r for r in info.value.failures}
    assert by_address[silent].no_answer and "evicted: stopped" in by_address[silent].message
    assert not by_address[second].no_answer
    assert "cannot complete without it" in by_address[second].message and silent in by_address[second].message


def test_a_collective_spoiled_by_an_unreachable_member_fails_for_all(silent):
    """stage_distributed to a member whose process died as the call went out (its connection
    refused: it fails at once, before its eviction could give it up) and one blocked in the
    broadcast: the blocked one is spoiled at once instead of waiting out the bucket deadline (found
    by bench/chaos.py: a server SIGKILLed during an update held the step 60 s, gloo's timeout on
    the survivors), and only the dead one is blamed."""
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{gone.getsockname()[1]}"
    gone.close()  # nothing listens there: connections are refused
    bucket = ops.DistributedBucket("g", (), bucket_index=0, commit=False)
    with HttpFleet([dead, silent], deadlines=PATIENT) as fleet:
        start = time.monotonic()
        with pytest.raises(FleetError) as info:
            fleet.send(ops.STAGE_DISTRIBUTED, bucket).result(35)
        elapsed = time.monotonic() - start
    assert elapsed < 2.0, elapsed  # not the 30 s bucket deadline
    by_address = {r.address: r for r in info.value.failures}
    assert by_address[dead].no_answer and "unreachable" in by_address[dead].message
    assert not by_address[silent].no_answer  # not to blame: it may still answer
    assert "cannot complete without it" in by_address[silent].message and dead in by_address[silent].message


def test_a_slow_call_is_logged_once_and_when_it_ends(silent, caplog):
    short = ops.Deadlines(init_group_s=1.0, bucket_s=1.0, update_s=5.0, http_s=0.8)
    with caplog.at_level(logging.WARNING, logger="tandem.fleet.http"), \
            HttpFleet([silent], deadlines=short) as fleet:
        fleet.slow_call_s = 0.2
        with pytest.raises(FleetError):
            fleet.send(ops.PAUSE, ops.PauseGeneration()).result(5)
    lines = [r.getMessage() for r in caplog.records]
    waiting = [m for m in lines if "no answer yet after" in m]
    ended = [m for m in lines if "ended after" in m]
    assert len(waiting) == 1 and silent in waiting[0] and "pause_generation" in waiting[0], lines
    assert len(ended) == 1 and "no answer within 0.8s" in ended[0], lines


@pytest.mark.parametrize("when", ["in flight", "before the send"])
def test_the_elastic_fleet_gives_up_a_call_to_a_server_it_evicts(answering, silent, when):
    """The controller's fleet: evicting a member gives up its calls in flight, and a call sent to a
    member already evicted is given up as it leaves (no deadline is waited out either way)."""
    from tandem.fleet.adapters import TandemAdapter
    from tandem.rollout.elastic import ElasticFleet
    from tandem.rollout.health import HealthConfig
    from tandem.rollout.pool import ServerPool

    addresses = [answering, silent]
    fleet = ElasticFleet(addresses, ServerPool(addresses), TandemAdapter(), health=HealthConfig(interval_s=60.0),
                         min_servers=1, min_servers_grace_s=60.0, topology_cooldown_s=0.0, deadlines=PATIENT)
    try:
        start = time.monotonic()
        if when == "before the send":
            fleet.evict(silent, "its process exited")
        future = fleet.send(ops.LEAVE_GROUP, ops.LeaveGroup("g"), addresses)
        if when == "in flight":
            time.sleep(0.2)
            fleet.evict(silent, "its process exited")
        with pytest.raises(FleetError) as info:
            future.result(5)
        assert time.monotonic() - start < 2.0
    finally:
        fleet.close()
    (failure,) = info.value.failures
    assert failure.address == silent and failure.no_answer and "evicted: its process exited" in failure.message
