"""`tandem train` as a user runs it: real servers, real trainer ranks, real weight sync.

Each test starts the command as a subprocess with a tiny model on 127.0.0.1 and reads what the run
wrote (metrics, plot, event files), or signals it and checks that nothing of it remains.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch.procs import cmdline, descendants, wait_gone
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config

pytestmark = pytest.mark.slow


def test_staleness_zero_gives_ratio_one_and_no_mismatch(tmp_path, model_dir):
    """Synchronous setting: the first PPO minibatch's ratio is exactly 1 and the servers' logprobs
    equal the trainer's (fp32, CPU); the run leaves its plot, event files and summary, and
    evaluates after every step (train.eval_every=1)."""
    cfg = write_config(tmp_path, model_dir, rollout={"max_head_offpolicyness": 0},
                       train={"total_steps": 2, "eval_every": 1})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval accuracy:" in proc.stdout
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ppo/ratio_max"] == 1.0 and r["ppo/ratio"] == 1.0
        assert r["ppo/clip_frac"] == 0.0
        assert r["mismatch/max"] <= 1e-5, r["mismatch/max"]
        assert r["mismatch/n_tokens"] > 0
        assert r["staleness/max"] == 0.0  # every token from the trainer's current version
        assert r["version"] == r["step"]
        assert "eval/accuracy" in r  # every step, not only the last
    out = run_dir(tmp_path)
    assert (out / "plot.png").stat().st_size > 10_000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert "eval accuracy" in (out / "summary.txt").read_text()


def _start(tmp_path: Path, model: Path) -> subprocess.Popen:
    cfg = write_config(tmp_path, model, train={"total_steps": 200})
    return subprocess.Popen([TANDEM, "train", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_for_steps(tmp_path: Path, proc: subprocess.Popen, steps: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while len(rl_rows(tmp_path)) < steps:  # bounded by the deadline; the run writes a row per step
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.5)


def _trainer_rank(pids: set[int], rank: int) -> int:
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tandem.train.worker" in cmd and f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no trainer rank {rank} among {sorted(pids)}")


def test_trainer_crash_ends_the_run_naming_the_rank(tmp_path, model_dir):
    proc = _start(tmp_path, model_dir)
    try:
        _wait_for_steps(tmp_path, proc, 1)
        tree = descendants(proc.pid)
        os.kill(_trainer_rank(tree, 1), signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed_at
        assert proc.returncode != 0
        assert "rank 1" in err and "SIGKILL" in err, err[-3000:]
        assert took < 30, f"the run noticed the crash after {took:.1f}s"
        assert not wait_gone(tree), "processes left behind after the crash"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _server(pids: set[int], index: int) -> int:
    for pid in pids:
        if "-m tandem.cli serve" in cmdline(pid) and f"rollout-{index}.log" in _log_of(pid):
            return pid
    raise AssertionError(f"no server {index} among {sorted(pids)}")


def _log_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def test_when_every_server_died_the_run_ends_naming_them(tmp_path, model_dir):
    """Both launched servers killed mid-run: each leaves the fleet at once (the launcher saw it
    exit), rollouts wait for servers, and after rollout.min_servers_grace_s with none healthy the
    run ends with an error that names the servers, how they died and their logs."""
    cfg = write_config(tmp_path, model_dir, train={"total_steps": 200}, rollout={"min_servers_grace_s": 5})
    proc = subprocess.Popen([TANDEM, "train", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _wait_for_steps(tmp_path, proc, 1)
        tree = descendants(proc.pid)
        for i in (0, 1):
            os.kill(_server(tree, i), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        log = run_dir(tmp_path) / "logs" / "rollout-1.log"
        assert f"exited (killed by SIGKILL); it leaves the fleet (log {log})" in err, err[-3000:]
        assert "fewer than rollout.min_servers=1" in err and "rollout.min_servers_grace_s" in err, err[-3000:]
        assert not wait_gone(tree), "processes left behind"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_default_asynchronous_loop_keeps_its_bound_and_learns(tmp_path, model_dir):
    """The loop users run by default (staleness 1, two servers, two trainer ranks) against what it
    promises: no step trains a token more than one version old, tokens sampled by the trainer's
    current weights have the trainer's logprobs (<= 1e-5: the same weights on both sides; with the
    fleet one step ahead that is step 1's batch), and the reward rises on a task the tiny model
    learns in twelve steps (the parity of its one generated token; 64 samples a step). Catches a
    staleness bound off by one, weights that reach the servers late or wrong, and a loop whose
    updates do not improve the policy. Also what some keys leave out: with stats.plot and
    stats.tensorboard off the run writes neither, without train.eval_every it evaluates only before
    and after training, and train.keep_checkpoints=1 keeps only the newest checkpoint."""
    cfg = write_config(tmp_path, model_dir, actor={"optimizer": {"lr": 1e-2}},
                       rollout={"max_head_offpolicyness": 1, "consumer_batch_size": 8,
                                "reward": "tests.rollout.rewards:parity_reward"},
                       gen={"n_samples": 8, "max_new_tokens": 1}, task={"eval_size": 4},
                       train={"total_steps": 12, "save_every": 4, "keep_checkpoints": 1},
                       stats={"progress": False, "plot": False, "tensorboard": False})
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert max(r["staleness/max"] for r in rows) == 1.0  # asynchronous: one step ahead happens...
    assert all(r["staleness/max"] <= 1.0 for r in rows)  # ...and never more
    current = [r for r in rows if r["mismatch/current_n_tokens"] > 0]
    assert current and all(r["mismatch/current_max"] <= 1e-5 for r in current), \
        [r["mismatch/current_max"] for r in current]
    first, last = (sum(r["reward/mean"] for r in part) / 3 for part in (rows[:3], rows[-3:]))
    print(f"\n[async loop] reward {first:.3f} (steps 1-3) -> {last:.3f} (steps 10-12)")
    assert last >= first + 0.1, (first, last)
    assert ["eval/accuracy" in r for r in rows] == [False] * 11 + [True]
    out = run_dir(tmp_path)
    assert not (out / "plot.png").exists() and not (out / "tensorboard").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["LATEST", "step00000012"]
