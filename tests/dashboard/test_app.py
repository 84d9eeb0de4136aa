"""`tandem dashboard` as a real process over HTTP: the key, loopback, the routes and the live
stream of changes."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from tests.dashboard.runs import Dashboard, json_of, write_run


@pytest.fixture(scope="module")
def keyed_run(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("keyed") / "e2e" / "t", steps=20, per_step=5, key="s3cret-key")


def test_without_the_key_every_route_is_refused_and_the_printed_url_lets_the_browser_in(keyed_run):
    with Dashboard(keyed_run) as dash:
        assert dash.url == f"http://127.0.0.1:{dash.port}/?key=s3cret-key"
        for path in ("/", "/api/run", "/api/metrics", "/api/fleet", "/api/trajectory?step=1&i=0", "/static/app.js"):
            status, _, body = dash.get(path)
            assert status == 401, (path, status)
            assert "dashboard/key" in json_of(body)["error"]
        assert dash.get("/api/run", {"Authorization": "Bearer wrong"})[0] == 401
        assert dash.get("/?key=wrong")[0] == 401
        status, _, body = dash.get("/api/run", {"Authorization": "Bearer s3cret-key"})
        assert status == 200 and json_of(body)["name"] == "e2e/t" and json_of(body)["running"] is False
        status, headers, _ = dash.get("/?key=s3cret-key")  # the URL it printed: a cookie, and the key leaves the URL
        assert status == 303 and headers["location"] == "/"
        cookie = headers["set-cookie"].split(";")[0]
        assert "HttpOnly" in headers["set-cookie"] and "SameSite=strict" in headers["set-cookie"]
        status, _, page = dash.get("/", {"Cookie": cookie})
        assert status == 200 and b"/static/app.js" in page


def test_it_binds_loopback_unless_told_otherwise(keyed_run):
    with Dashboard(keyed_run) as dash:
        listening = _listening_addresses(dash.port)
        assert listening == {"127.0.0.1"}, listening
        outside = _an_outside_address()
        if outside is not None:
            with socket.socket() as s, pytest.raises(OSError):
                s.settimeout(2)
                s.connect((outside, dash.port))


def test_the_routes_answer_what_the_run_wrote(keyed_run):
    auth = {"Authorization": "Bearer s3cret-key"}
    with Dashboard(keyed_run) as dash:
        metrics = json_of(dash.get("/api/metrics", auth)[2])
        assert metrics["total"] == 20 and [r["step"] for r in metrics["rows"]] == list(range(1, 21))
        later = json_of(dash.get("/api/metrics?since=18", auth)[2])
        assert [r["step"] for r in later["rows"]] == [19, 20]
        steps = json_of(dash.get("/api/steps", auth)[2])["rows"]
        assert len(steps) == 20 and sum(steps[0]["staleness"].values()) == 5
        fleet = json_of(dash.get("/api/fleet", auth)[2])
        assert {s["state"] for s in fleet["servers"]} == {"healthy", "evicted"} and fleet["events"]
        found = json_of(dash.get("/api/trajectories?min_reward=1&step=3", auth)[2])
        assert found["total"] == 2 and all(r["reward"] == 1.0 and r["step"] == 3 for r in found["rows"])
        one = json_of(dash.get("/api/trajectory?step=3&i=1", auth)[2])
        assert one["step"] == 3 and len(one["pieces"]) == len(one["mask"]) == len(one["trainer_logprobs"])
        status, _, body = dash.get("/api/trajectory?step=99&i=0", auth)
        assert status == 404 and "step 99" in json_of(body)["detail"]
        assert dash.get("/static/nothing.js", auth)[0] == 404


def test_the_event_stream_says_when_the_run_wrote_more(tmp_path):
    run = write_run(tmp_path / "e2e" / "t", steps=3, per_step=2, key="s3cret-key")
    with Dashboard(run) as dash:
        request = urllib.request.Request(dash.base + "/api/events", headers={"Authorization": "Bearer s3cret-key"})
        with urllib.request.urlopen(request, timeout=10) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            first = _next_event(stream)
            assert first.startswith("event: change")
            with (run / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"phase": "rl", "step": 21, "time": time.time(), "reward/mean": 1.0}) + "\n")
            began = time.monotonic()
            assert _next_event(stream).startswith("event: change")
            assert time.monotonic() - began < 5


def _next_event(stream) -> str:
    lines = []
    while True:  # bounded by the urlopen timeout
        line = stream.readline().decode()
        if line.strip() == "" and lines:
            if lines[0].startswith("event:"):
                return "".join(lines)
            lines = []
            continue
        if line.strip():
            lines.append(line)


def _listening_addresses(port: int) -> set[str]:
    found = set()
    for table, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                if family == 4:
                    found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
                else:
                    found.add("ipv6:" + address)
    return found


def _an_outside_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outward interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_a_key_the_run_writes_after_the_page_started_is_wanted_from_then_on(tmp_path):
    run = tmp_path / "e2e" / "t"
    (run / "dashboard").mkdir(parents=True)  # a run that has not written its key yet
    with Dashboard(run) as dash:
        assert dash.get("/api/run")[0] == 200
        (run / "dashboard" / "key").write_text("late-key")
        assert dash.get("/api/run")[0] == 401
        assert dash.get("/api/run", {"Authorization": "Bearer late-key"})[0] == 200
