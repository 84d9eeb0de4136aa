"""Chaos soak: a real `tandem train` (the demo config on a tiny model: three launched servers, a
fourth behind a faulty TCP proxy, two trainer ranks) under a seeded random schedule of faults, one
at a time, for about N minutes; a table of what each did to the run.

    .venv/bin/python bench/chaos.py --minutes 10            # appends to docs/benchmarks.md
    .venv/bin/python bench/chaos.py --minutes 2 --no-report  # the CI version (tests/bench/test_chaos.py)

Fault kinds (every kind once, in a random order, then random kinds; the trainer rank last):
- kill: SIGKILL a launched server (`rollout.replace_dead=true` launches a replacement);
- stop: SIGSTOP a launched server for STOP_S (--stop-s), then SIGCONT (it rejoins through warm-up);
- duty: slow a launched server by a stop/continue duty cycle (DUTY_STOP_S of every DUTY_PERIOD_S) for SLOW_S;
- proxy: the proxied server's link gets latency, connection resets and responses cut short (bench/_proxy.py)
  for SLOW_S; registered again if the run evicted it;
- join: `tandem serve --join RUN_DIR`;
- reward: one reward call hangs past `task.reward_timeout_s` (bench/chaos_reward.py);
- rank: SIGKILL trainer rank 1; `recover.retries` relaunches the job from its last checkpoint. A
  relaunch replaces the whole fleet (the servers that joined belong to the old controller), so it is last.

Per fault: detection (kill, stop, duty, proxy: to the server's `evicted` state in what `tandem fleet
--json` shows, asked every 50 ms, "-" when it was not evicted; join: to `healthy`; reward: from the
hang's start to the row that counts its group lost; rank: to the first row of the relaunched job),
the longest step from the fault to the next one (gaps between the rows' wall-clock stamps), its
bound, and the episodes lost (`rollout/lost_total`, summed over relaunches).

Bounds: a server fault's longest step <= interval_s x failure_threshold + the median step +
MARGIN_S; a reward hang's <= reward_timeout_s + the median step + MARGIN_S (a hang is known only at
its timeout); a relaunch <= RELAUNCH_FACTOR x the first launch's start-up (to its first row) + the
median step + MARGIN_S. Episodes lost: 0, but for a reward hang exactly the group it failed (by
design: a group needs every reward; docs/rollout.md). Exits 1, naming each broken bound, when one is
broken, a fault kind was never injected (a fault still waiting when the trainer rank's turn has come
is skipped) or the run did not finish.

The run's length is set in steps (train.total_steps = the minutes over --step-s, a step's time on
this 2-core machine under the faults), the faults at row counts spread over it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _fleet import fleet, rows, start_joiner  # bench/ is on sys.path when run as a script
from _proxy import FaultyProxy
from _report import append_benchmark
from current import record, this_command

from tandem.fleet.run_file import ControllerClient, ControllerFileError, read_controller_file
from tandem.launch.rpc_server import worker_pid

ROOT = Path(__file__).resolve().parent.parent
TANDEM = [sys.executable, "-m", "tandem.cli"]  # this checkout's tandem (PYTHONPATH below), not an installed one


def guarded(cmd: list[str]) -> list[str]:
    """`cmd` under `tandem.launch.guard`: it dies with this script, even SIGKILLed (a test's time
    guard), and takes its own launched processes with it; started from the main thread."""
    return [sys.executable, "-m", "tandem.launch.guard", str(os.getpid()), "--", *cmd]
KINDS = ("kill", "stop", "duty", "proxy", "join", "reward", "rank")
SERVER_KINDS = ("kill", "stop", "duty", "proxy", "join")
# The run's fault settings.
INTERVAL_S, PROBE_TIMEOUT_S, THRESHOLD = 1.0, 1.0, 2
REWARD_TIMEOUT_S = 3.0
COOLDOWN_S = 2.0
SAVE_EVERY = 10
MARGIN_S = 2.0  # the probe's own timeout (eviction <= interval x threshold + timeout) and 1 s of a shared 2-core machine
RELAUNCH_FACTOR = 2.0
# The faults' shapes.
STOP_S = 4.0
SLOW_S = 6.0
DUTY_STOP_S, DUTY_PERIOD_S = 0.5, 1.0
PROXY_IMPAIR = {"latency_s": 0.1, "reset_p": 0.3, "drop_p": 0.2}
SLOT_S = 20.0  # one fault per this many seconds of the run
POLL_S = 0.05
WAIT_S = 90.0  # the longest any one wait for the run (a server to start, a relaunch) may take
REJOIN_S = 30.0  # a server evicted while alive (stopped, slowed) must be healthy again within this


@dataclass
class Fault:
    kind: str
    at_row: int
    target: str = ""
    injected: bool = False
    start_wall: float = 0.0  # time.time(): the rows' clock
    end_wall: float = 0.0
    detected_s: float | None = None
    note: str = ""
    longest_step_s: float | None = None
    bound_s: float = 0.0
    lost: int = 0
    expected_lost: int = 0
    broken: list[str] = field(default_factory=list)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-s", type=float, default=0.18, help="a step's time under the faults, which sizes the run")
    p.add_argument("--no-report", action="store_true", help="print only (no docs/benchmarks.md)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (run logs) and print it")
    p.add_argument("--kinds", default=",".join(KINDS), help="the fault kinds to draw from (to reproduce one)")
    p.add_argument("--stop-s", type=float, default=STOP_S, help="how long a stopped server stays stopped")
    args = p.parse_args()
    args.kinds = tuple(k for k in args.kinds.split(",") if k)
    if unknown := set(args.kinds) - set(KINDS):
        p.error(f"unknown fault kind(s) {sorted(unknown)}; the kinds: {', '.join(KINDS)}")
    return args


def schedule(minutes: float, total_rows: int, rng: random.Random, drawn: tuple[str, ...] = KINDS) -> list[Fault]:
    """Every kind once in a random order, then random kinds (one per SLOT_S), the rank kill last;
    spread evenly over the rows with a random jitter."""
    n = max(len(drawn), round(minutes * 60 / SLOT_S))
    others = [k for k in drawn if k != "rank"]
    kinds = rng.sample(others, len(others))
    kinds += [rng.choice(others) for _ in range(n - len(drawn))] if others else []
    kinds += ["rank"] if "rank" in drawn else []
    first, last = 10, total_rows - 3 * SAVE_EVERY  # the relaunch must find a checkpoint and leave steps to run
    space = (last - first) / max(1, len(kinds) - 1)
    return [Fault(k, min(last, int(first + i * space + rng.uniform(0, space / 3)))) for i, k in enumerate(kinds)]


class Chaos:
    """The run and everything the bench started for it (cleaned up by `close`, whatever happened)."""

    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.model = work / "model"
        self.run = work / "runs" / "chaos" / "t"
        self.hang = work / "hang"
        self.total_steps = max(60, int((args.minutes * 60 - 15) / args.step_s))
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                    "TANDEM_CHAOS_HANG": str(self.hang)}
        self.proc: subprocess.Popen | None = None
        self.extra: list[subprocess.Popen] = []  # joiners and the proxied server
        self.stopped: set[int] = set()
        self.proxy: FaultyProxy | None = None
        self.proxied = ""  # the proxied server's address as the run knows it (the proxy's)
        self.proxied_pid = 0
        self.launched_at = self.startup_s = 0.0
        self.hangs = 0

    # -- the run ------------------------------------------------------------------------------
    def launch(self) -> None:
        from tandem.models.tiny import init_model

        init_model(self.model, preset="tiny", seed=0)
        overrides = [
            f"actor.path={self.model}", f"experiment.fileroot={self.work / 'runs'}", "experiment.name=chaos",
            "experiment.trial=t", "rollout.backend=tandem:d3", f"train.total_steps={self.total_steps}",
            "train.eval_every=0", "task.eval_size=8", "stats.progress=false", "stats.plot=false",
            "stats.tensorboard=false", f"rollout.health.interval_s={INTERVAL_S}",
            f"rollout.health.timeout_s={PROBE_TIMEOUT_S}", f"rollout.health.failure_threshold={THRESHOLD}",
            f"rollout.topology_cooldown_s={COOLDOWN_S}", "rollout.replace_dead=true",
            "rollout.max_head_offpolicyness=2", f"rollout.reward={ROOT / 'bench' / 'chaos_reward.py'}:reward",
            f"task.reward_timeout_s={REWARD_TIMEOUT_S}", f"train.save_every={SAVE_EVERY}", "recover.retries=1",
        ]
        self.launched_at = time.monotonic()
        self.proc = subprocess.Popen(guarded([*TANDEM, "train", str(ROOT / "examples" / "demo.yaml"), *overrides]),
                                     cwd=self.work, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=open(self.work / "train.err", "w"),  # noqa: SIM115 (closed with the process)
                                     start_new_session=True)
        self.wait(lambda: len(rows(self.run)) >= 1, 300, "the run's first step")
        self.startup_s = time.monotonic() - self.launched_at

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, cond, timeout: float, what: str) -> bool:
        """Poll `cond` until it holds (True), the run ends or `timeout` passes (False; raises for a
        start-up that never came)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            if cond():
                return True
            time.sleep(POLL_S)
        if what == "the run's first step":
            raise SystemExit(f"the run never made its first step:\n{self.stderr()[-3000:]}")
        return False

    def stderr(self) -> str:
        path = self.work / "train.err"
        return path.read_text(errors="replace") if path.exists() else ""

    def state(self, address: str) -> str | None:
        return next((s["state"] for s in fleet(self.run) if s["address"] == address), None)

    def healthy(self) -> list[dict]:
        return [s for s in fleet(self.run) if s["state"] == "healthy"]

    # -- the proxied server ---------------------------------------------------------------------
    def start_proxied(self) -> None:
        """A fourth server behind the faulty proxy, registered with the run by the proxy's address."""
        info = read_controller_file(self.run)
        env = {**self.env, "TANDEM_SERVE_API_KEY": info.api_key or ""}
        server = subprocess.Popen(guarded([*TANDEM, "serve", "--model", str(self.model), "--port", "0", "--num-threads",
                                           "1", "--weights-dir", str(self.run / "weights")]), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.extra.append(server)
        port = int(server.stdout.readline().rsplit(":", 1)[-1])
        self.wait(lambda: _health_ok(port), WAIT_S, "the proxied server")
        self.proxy = FaultyProxy(port, seed=self.args.seed)
        self.proxied, self.proxied_pid = f"http://127.0.0.1:{self.proxy.port}", server.pid
        self.register_proxied()

    def register_proxied(self) -> bool:
        try:
            ControllerClient(read_controller_file(self.run)).join(self.proxied, self.proxied_pid)
        except ControllerFileError:
            return False
        return self.wait(lambda: self.state(self.proxied) == "healthy", REJOIN_S, "the proxied server healthy")

    # -- faults ---------------------------------------------------------------------------------
    def victim(self) -> dict | None:
        """A healthy server the run launched, while at least one other server stays healthy."""
        ours = {self.proxied_pid, *(p.pid for p in self.extra)}
        for _ in range(int(WAIT_S / 0.5)):
            healthy = self.healthy()
            launched = [s for s in healthy if s["pid"] and s["pid"] not in ours]
            if len(healthy) >= 2 and launched:
                return self.rng.choice(launched)
            if not self.alive():
                return None
            time.sleep(0.5)
        return None

    def signal(self, pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        elif sig == signal.SIGCONT:
            self.stopped.discard(pid)

    def evicted_within(self, address: str, t0: float, seconds: float) -> float | None:
        """Seconds from t0 to `address` evicted, polled until t0 + seconds; None if it was not."""
        seen = self.wait(lambda: self.state(address) == "evicted", t0 + seconds - time.monotonic(), "eviction")
        return time.monotonic() - t0 if seen else None

    def inject(self, f: Fault) -> None:
        getattr(self, f"fault_{f.kind}")(f)

    @staticmethod
    def begin(f: Fault, target: str) -> float:
        """Mark `f` injected on `target` now; -> the monotonic time of it."""
        f.target, f.injected, f.start_wall = target, True, time.time()
        return time.monotonic()

    def healthy_again(self, f: Fault, address: str) -> str:
        """Wait (REJOIN_S) for a server evicted while alive to be healthy again (broken if the run
        goes on without it); -> a note."""
        t0 = time.monotonic()
        if self.wait(lambda: self.state(address) == "healthy", REJOIN_S, "healthy again"):
            return f"healthy {time.monotonic() - t0:.1f} s after"
        if self.alive():
            f.broken.append(f"{f.kind} at row {f.at_row}: {address} not healthy again within {REJOIN_S:.0f} s")
        return f"not healthy again within {REJOIN_S:.0f} s"

    def fault_kill(self, f: Fault) -> None:
        v = self.victim()
        if v is None:
            return
        before = len(self.healthy())
        t0 = self.begin(f, v["address"])
        self.signal(v["pid"], signal.SIGKILL)
        f.detected_s = self.evicted_within(v["address"], t0, WAIT_S)
        back = self.wait(lambda: len(self.healthy()) >= before, WAIT_S, "a replacement")
        f.note = f"replacement healthy after {time.monotonic() - t0:.1f} s" if back else "no replacement seen"

    def fault_stop(self, f: Fault) -> None:
        v = self.victim()
        if v is None:
            return
        t0 = self.begin(f, v["address"])
        self.signal(v["pid"], signal.SIGSTOP)
        f.detected_s = self.evicted_within(v["address"], t0, self.args.stop_s)
        time.sleep(max(0.0, t0 + self.args.stop_s - time.monotonic()))
        self.signal(v["pid"], signal.SIGCONT)
        f.note = f"stopped {self.args.stop_s:.0f} s; {self.healthy_again(f, v['address'])} SIGCONT"

    def fault_duty(self, f: Fault) -> None:
        v = self.victim()
        if v is None:
            return
        t0 = self.begin(f, v["address"])
        while time.monotonic() < t0 + SLOW_S and self.alive():
            self.signal(v["pid"], signal.SIGSTOP)
            time.sleep(DUTY_STOP_S)
            self.signal(v["pid"], signal.SIGCONT)
            end = time.monotonic() + DUTY_PERIOD_S - DUTY_STOP_S
            while time.monotonic() < end:
                if f.detected_s is None and self.state(v["address"]) == "evicted":
                    f.detected_s = time.monotonic() - t0
                time.sleep(POLL_S)
        f.note = f"stopped {DUTY_STOP_S:.1f} s of every {DUTY_PERIOD_S:.1f} s for {SLOW_S:.0f} s"
        if f.detected_s is not None:
            f.note += f"; {self.healthy_again(f, v['address'])}"

    def fault_proxy(self, f: Fault) -> None:
        assert self.proxy is not None
        if self.state(self.proxied) != "healthy" and not self.register_proxied():
            return
        t0 = self.begin(f, self.proxied)
        before = dict(self.proxy.counts)
        self.proxy.impair(**PROXY_IMPAIR)
        f.detected_s = self.evicted_within(self.proxied, t0, SLOW_S)
        time.sleep(max(0.0, t0 + SLOW_S - time.monotonic()))
        self.proxy.impair()
        did = {k: v - before.get(k, 0) for k, v in self.proxy.counts.items() if k in ("resets", "drops")}
        f.note = (f"{PROXY_IMPAIR['latency_s']:.2f} s a chunk, {did.get('resets', 0)} resets, "
                  f"{did.get('drops', 0)} responses cut for {SLOW_S:.0f} s")
        if f.detected_s is not None:
            f.note += "; registered again" if self.register_proxied() else "; not healthy again"

    def fault_join(self, f: Fault) -> None:
        t0 = self.begin(f, "")
        proc, address = start_joiner(guarded(TANDEM), self.model, self.run)
        self.extra.append(proc)
        f.target = address
        if self.wait(lambda: self.state(address) == "healthy", WAIT_S, "the joiner healthy"):
            f.detected_s = time.monotonic() - t0
        f.note = "to healthy (start-up, registration, warm-up, admission)"

    def fault_reward(self, f: Fault) -> None:
        log = Path(f"{self.hang}.log")
        seen = len(log.read_text().splitlines()) if log.exists() else 0
        self.begin(f, "one reward call")
        self.hang.touch()
        if not self.wait(lambda: not self.hang.exists(), WAIT_S, "a reward call"):
            f.note = "no reward call took the hang"
            return
        self.hangs += 1
        f.expected_lost = 1
        self.wait(lambda: log.exists() and len(log.read_text().splitlines()) > seen, 10, "the hang's log")
        started = float(log.read_text().splitlines()[-1]) if log.exists() else f.start_wall
        lost_before = lost_total(rows(self.run), before=started)
        if self.wait(lambda: lost_total(rows(self.run)) > lost_before, WAIT_S, "the group lost"):
            f.detected_s = next(r["time"] for r in rows_with_lost(rows(self.run)) if r["lost"] > lost_before) - started
        f.note = f"task.reward_timeout_s={REWARD_TIMEOUT_S:.0f}"

    def fault_rank(self, f: Fault) -> None:
        assert self.proc is not None
        pid = worker_pid("actor-rank1", self.proc.pid)
        if pid is None:
            return
        first = read_controller_file(self.run)
        t0 = self.begin(f, "actor-rank1")
        os.kill(pid, signal.SIGKILL)

        def relaunched() -> bool:
            try:
                return read_controller_file(self.run).token != first.token
            except ControllerFileError:
                return False

        if not self.wait(relaunched, WAIT_S * 2, "the relaunch"):
            f.note = "no relaunch seen"
            return
        n = len(rows(self.run))
        if self.wait(lambda: len(rows(self.run)) > n, WAIT_S * 2, "the relaunch's first row"):
            f.detected_s = time.monotonic() - t0
        f.note = "to the relaunched job's first row (every server launched anew)"

    # -- cleanup --------------------------------------------------------------------------------
    def close(self) -> None:
        for pid in list(self.stopped):
            self.signal(pid, signal.SIGCONT)
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        for p in self.extra:
            if p.poll() is None:
                p.kill()
                p.wait(30)
            if p.stdout is not None:
                p.stdout.close()
        if self.proxy is not None:
            self.proxy.close()


def _health_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def rows_with_lost(all_rows: list[dict]) -> list[dict]:
    """The rows with `lost`: `rollout/lost_total` summed over the job's launches (the counter starts
    at 0 again in a relaunched job, whose rows start again at its checkpoint's step)."""
    out, base, prev = [], 0, 0
    for i, r in enumerate(all_rows):
        count = int(r.get("rollout/lost_total", 0))
        if i and (r["step"] <= all_rows[i - 1]["step"] or count < prev):
            base += prev
        prev = count
        out.append({**r, "lost": base + count})
    return out


def lost_total(all_rows: list[dict], before: float | None = None) -> int:
    counted = [r for r in rows_with_lost(all_rows) if before is None or r["time"] <= before]
    return counted[-1]["lost"] if counted else 0


def measure(faults: list[Fault], all_rows: list[dict], median: float, startup_s: float) -> None:
    """Each injected fault's window (to the next one's start, or the run's last row before its final
    evaluation): its longest step, bound and losses."""
    counted = all_rows[:-1]  # the last row also waits for the final evaluation
    done = [f for f in faults if f.injected]
    for f, nxt in zip(done, [*done[1:], None], strict=True):
        f.end_wall = nxt.start_wall if nxt else (counted[-1]["time"] if counted else f.start_wall)
        gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(counted)
                if f.start_wall < b["time"] <= f.end_wall]
        f.longest_step_s = max(gaps) if gaps else None
        f.bound_s = (RELAUNCH_FACTOR * startup_s if f.kind == "rank"
                     else REWARD_TIMEOUT_S if f.kind == "reward" else INTERVAL_S * THRESHOLD) + median + MARGIN_S
        end = f.end_wall if nxt else float("inf")
        f.lost = lost_total(all_rows, end) - lost_total(all_rows, f.start_wall)
        if f.longest_step_s is not None and f.longest_step_s > f.bound_s:
            f.broken.append(f"{f.kind} at row {f.at_row}: a step of {f.longest_step_s:.2f} s > its bound "
                            f"{f.bound_s:.2f} s")
        if f.lost != f.expected_lost:
            f.broken.append(f"{f.kind} at row {f.at_row}: {f.lost} episode(s) lost, expected {f.expected_lost}")
        if f.kind == "rank" and f.detected_s is None:
            f.broken.append(f"rank at row {f.at_row}: {f.note}")


def secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(faults: list[Fault]) -> str:
    lines = ["| # | row | fault | target | detected (s) | longest step after (s) | bound (s) | episodes lost | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, f in enumerate(faults, 1):
        if not f.injected:
            lines.append(f"| {i} | {f.at_row} | {f.kind} | not injected |  |  |  |  | {f.note} |")
            continue
        mark = " **broken**" if f.broken else ""
        lines.append(f"| {i} | {f.at_row} | {f.kind} | {f.target} | {secs(f.detected_s)} | "
                     f"{secs(f.longest_step_s)}{mark} | {f.bound_s:.2f} | {f.lost} | {f.note} |")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the cleanup below
    work = Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    chaos = Chaos(args, work)
    faults = schedule(args.minutes, chaos.total_steps, chaos.rng, args.kinds)
    t_start = time.monotonic()
    try:
        chaos.launch()
        chaos.start_proxied()
        rank_row = next((f.at_row for f in faults if f.kind == "rank"), None)
        for f in faults:
            if not chaos.wait(lambda f=f: len(rows(chaos.run)) >= f.at_row, args.minutes * 60 + 600, "its row"):
                f.note = "the run had ended"
                continue
            if f.kind != "rank" and rank_row is not None and len(rows(chaos.run)) >= rank_row:
                f.note = "skipped: the faults before it ran late, and the trainer rank's turn had come"
                continue
            chaos.inject(f)
            print(f"[{time.monotonic() - t_start:6.1f} s] {f.kind} at row {f.at_row}: {f.target or 'skipped'} "
                  f"detected {secs(f.detected_s)} s {f.note}", flush=True)
        assert chaos.proc is not None
        chaos.proc.wait(args.minutes * 60 + 900)
    finally:
        chaos.close()
    wall = time.monotonic() - t_start
    finished = chaos.proc.returncode == 0
    all_rows = rows(chaos.run)
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(all_rows[:-1])]
    median = statistics.median(gaps) if gaps else 0.0
    measure(faults, all_rows, median, chaos.startup_s)
    broken = [b for f in faults for b in f.broken]
    kinds = {k: sum(f.kind == k and f.injected for f in faults) for k in args.kinds}
    broken += [f"{k}: never injected ({'; '.join(f.note for f in faults if f.kind == k)})"
               for k, n in kinds.items() if not n]
    if not finished:
        broken.append(f"the run did not finish (exit {chaos.proc.returncode}): {chaos.stderr()[-2000:]}")
    total_lost = lost_total(all_rows)
    expected_lost = sum(f.expected_lost for f in faults)
    if total_lost != expected_lost:
        broken.append(f"{total_lost} episode(s) lost in all, expected {expected_lost} (one per reward hang)")
    last = all_rows[-1] if all_rows else {}
    worst = max((f for f in faults if f.longest_step_s is not None), key=lambda f: f.longest_step_s / f.bound_s,
                default=None)
    summary = [
        f"`tandem train` of examples/demo.yaml on a tiny model: 3 launched servers + 1 behind a faulty proxy, 2 "
        f"trainer ranks, {chaos.total_steps} steps, staleness 2, `rollout.health` interval {INTERVAL_S:.0f} s x "
        f"threshold {THRESHOLD} (probe timeout {PROBE_TIMEOUT_S:.0f} s), reward timeout {REWARD_TIMEOUT_S:.0f} s, "
        f"`recover.retries=1`, checkpoints every {SAVE_EVERY} steps; seed {args.seed}, {wall / 60:.1f} min in all. "
        f"`{this_command()}`.",
        "",
        table(faults),
        "",
        f"- run finished: {'yes' if finished else 'no'}; {len(all_rows)} metrics rows; start-up {chaos.startup_s:.1f} s; "
        f"median step {median:.2f} s",
        "- faults injected: " + ", ".join(f"{k} {n}" for k, n in kinds.items()),
        f"- episodes lost: {total_lost} (reward hangs taken: {chaos.hangs}); generation calls resubmitted: "
        f"{int(last.get('rollout/resubmitted_total', 0))} (last launch)",
        f"- worst step against its bound: {secs(worst.longest_step_s)} s of {worst.bound_s:.2f} s ({worst.kind})"
        if worst else "- worst step: no steps measured",
        "- bounds broken: " + ("; ".join(broken) if broken else "none"),
    ]
    body = "\n".join(summary)
    print(body)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "finished": finished, "returncode": chaos.proc.returncode, "faults": [asdict(f) for f in faults],
            "kinds": kinds, "lost": total_lost, "expected_lost": expected_lost, "median_step_s": median,
            "startup_s": chaos.startup_s, "broken": broken, "wall_s": wall, "rows": len(all_rows)}, indent=1))
    if not args.no_report:
        append_benchmark("Chaos soak: faults of every kind in a running job", body)
        record("chaos", f"{sum(kinds.values())} faults of {len(kinds)} kinds, {total_lost} episodes lost "
                        f"({chaos.hangs} reward hangs), worst step {secs(worst.longest_step_s if worst else None)} s",
               f"bound {worst.bound_s:.2f} s" if worst else "", "", this_command())
    if args.keep:
        print(f"work directory: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if broken:
        print("chaos: bounds broken:\n- " + "\n- ".join(broken), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
