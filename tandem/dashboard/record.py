"""`RunRecorder`: what a run writes into `RUN_DIR/dashboard/` for `tandem dashboard` to show.

- `fleet.json`: the fleet now (each server's state, weight version, in-flight requests, tokens
  served, last error), replaced atomically every `fleet_interval_s` and at each step's end;
- `fleet-events.jsonl`: each change of a server's state or last error (time, step, address, state,
  version, last error), each server's history;
- `fleet-steps.jsonl`: at each step's end, how many servers were in each state and at each weight
  version, and the requests in flight and tokens served over all of them, the fleet's history;
- `steps.jsonl`: per step, the staleness histogram of every trajectory trained on (trainer version
  minus the oldest version among its generated tokens), reward mean, how many were kept, and the
  seconds the writing took (`write_s`);
- `trajectories/step-NNNNNN.jsonl.gz`: a sample of the step's trajectories (at most
  `trajectories_per_step`, drawn with a generator seeded by the step), each with its tokens as
  text pieces, loss mask, per-token weight version, behaviour logprob and (when the run scores
  them, `trainer_logprobs`) the trainer's logprob at the weights it trained those tokens with,
  reward and staleness;
  `trajectories/index.jsonl`, one small row per sampled trajectory, for filtering.

A resumed run keeps the rows of the steps up to the one it resumes at and drops the later ones,
as `metrics.jsonl` does. A step's files are written by a thread of the recorder's own, off the
training loop's path; the fleet is polled on another. The files are the contract with
`tandem.dashboard.store`.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.config.fields import config_field as _f
from tandem.data.trajectory import PROMPT_VERSION, Trajectory

logger = logging.getLogger(__name__)

DIRECTORY = "dashboard"
KEY_FILE = "key"  # the page's bearer key, mode 0600 (absent: the page needs none)
FLEET_FIELDS = ("address", "state", "version", "in_flight", "tokens_served", "last_error")


@dataclass
class DashboardConfig:
    enabled: bool = _f(True, "Record what `tandem dashboard RUN_DIR` shows (fleet, step timeline, trajectories) "
                             "into RUN_DIR/dashboard.")
    trajectories_per_step: int = _f(16, "Trajectories of each step kept for the page's trajectory browser.", min=0)
    fleet_interval_s: float = _f(2.0, "Record the fleet's state this often (and at each step's end).", gt=0.0)
    trainer_logprobs: bool = _f(False, "Also score the kept trajectories on the trainer (one more forward of "
                                       "those sequences a step, before the update) for the page's per-token "
                                       "|server - trainer| logprob difference: 6-13% of a step on CPU "
                                       "(bench/dashboard.py).")


def staleness(traj: Trajectory, version: int) -> int:
    """`version` (the trainer's, before the step) minus the oldest version among the generated
    tokens; 0 for a trajectory with none."""
    generated = [v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m and v != PROMPT_VERSION]
    return version - min(generated) if generated else 0


class RunRecorder:
    """One run's recorder: `start` polls the fleet, `sample` + `record_step` record each step,
    `close` writes what is queued and the fleet a last time."""

    def __init__(self, run_dir: Path, config: DashboardConfig, *, pieces: Callable[[list[int]], list[str]],
                 text: Callable[[list[int]], str], members: Callable[[], dict[str, Any]] | None = None,
                 resume_step: int | None = None, key: str | None = None, seed: int = 0):
        """`pieces`: token ids -> one text piece per id; `text`: token ids -> their text;
        `members`: the fleet now (the controller's `members()`); `resume_step`: the step a resumed
        run starts at (None: a fresh run); `key`: the page's key, written to `dashboard/key` (0600)."""
        self.config, self._pieces, self._text, self._members, self._seed = config, pieces, text, members, seed
        self.root = run_dir / DIRECTORY
        (self.root / "trajectories").mkdir(parents=True, exist_ok=True)
        for name in ("steps.jsonl", "fleet-steps.jsonl", "trajectories/index.jsonl"):
            _keep_steps(self.root / name, resume_step)
        if resume_step is None:
            with contextlib.suppress(FileNotFoundError):
                (self.root / "fleet-events.jsonl").unlink()
        if key is not None:
            path = self.root / KEY_FILE
            path.touch(mode=0o600)
            path.chmod(0o600)
            path.write_text(key)
        self.step = resume_step or 0
        self._last: dict[str, tuple[Any, ...]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # polls the fleet
        self._jobs: queue.Queue[tuple | None] = queue.Queue()
        self._writer: threading.Thread | None = None  # writes the steps

    # -- the fleet ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Poll the fleet every `fleet_interval_s` until `close`."""
        if self._members is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._poll, name="tandem-dashboard", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.record_fleet()
            self._stop.wait(self.config.fleet_interval_s)

    def record_fleet(self, step_end: bool = False) -> None:
        """The fleet now: `fleet.json` replaced, changes appended to `fleet-events.jsonl`; at a
        step's end (`step_end`) a row of `fleet-steps.jsonl` too."""
        if self._members is None:
            return
        try:
            members = self._members()
        except Exception:  # the controller is going away: the last snapshot stays
            logger.debug("no fleet snapshot", exc_info=True)
            return
        now = time.time()
        servers = [{k: s.get(k) for k in FLEET_FIELDS} for s in members.get("servers", [])]
        with self._lock:
            events = []
            for s in servers:
                seen = (s["state"], s["last_error"])
                if self._last.get(s["address"]) != seen:
                    self._last[s["address"]] = seen
                    events.append({"time": now, "step": self.step, **{k: s[k] for k in
                                                                      ("address", "state", "version", "last_error")}})
            if events:
                with (self.root / "fleet-events.jsonl").open("a") as f:
                    f.write("".join(json.dumps(e) + "\n" for e in events))
            _write_atomic(self.root / "fleet.json", json.dumps(
                {"time": now, "step": self.step, "version": members.get("version"), "servers": servers}))
            if step_end:
                with (self.root / "fleet-steps.jsonl").open("a") as f:
                    f.write(json.dumps({
                        "step": self.step, "time": now,
                        "states": dict(Counter(str(s["state"]) for s in servers)),
                        "versions": {str(v): n for v, n in Counter(s["version"] for s in servers).items()},
                        "in_flight": sum(s["in_flight"] or 0 for s in servers),
                        "tokens_served": sum(s["tokens_served"] or 0 for s in servers)}) + "\n")

    # -- steps ------------------------------------------------------------------------------------------
    def sample(self, step: int, n: int) -> list[int]:
        """Which of step `step`'s `n` trajectories are kept: at most `trajectories_per_step`, drawn
        by a generator seeded by the run's seed and the step, in order."""
        k = min(self.config.trajectories_per_step, n)
        return sorted(random.Random(self._seed * 1_000_003 + step).sample(range(n), k))

    def record_step(self, step: int, version: int, trajs: Sequence[Trajectory], kept: Sequence[int],
                    trainer_logprobs: Sequence[Sequence[float | None]] | None = None) -> None:
        """Step `step`'s trajectories (trained at trainer version `version`), `kept` (from
        `sample`) written whole with, if given, each one's trainer logprobs (input alignment, None
        where not scored). Queued: the writer thread decodes and writes (`flush` waits for it), so
        the caller pays for none of it. The trajectories must not change afterwards."""
        self._jobs.put((step, version, list(trajs), list(kept), trainer_logprobs))
        if self._writer is None:
            self._writer = threading.Thread(target=self._write, name="tandem-dashboard-writer", daemon=True)
            self._writer.start()

    def flush(self) -> None:
        """Return once every step recorded so far is written."""
        self._jobs.join()

    def _write(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._write_step(*job)
            except Exception:  # a full disk, say: the run goes on, the page misses this step
                logger.exception("the dashboard could not record a step")
            finally:
                self._jobs.task_done()

    def _write_step(self, step: int, version: int, trajs: list[Trajectory], kept: list[int],
                    trainer_logprobs: Sequence[Sequence[float | None]] | None) -> None:
        began = time.perf_counter()
        stale = [staleness(t, version) for t in trajs]
        rows, index = [], []
        for n, i in enumerate(kept):
            t = trajs[i]
            rows.append(self._trajectory(step, version, n, t, stale[i],
                                         trainer_logprobs[n] if trainer_logprobs is not None else None))
            index.append({"step": step, "i": n, "reward": t.reward, "staleness": stale[i],
                          "tokens": len(t.input_ids), "turns": t.num_turns})
        with gzip.open(self.root / "trajectories" / f"step-{step:06d}.jsonl.gz", "wt", compresslevel=5) as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        with (self.root / "trajectories" / "index.jsonl").open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in index))
        rewards = [t.reward for t in trajs]
        with (self.root / "steps.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), "version": version, "n": len(trajs),
                                "staleness": {str(s): n for s, n in sorted(Counter(stale).items())},
                                "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                                "sampled": len(kept), "write_s": time.perf_counter() - began}) + "\n")
        self.step = step
        self.record_fleet(step_end=True)

    def _trajectory(self, step: int, version: int, i: int, t: Trajectory, stale: int,
                    trainer: Sequence[float | None] | None) -> dict[str, Any]:
        mask = list(t.loss_mask)
        return {"step": step, "i": i, "version": version, "prompt_id": t.prompt_id, "reward": t.reward,
                "staleness": stale, "turns": t.num_turns, "finish": list(t.finish_reasons),
                "pieces": self._pieces(list(t.input_ids)),
                "completion": self._text([x for x, m in zip(t.input_ids, mask, strict=True) if m]),
                "mask": mask, "versions": list(t.versions), "logprobs": [round(x, 6) for x in t.logprobs],
                "trainer_logprobs": None if trainer is None else [None if x is None else round(x, 6) for x in trainer]}

    def close(self) -> None:
        """Write what is queued, stop polling, and record the fleet a last time."""
        if self._writer is not None:
            self._jobs.put(None)
            self._writer.join(60)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.record_fleet()


def _keep_steps(path: Path, step: int | None) -> None:
    """Keep `path`'s rows of steps up to `step` (None: none)."""
    rows = []
    if step is not None and path.is_file():
        rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    _write_atomic(path, "".join(r + "\n" for r in rows))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
