"""`RunRecorder` writes what the page reads, and `RunStore` reads it back: real files, real
trajectories, staleness and sampling checked by hand."""

from __future__ import annotations

import gzip
import json
import stat

import pytest

from tandem.dashboard.record import DashboardConfig, RunRecorder, staleness
from tandem.dashboard.store import JsonLines, RunStore
from tandem.data.trajectory import Trajectory


def traj(reward: float, versions: list[int], prompt: int = 2) -> Trajectory:
    n = len(versions)
    return Trajectory.from_generation(list(range(1, prompt + 1)), list(range(10, 10 + n)), [-0.5] * n, versions,
                                      reward=reward, prompt_id=f"p{reward}")


def recorder(tmp_path, members=None, resume_step=None, key=None, per_step=2) -> RunRecorder:
    return RunRecorder(tmp_path, DashboardConfig(trajectories_per_step=per_step, fleet_interval_s=60),
                       pieces=lambda ids: [f"<{i}>" for i in ids], text=lambda ids: " ".join(map(str, ids)),
                       members=members, resume_step=resume_step, key=key, seed=3)


def test_staleness_is_the_trainer_version_minus_the_oldest_generated_token():
    assert staleness(traj(0, [4, 5, 5]), 6) == 2  # oldest generated token: version 4
    assert staleness(traj(0, [6, 6]), 6) == 0
    multi = Trajectory([1, 10, 2, 11], [0, 1, 0, 1], [0, -1, 0, -1], [-1, 3, -1, 5])  # a context token between
    assert staleness(multi, 5) == 2
    assert staleness(Trajectory([1, 2], [0, 0], [0, 0], [-1, -1]), 9) == 0  # nothing generated


def test_a_step_is_recorded_whole_and_sampled_reproducibly(tmp_path):
    rec = recorder(tmp_path)
    trajs = [traj(float(i), [3, 4] if i % 2 else [4, 4]) for i in range(6)]
    kept = rec.sample(5, len(trajs))
    assert kept == recorder(tmp_path / "again").sample(5, 6) and len(kept) == 2 and kept == sorted(kept)
    assert rec.sample(6, 6) != kept or rec.sample(7, 6) != kept  # the step seeds the draw
    scored = [[None, None, -0.25, -0.75], [None, None, -0.5, -0.5]]
    rec.record_step(5, 4, trajs, kept, scored)
    rec.flush()
    step = json.loads((tmp_path / "dashboard/steps.jsonl").read_text())
    assert step["staleness"] == {"0": 3, "1": 3} and step["n"] == 6 and step["sampled"] == 2
    assert step["reward_mean"] == pytest.approx(2.5)
    with gzip.open(tmp_path / "dashboard/trajectories/step-000005.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    for n, (row, i) in enumerate(zip(rows, kept, strict=True)):
        t = trajs[i]
        assert row["reward"] == t.reward and row["i"] == n and row["version"] == 4
        assert row["pieces"] == [f"<{x}>" for x in t.input_ids] and row["completion"] == "10 11"
        assert row["mask"] == t.loss_mask and row["versions"] == t.versions and row["logprobs"] == t.logprobs
        assert row["trainer_logprobs"] == scored[n] and row["staleness"] == staleness(t, 4)
    index = [json.loads(line) for line in (tmp_path / "dashboard/trajectories/index.jsonl").read_text().splitlines()]
    assert [(r["step"], r["i"], r["reward"]) for r in index] == [(5, n, trajs[i].reward) for n, i in enumerate(kept)]


def test_the_fleet_is_written_whole_and_its_changes_once(tmp_path):
    fleet = {"version": 1, "servers": [
        {"address": "http://a", "state": "healthy", "version": 1, "in_flight": 3, "tokens_served": 10, "last_error": ""},
        {"address": "http://b", "state": "healthy", "version": 1, "in_flight": 0, "tokens_served": 5, "last_error": ""}]}
    rec = recorder(tmp_path, members=lambda: fleet)
    rec.record_fleet()
    fleet["servers"][0]["in_flight"] = 7  # load alone is not a change
    rec.record_fleet()
    fleet["servers"][1].update(state="evicted", last_error="3 probes failed")
    rec.record_fleet()
    events = RunStore(tmp_path).fleet()["events"]
    assert [(e["address"], e["state"]) for e in events] == [("http://a", "healthy"), ("http://b", "healthy"),
                                                           ("http://b", "evicted")]
    now = json.loads((tmp_path / "dashboard/fleet.json").read_text())
    assert now["servers"][0]["in_flight"] == 7 and now["servers"][1]["last_error"] == "3 probes failed"


def test_a_resumed_run_keeps_the_steps_up_to_its_start_and_the_key_is_private(tmp_path):
    rec = recorder(tmp_path, key="k1")
    for step in (1, 2, 3):
        rec.record_step(step, step - 1, [traj(1.0, [0])], [0])
    rec.close()
    resumed = recorder(tmp_path, resume_step=2)
    assert [json.loads(line)["step"] for line in (tmp_path / "dashboard/steps.jsonl").read_text().splitlines()] == [1, 2]
    resumed.record_step(3, 2, [traj(0.0, [2])], [0])
    resumed.flush()
    store = RunStore(tmp_path)
    assert [r["step"] for r in store.steps()[0]] == [1, 2, 3]
    assert store.trajectory(3, 0)["reward"] == 0.0
    key = tmp_path / "dashboard/key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and store.key() == "k1"
    assert store.trajectories(step=3)["total"] == 1


def test_json_lines_are_read_incrementally_and_again_after_a_rewrite(tmp_path):
    path = tmp_path / "rows.jsonl"
    reader = JsonLines(path)
    assert reader.read() == []
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')  # a row still being written
    assert [r["step"] for r in reader.read()] == [1, 2]
    with path.open("a") as f:
        f.write('p": 3}\n')
    assert [r["step"] for r in reader.read()] == [1, 2, 3]
    path.write_text('{"step": 1}\n')  # a resume rewrote it shorter
    assert [r["step"] for r in reader.read()] == [1]


def test_filters_and_missing_trajectories(tmp_path):
    rec = recorder(tmp_path, per_step=4)
    rec.record_step(1, 0, [traj(r, [0]) for r in (0.0, 1.0, 0.5, 1.0)], [0, 1, 2, 3])
    rec.record_step(2, 1, [traj(r, [0]) for r in (1.0, 0.0)], [0, 1])
    rec.flush()
    store = RunStore(tmp_path)
    assert store.trajectories()["total"] == 6
    assert [(r["step"], r["i"]) for r in store.trajectories(min_reward=1.0)["rows"]] == [(2, 0), (1, 3), (1, 1)]
    assert store.trajectories(staleness=1)["total"] == 2 and store.trajectories(max_reward=0.4, step=1)["total"] == 1
    with pytest.raises(KeyError, match="step 9 has no recorded trajectories"):
        store.trajectory(9, 0)
    with pytest.raises(KeyError, match="2 recorded trajectories, not 3"):
        store.trajectory(2, 2)
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        RunStore(tmp_path / "missing")


def test_a_step_is_written_off_the_callers_thread_and_a_failed_write_leaves_the_next_one(tmp_path, caplog):
    import time

    slow = []

    def pieces(ids):
        if not slow:
            slow.append(1)
            raise OSError("No space left on device")  # the first step's write fails
        time.sleep(0.5)
        return [str(i) for i in ids]

    rec = RunRecorder(tmp_path, DashboardConfig(trajectories_per_step=1), pieces=pieces, text=str)
    began = time.monotonic()
    rec.record_step(1, 0, [traj(1.0, [0])], [0])
    rec.record_step(2, 1, [traj(0.5, [1])], [0])
    queued = time.monotonic() - began
    rec.close()  # drains the queue
    assert queued < 0.2, queued
    assert "could not record a step" in caplog.text and "No space left" in caplog.text
    assert [r["step"] for r in RunStore(tmp_path).steps()[0]] == [2]
