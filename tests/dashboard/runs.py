"""Run directories for the dashboard's tests, written by the run's own writers (`MetricsLogger`,
`RunRecorder`), and `tandem dashboard` started on one as a real process."""

from __future__ import annotations

import json
import math
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tandem.dashboard.record import DashboardConfig, RunRecorder
from tandem.data.trajectory import Trajectory
from tandem.rl.metrics import MetricsLogger

TANDEM = str(Path(sys.executable).with_name("tandem"))
WORDS = ["the", " answer", " is", " 4", "2", ".", " so", " we", " add", " them"]


def write_run(run_dir: Path, steps: int, per_step: int, servers: int = 4, key: str | None = None,
              completion_tokens: int = 48) -> Path:
    """A finished run of `steps` steps with `per_step` trajectories each, all of them kept."""
    rng = random.Random(0)
    run_dir.mkdir(parents=True, exist_ok=True)
    fleet = {"version": 0, "servers": [
        {"address": f"http://10.0.0.{i}:30000", "state": "healthy", "version": 0, "in_flight": 0,
         "tokens_served": 0, "last_error": ""} for i in range(servers)]}
    metrics = MetricsLogger(run_dir, tensorboard=False)
    rec = RunRecorder(run_dir, DashboardConfig(trajectories_per_step=per_step, trainer_logprobs=True),
                      pieces=lambda ids: [WORDS[i % len(WORDS)] for i in ids],
                      text=lambda ids: "".join(WORDS[i % len(WORDS)] for i in ids),
                      members=lambda: fleet, key=key)
    for step in range(1, steps + 1):
        version = step - 1
        trajs = []
        for k in range(per_step):
            behind = rng.choice([0, 0, 0, 1, 1, 2])
            n = completion_tokens
            logprobs = [-rng.random() * 2 for _ in range(n)]
            trajs.append(Trajectory.from_generation([1, 2, 3, 4], [rng.randrange(50) for _ in range(n)], logprobs,
                                                    [max(0, version - behind)] * n, reward=float(k % 3 == 0),
                                                    prompt_id=f"item-{step}-{k}"))
        kept = rec.sample(step, len(trajs))
        scored = [[None] * 4 + [x + rng.gauss(0, 0.01) for x in trajs[i].logprobs[4:]] for i in kept]
        for s in fleet["servers"]:
            s["version"], s["tokens_served"] = version, s["tokens_served"] + 100
        if step == steps // 2:
            fleet["servers"][0].update(state="evicted", last_error="3 probes failed in a row")
        began = time.perf_counter()
        rec.record_step(step, version, trajs, kept, scored)
        rec.flush()  # the fleet above changes at the next step: its step-end row is this one's
        seconds = time.perf_counter() - began
        metrics.log(step, {"reward/mean": sum(t.reward for t in trajs) / len(trajs),
                           "train/loss": math.exp(-step / 200) + rng.gauss(0, 0.02), "ppo/approx_kl": 0.01,
                           "mismatch/mean": 0.002, "mismatch/max": 0.05, "time/generation": 1 + rng.random(),
                           "time/train": 2.0, "time/sync": 0.3, "time/dashboard": seconds,
                           **({"eval/accuracy": step / steps} if step % 10 == 0 else {})})
    metrics.close()
    rec.close()
    (run_dir / "summary.txt").write_text(f"steps: {steps}\n")
    return run_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dashboard:
    """`tandem dashboard RUN_DIR --port P` as a process; `url` is the one it printed."""

    def __init__(self, run_dir: Path, *extra: str):
        self.port = free_port()
        self.proc = subprocess.Popen([TANDEM, "dashboard", str(run_dir), "--port", str(self.port), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # printed before it serves
        assert line.startswith("tandem dashboard:"), (line, self.proc.stderr.read() if self.proc.poll() else "")
        self.url = line.split(" at ", 1)[1].strip()
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while True:  # bounded: until it answers (any status) or 30 s
            try:
                urllib.request.urlopen(self.base + "/api/run", timeout=2)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                assert self.proc.poll() is None, self.proc.stderr.read()
                assert time.monotonic() < deadline, "tandem dashboard did not answer within 30 s"
                time.sleep(0.1)

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        request = urllib.request.Request(self.base + path, headers=headers or {})
        opener = urllib.request.build_opener(NoRedirect)
        try:
            with opener.open(request, timeout=10) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()
        self.proc.stderr.close()

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def json_of(body: bytes):
    return json.loads(body)
