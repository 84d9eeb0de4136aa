"""A run's life as a user meets it: a second launch into the same trial, resuming, what the run
prints and logs, its listeners and keys, Ctrl-C, and failing evaluation rewards. Real `tandem
train` processes with a tiny model on 127.0.0.1. (An error storm ending a run is checked in
tests/rl/test_reward_workflow_e2e.py, on a run it shares with other reward tests.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tandem.rl.checkpoints import write_pointer
from tests.launch.procs import CHILD_ENV, descendants, listening_sockets, wait_gone
from tests.rl.common import TANDEM, run_dir, write_config
from tests.timing import refusal_bound_s, torch_import_s

pytestmark = pytest.mark.slow
ENV = {**os.environ, **CHILD_ENV}  # the reward pool imports tests.rollout.rewards


def train(cfg: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([TANDEM, "train", str(cfg), *overrides], capture_output=True, text=True, timeout=timeout,
                          env=ENV)


def all_rows(tmp_path: Path) -> list[dict]:
    path = run_dir(tmp_path) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


class Watched:
    """`tandem train` in its own session, its stderr read line by line with arrival times."""

    def __init__(self, cfg: Path, *overrides: str):
        self.start = time.monotonic()
        self.proc = subprocess.Popen([TANDEM, "train", str(cfg), *overrides], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._new = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._new:
                self.lines.append((time.monotonic() - self.start, line.rstrip("\n")))
                self._new.notify_all()

    def wait_for(self, pattern: str, timeout: float = 120) -> tuple[float, str]:
        """The first line matching `pattern` (and when it came), waiting for it."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                for at, line in self.lines:
                    if regex.search(line):
                        return at, line
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None, f"no line matching {pattern!r}:\n{self.text()[-3000:]}"
                self._new.wait(min(left, 1.0))

    def text(self) -> str:
        with self._new:
            return "\n".join(line for _, line in self.lines)

    def finish(self, timeout: float = 60) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def test_second_launch_into_a_trial(tmp_path, model_dir):
    """Outputs without a checkpoint: refused at once, naming the two ways on. overwrite=true starts
    again; once the trial has checkpoints the same command resumes from the latest. That launch
    also meets a run that wrote a step past its last checkpoint (it died in between): the step is
    redone, metrics.jsonl then holds each step once, and the summary counts the steps this run
    trained."""
    cfg = write_config(tmp_path, model_dir, train={"total_steps": 2})
    first = train(cfg)
    assert first.returncode == 0, first.stderr[-3000:]
    start = time.monotonic()
    again = train(cfg)
    took = time.monotonic() - start
    print(f"second launch refused in {took:.1f}s: {again.stderr.strip().splitlines()[-1]}")
    assert again.returncode == 2, again.stderr[-2000:]
    assert "train.overwrite=true" in again.stderr and "experiment.trial=t-2" in again.stderr
    assert "Traceback" not in again.stderr
    assert took < refusal_bound_s()

    fresh = train(cfg, "train.overwrite=true", "train.save_every=1")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert [r["step"] for r in all_rows(tmp_path)] == [0, 1, 2]
    checkpoints = run_dir(tmp_path) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["LATEST", "step00000001", "step00000002"]
    # As if it died before step 2's checkpoint: its directory never renamed into place, LATEST on step 1.
    shutil.rmtree(checkpoints / "step00000002")
    write_pointer(checkpoints / "LATEST", "step00000001")

    launched = time.time()
    resumed = train(cfg, "train.save_every=1", "train.total_steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 1 from" in resumed.stderr and "(found in the trial)" in resumed.stderr
    rows = all_rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 2, redone, once
    first_new = next(r for r in rows if r["step"] == 2)
    print(f"resumed launch: first step done {first_new['time'] - launched:.1f}s after the command started")
    assert "steps: 2 (2-3, resumed at step 1)" in resumed.stdout
    summary = (run_dir(tmp_path) / "summary.txt").read_text()
    assert "steps: 2 (2-3, resumed at step 1)" in summary, summary


def _server_urls(text: str) -> list[str]:
    return re.findall(r"rollout-\d: ready at (http://127\.0\.0\.1:\d+)", text)


def _post(url: str, key: str | None = None) -> int:
    req = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_run_that_talks_binds_loopback_and_stops_on_ctrl_c(tmp_path, model_dir):
    """Before its heavy imports the run says where it writes, then each role with its log and
    readiness time, the first evaluation and the progress bar, into controller.log too. Every
    listener of the run is on 127.0.0.1, and launched servers refuse callers without the run's key
    (which never appears on a command line). Ctrl-C ends it within 5 s with a resume hint and no
    traceback, leaving no process."""
    cfg = write_config(tmp_path, model_dir, train={"total_steps": 500, "save_every": 1},
                       stats={"progress": True})
    run = Watched(cfg)
    try:
        first_at, first = run.wait_for(r".")
        # Before it could have imported torch (its heavy start-up): a fresh `import torch` timed now,
        # on the machine as loaded as it is, is the bound (~1 s against ~3.5 s quiet).
        torch_s = torch_import_s()
        print(f"first line after {first_at:.2f}s (import torch: {torch_s:.2f}s): {first}")
        assert "run directory" in first and str(run_dir(tmp_path)) in first and first_at < torch_s
        for role in ("rollout-0", "rollout-1"):
            run.wait_for(rf"{role}: starting \(log .*logs/{role}\.log\)")
            run.wait_for(rf"{role}: ready at http://127\.0\.0\.1:\d+ after \d+\.\d s")
        run.wait_for(r"actor: starting 2 rank\(s\) \(logs .*actor-rank0\.log, .*actor-rank1\.log\)")
        run.wait_for(r"actor: engine ready on 2 rank\(s\)")
        run.wait_for(r"step 0: eval accuracy \d\.\d+ on 8 items")
        run.wait_for(r"rl: .*\d+/500")  # the progress bar
        run.wait_for(r"step \d+: checkpoint")

        tree = descendants(run.proc.pid)
        listeners = listening_sockets(tree | {run.proc.pid})
        print(f"{len(tree)} processes, listeners: {sorted({(a, p) for _, a, p in listeners})}")
        assert len(listeners) >= 6 and {addr for _, addr, _ in listeners} == {"127.0.0.1"}, listeners
        for url in _server_urls(run.text()):
            assert _post(f"{url}/pause_generation") == 401  # no key: refused (it would stall the run)
        for pid in tree:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert b"api-key" not in f.read()

        log = (run_dir(tmp_path) / "logs" / "controller.log").read_text()
        assert "rollout-1: ready at" in log and "step 0: eval accuracy" in log

        os.killpg(run.proc.pid, signal.SIGINT)  # as a terminal sends it: to the whole foreground group
        sent = time.monotonic()
        rc = run.finish()
        took = time.monotonic() - sent
        text = run.text()
        print(f"Ctrl-C: exit {rc} after {took:.1f}s: {text.splitlines()[-1]}")
        assert rc == 130
        assert took < 5
        assert "Traceback" not in text and "Exception ignored" not in text
        assert re.search(r"interrupted after step \d+ of 500\. The latest checkpoint is .*step\d{8}: run the same "
                         r"command again to resume from it", text)
        assert not wait_gone(tree), "processes left behind after Ctrl-C"
    finally:
        run.kill()


def test_failing_evaluation_rewards_count_as_wrong(tmp_path, model_dir):
    """Evaluation rewards run in the reward pool under task.reward_timeout_s: a reward that hangs
    (ignoring its soft timer) on every eval item makes them count as wrong, and training goes on."""
    cfg = write_config(tmp_path, model_dir, rollout={"reward": "tests.rollout.rewards:eval_hang_reward"},
                       task={"reward_timeout_s": 1.0})
    proc = train(cfg, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = all_rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["eval/failed"] == 8 and rows[0]["eval/accuracy"] == 0.0
    assert rows[-1]["eval/failed"] == 8
    wrong = [line for line in proc.stderr.splitlines()
             if "counts as wrong: tests.rollout.rewards:eval_hang_reward: timed out after 1s (the timeout, "
                "task.reward_timeout_s)" in line]
    assert len([line for line in wrong if "in total]" not in line]) == 2  # once per evaluation, then counted
    assert proc.stderr.count("eval: 8 of 8 items failed and count as wrong") == 2


def test_ctrl_c_during_a_hanging_evaluation(tmp_path, model_dir):
    """A reward that hangs in the first evaluation no longer blocks Ctrl-C. Blocked, the run would
    end only when the 120 s reward timeout let the evaluation go: ending within 60 s is the check
    (the run's own shutdown took 5.3 s with a second `make test` beside it)."""
    cfg = write_config(tmp_path, model_dir, rollout={"reward": "tests.rollout.rewards:eval_hang_reward"},
                       task={"reward_timeout_s": 120.0})
    run = Watched(cfg)
    try:
        run.wait_for(r"actor: engine ready")
        time.sleep(3)  # the evaluation's rewards are hanging in the pool now
        os.killpg(run.proc.pid, signal.SIGINT)
        sent = time.monotonic()
        rc = run.finish()
        took = time.monotonic() - sent
        print(f"Ctrl-C in a hanging evaluation: exit {rc} after {took:.1f}s")
        assert rc == 130 and took < 60
        assert "Traceback" not in run.text()
        assert "No checkpoint was saved" in run.text()
    finally:
        run.kill()


def test_ctrl_c_while_starting(tmp_path, model_dir):
    """Ctrl-C right after the first line, while torch and the run are still loading: exit 130
    without a traceback, whatever the moment."""
    cfg = write_config(tmp_path, model_dir)
    for delay in (0.0, 1.5, 3.0):  # under load, 2 s once landed inside numpy's import
        run = Watched(cfg, "train.overwrite=true")
        try:
            run.wait_for(r"run directory")
            time.sleep(delay)
            os.killpg(run.proc.pid, signal.SIGINT)
            rc = run.finish()
            print(f"Ctrl-C {delay}s after the first line: exit {rc}: {run.text().splitlines()[-1]}")
            assert rc == 130 and "Traceback" not in run.text()
            assert "interrupted" in run.text().splitlines()[-1]
        finally:
            run.kill()
