"""`tandem fleet` and `tandem serve --join` as real processes against a real controller (fake
servers behind it): the listing and its keys, controller.json (mode 0600, atomic), and each
mistake ends with exit 2 and one line naming the problem."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tandem.fleet.run_file import (
    CONTROLLER_FILE,
    ControllerFile,
    controller_file,
    read_controller_file,
    write_controller_file,
)
from tandem.rollout import RolloutConfig, RolloutController

TANDEM = str(Path(sys.executable).with_name("tandem"))
KEYS = ["address", "pid", "state", "version", "in_flight", "tokens_served", "last_error"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([TANDEM, *args], capture_output=True, text=True, timeout=timeout)


def user_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.inference.conftest import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("models"), "qwen3", seed=0)


@pytest.fixture
def live(make_server, tmp_path):
    servers = [make_server(), make_server()]
    ctl = RolloutController(RolloutConfig(servers=[s.address for s in servers]))
    info = ControllerFile(ctl.callback_address(), ctl.join_token, "the-key", os.getpid())
    with controller_file(tmp_path, info) as path:
        yield ctl, servers, path
    ctl.shutdown()


def test_fleet_lists_every_server_with_the_documented_keys(live, tmp_path):
    ctl, servers, path = live
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    servers[1].stop()  # dead: its probes fail, so it stays evicted
    ctl.fleet.evict(servers[1].address, "the process exited (killed by SIGKILL)")
    listed = json.loads(run("fleet", str(tmp_path), "--json").stdout)
    assert [list(s) for s in listed] == [KEYS, KEYS]
    assert [(s["address"], s["state"]) for s in listed] == [(servers[0].address, "healthy"),
                                                             (servers[1].address, "evicted")]
    assert listed[1]["last_error"] == "the process exited (killed by SIGKILL)" and listed[0]["pid"] is None
    table = run("fleet", str(tmp_path))
    assert table.returncode == 0, table.stderr
    assert "1 of 2 server(s) healthy" in table.stdout and servers[1].address in table.stdout
    assert "evicted" in table.stdout and "killed by SIGKILL" in table.stdout


def test_a_wrong_token_a_missing_file_and_an_ended_run_are_named(live, tmp_path):
    _, _, path = live
    data = json.loads(path.read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / CONTROLLER_FILE).write_text(json.dumps({**data, "token": "not-the-token"}))
    user_error(run("fleet", str(other)), "refused the join token (401)")
    user_error(run("fleet", str(tmp_path / "nowhere")), "is not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    user_error(run("fleet", str(empty)), "controller.json does not exist", "is `tandem train` running")
    (empty / CONTROLLER_FILE).write_text('{"address": "http://127.0.0.1:9", "token": 5, "pid": 1}')
    user_error(run("fleet", str(empty)), "key 'token' is missing or not a str")
    (empty / CONTROLLER_FILE).write_text(json.dumps({**data, "address": "http://127.0.0.1:9"}))
    user_error(run("fleet", str(empty)), "cannot reach the run's controller at http://127.0.0.1:9", "may have ended")


def test_the_file_is_replaced_atomically_and_removed_at_the_end(tmp_path):
    """A writer replaces the file over and over while a reader reads it: every read is a whole
    file. The reader goes on until it has seen 20 versions (at most 20000 reads or 10 s): a fixed
    count of reads could all happen before the writer thread is first scheduled."""
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            write_controller_file(tmp_path, ControllerFile("http://127.0.0.1:1", f"{i}" * 40, None, i))
            i += 1

    with controller_file(tmp_path, ControllerFile("http://127.0.0.1:1", "t" * 40, None, 0)) as path:
        thread = threading.Thread(target=writer)
        thread.start()
        try:
            pids: set[int] = set()
            deadline = time.monotonic() + 10
            for _ in range(20000):
                pids.add(read_controller_file(tmp_path).pid)
                if len(pids) >= 20 or time.monotonic() > deadline:
                    break
        finally:
            stop.set()
            thread.join()
        assert len(pids) >= 20 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert list(tmp_path.iterdir()) == []  # no temporary file left, and the file is gone


def test_serve_join_without_a_running_run_fails_before_loading_the_model(tmp_path):
    began = time.monotonic()
    proc = run("serve", "--model", str(tmp_path / "no-model"), "--port", "0", "--join", str(tmp_path))
    user_error(proc, f"{tmp_path / CONTROLLER_FILE} does not exist")
    assert time.monotonic() - began < 30


def test_serve_join_registers_with_the_controller_and_requires_the_runs_key(live, tmp_path, model_dir):
    from tests.inference.server_utils import ServerProcess

    ctl, _, _ = live
    joiner = ServerProcess(model_dir, tmp_path, "--join", str(tmp_path), "--kv-cache-tokens", "2048")
    try:
        deadline = time.monotonic() + 30
        while ctl.fleet.membership.record(joiner.url) is None:
            assert time.monotonic() < deadline, "the joiner never registered"
            time.sleep(0.1)
        record = ctl.fleet.membership.record(joiner.url)
        assert record.pid == joiner.pid and record.state.value in ("joining", "warming")
        assert joiner.get("/get_weight_version")[0] == 401  # the run's key (from controller.json) is required
        joiner.api_key = "the-key"
        assert joiner.get("/get_weight_version")[0] == 200
    finally:
        joiner.stop()
