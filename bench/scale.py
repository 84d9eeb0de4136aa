"""How the control plane scales (issue 49): the real `RolloutController` (membership, health
monitor, executor, staleness manager, client, fleet operations) against N simulated servers
(bench/_simfleet.py: real HTTP on loopback, many servers per process), and the dispatch
boundary at 8/64/512 simulated trainer ranks.

    .venv/bin/python bench/scale.py [--servers 10,100,1000] [--steps 3] [--no-append]

For each N, with the default health settings (a probe every 5 s, 3 failures evict):
- idle: the health monitor's CPU (its thread's, from /proc) and the whole process's over 15 s;
- steps: `--steps` RL steps against instant servers, each a batch of max(512, 4N) one-call
  episodes, its split for R ranks (N=10: 8, 100: 64, 1000: 512; Karmarkar-Karp on tokens) and one
  disk weight update as a trainer runs it (`run_update`: the staged load, then the commit, which
  aborts in-flight requests and announces the version; no tensors). Figures: requests/s the
  controller sustains (its ceiling: the servers answer at once), its CPU per 1,000 requests
  (rollout only) and per step (all of it), the split's time, the update's slower fan-out and the
  whole update (best step of the run);
- churn: servers that take 20 ms a token, 1% of them killed and 1% stopped while 4N episodes run
  (each struck with requests in flight); each one's time to eviction (bound: interval x threshold + 1 s, plus the probe timeout for a
  stopped one), episodes lost (none may be), and every episode's tokens checked against the chain;
- the controller's resident memory.

Then Karmarkar-Karp at 8/64/512 ranks on a 4,096-sequence batch alone, the slope of each quantity
from the smallest N to the largest (log-log), and the table appended to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import resource
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _report import append_benchmark
from _simfleet import SimFleetProcesses, chain

from tandem.data.batch import SequenceBatch
from tandem.fleet.generation import GenerationParams
from tandem.rl.dispatch import split_for_ranks
from tandem.rollout import ModelRequest, RolloutConfig, RolloutController, RolloutWorkflow
from tandem.rollout.health import HealthConfig
from tandem.rollout.membership import MemberState
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.report import UpdateReport
from tandem.weights.transports import DiskTransport, TransportOptions
from tandem.weights.two_phase import run_update

RANKS = {10: 8, 100: 64, 1000: 512}
TICK = os.sysconf("SC_CLK_TCK")


class OneCall(RolloutWorkflow):
    """An episode is one generation call of up to `tokens` tokens after the item's one-token prompt."""

    def __init__(self, tokens: int):
        self.params = GenerationParams(max_new_tokens=tokens)

    async def arun_episode(self, client, item):
        resp = await client.agenerate(ModelRequest([item], self.params))
        return resp.to_trajectory(prompt_id=str(item))


def thread_cpu_s(thread: threading.Thread | None) -> float:
    """A thread of this process's CPU seconds so far (utime + stime from /proc)."""
    if thread is None or thread.native_id is None:
        return 0.0
    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def controller(addresses: list[str], health: HealthConfig, batch: int, concurrency: int) -> RolloutController:
    config = RolloutConfig(servers=addresses, health=health, max_concurrent_rollouts=concurrency,
                           consumer_batch_size=batch, max_head_offpolicyness=0, request_deadline_s=120,
                           min_servers=1)
    return RolloutController(config)


def wait_until(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.01)
    return time.monotonic() - start


def healthy(ctl: RolloutController) -> int:
    return sum(1 for r in ctl.members()["servers"] if r["state"] == "healthy")


def idle(ctl: RolloutController, window_s: float) -> dict[str, float]:
    monitor = ctl.fleet.monitor._thread
    h0, c0, w0 = thread_cpu_s(monitor), time.process_time(), time.monotonic()
    time.sleep(window_s)
    wall = time.monotonic() - w0
    return {"probe_core_pct": 100 * (thread_cpu_s(monitor) - h0) / wall,
            "idle_core_pct": 100 * (time.process_time() - c0) / wall}


class NoTensors:
    """The weight source of a simulated update: the checkpoint is an empty directory (the simulated
    servers load nothing; only the control messages are measured)."""

    def save_hf(self, path: str | Path, overwrite: bool = False) -> Path:
        Path(path).mkdir(parents=True, exist_ok=True)
        return Path(path)


def weight_update(ctl: RolloutController, version: int, root: Path) -> dict[str, float]:
    """One disk weight update as a trainer runs it (`tandem.weights.two_phase.run_update`, the
    `DiskTransport`, no verification) through the controller to every server: for tandem servers,
    the staged load, then the commit, which aborts in-flight requests, swaps and announces the
    version (no pause, no continue). -> the whole update's seconds and each fan-out's."""
    meta = WeightUpdateMeta(type="disk", path=str(root), version=version)
    report = UpdateReport(version=version, type="disk")
    start = time.monotonic()
    failure = run_update(meta, DiskTransport(NoTensors(), ctl, 0, 1, TransportOptions()), ctl, 0, None, report)
    if failure is not None:
        raise RuntimeError(f"the update to version {version} failed: {failure}")
    return {"update_s": time.monotonic() - start, "load_s": report.phases["load"], "commit_s": report.phases["commit"]}


def steps(ctl: RolloutController, n_steps: int, batch: int, ranks: int, root: Path) -> dict[str, float]:
    """`n_steps` RL steps: a batch of one-call episodes, its split for `ranks`, one update's fan-out.
    CPU is this process's (the controller, its driver and its threads)."""
    rollout_s = rollout_cpu = step_cpu = 0.0
    dispatch_s: list[float] = []
    updates: list[dict[str, float]] = []
    item = 1
    for step in range(1, n_steps + 1):
        c0, w0 = time.process_time(), time.monotonic()
        trajs = ctl.rollout_batch(range(item, item + batch), OneCall(16), timeout=600)
        item += batch
        rollout_s += time.monotonic() - w0
        rollout_cpu += time.process_time() - c0
        d0 = time.monotonic()
        split_for_ranks(SequenceBatch.from_token_lists([t.input_ids for t in trajs]), ranks)
        dispatch_s.append(time.monotonic() - d0)
        updates.append(weight_update(ctl, step, root))
        step_cpu += time.process_time() - c0
        if ctl.version.value != step:
            raise AssertionError(f"the commit announced version {step}, the controller holds {ctl.version.value}")
    return {"requests_per_s": n_steps * batch / rollout_s, "cpu_ms_per_1k": 1e6 * rollout_cpu / (n_steps * batch),
            "cpu_s_per_step": step_cpu / n_steps, "dispatch_ms": 1e3 * min(dispatch_s),
            "fanout_s": min(max(u["load_s"], u["commit_s"]) for u in updates),
            "update_s": min(u["update_s"] for u in updates)}


def churn(fleet: SimFleetProcesses, ctl: RolloutController, episodes: int, kills: list[int], stops: list[int],
          health: HealthConfig, tokens: int = 32, token_ms: float = 20.0) -> dict[str, Any]:
    """`episodes` episodes on slow servers; each server of `kills` is killed, and each of `stops`
    stopped, as soon as it has requests in flight (indices into `fleet.addresses`). -> the longest
    time from a strike to its server's eviction (kills, stops) and the bounds, episodes lost,
    whether every episode's tokens follow the chain, the trajectories' count and resubmissions."""
    fleet.latency(ttft_ms=2.0, token_ms=token_ms)
    before = ctl.step_metrics()
    first = 10_000_000
    for i in range(episodes):
        ctl.submit(first + i, OneCall(tokens))
    pending = {i: "kill" for i in kills} | {i: "stop" for i in stops}
    struck: dict[str, float] = {}

    def strike_busy_ones() -> bool:
        active = fleet.counts()[1]
        for index in [i for i in pending if active[i] > 0]:
            fleet.command(pending.pop(index), index)
            struck[fleet.addresses[index]] = time.monotonic()
        return not pending

    wait_until(strike_busy_ones, 60, "requests in flight on each server to strike")
    evicted: dict[str, float] = {}

    def all_evicted() -> bool:
        for address in set(struck) - set(evicted):
            if ctl.fleet.membership.record(address).state is MemberState.EVICTED:
                evicted[address] = time.monotonic() - struck[address]
        return len(evicted) == len(struck)

    bound = health.interval_s * health.failure_threshold + health.timeout_s + 1.0
    wait_until(all_evicted, bound + 30, "every struck server evicted")
    trajs = ctl.wait(episodes, timeout=300)
    for index in stops:
        fleet.command("cont", index)
    after = ctl.step_metrics()
    chained = all(t.input_ids[1:] == chain(t.input_ids[0], len(t.input_ids) - 1) for t in trajs)
    return {"trajectories": len(trajs), "lost": after["rollout/lost_total"] - before["rollout/lost_total"],
            "chained": chained, "kill_evict_s": max((evicted[fleet.addresses[i]] for i in kills), default=0.0),
            "stop_evict_s": max((evicted[fleet.addresses[i]] for i in stops), default=0.0),
            "kill_bound_s": health.interval_s * health.failure_threshold + 1.0, "stop_bound_s": bound,
            "resubmitted": after["rollout/resubmitted_total"] - before["rollout/resubmitted_total"]}


def struck(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """1% of the servers (at least one) to kill and as many other ones to stop."""
    k = max(1, n // 100)
    chosen = random.Random(seed).sample(range(n), 2 * k)
    return chosen[:k], chosen[k:]


def at_scale(n: int, n_steps: int, idle_s: float) -> dict[str, float]:
    health = HealthConfig()  # the defaults: what a run gets
    batch, processes = max(512, 4 * n), 1 if n < 500 else 2
    with SimFleetProcesses(n, processes=processes) as fleet:
        ctl = controller(fleet.addresses, health, batch, concurrency=min(batch, 1024))
        try:
            wait_until(lambda: healthy(ctl) == n, 60, f"{n} servers healthy")
            row: dict[str, float] = {"servers": n, "ranks": RANKS.get(n, 8)}
            row.update(idle(ctl, idle_s))
            with tempfile.TemporaryDirectory() as root:
                row.update(steps(ctl, n_steps, batch, int(row["ranks"]), Path(root)))
            kills, stops = struck(n)
            out = churn(fleet, ctl, 4 * n, kills, stops, health)
            if out["lost"] or not out["chained"] or out["trajectories"] != 4 * n:
                raise AssertionError(f"N={n}: episodes lost or broken under churn: {out}")
            row.update({k: out[k] for k in ("kill_evict_s", "kill_bound_s", "stop_evict_s", "stop_bound_s")})
            row["rss_mb"] = rss_mb()
        finally:
            ctl.shutdown()
    return row


def dispatch_alone(ranks: list[int], sequences: int = 4096) -> dict[int, float]:
    rng = random.Random(0)
    batch = SequenceBatch.from_token_lists([[1] * max(1, min(8192, round(rng.lognormvariate(6, 1))))
                                            for _ in range(sequences)])
    out = {}
    for r in ranks:
        times = []
        for _ in range(3):  # the best of three: the first call also warms up
            start = time.monotonic()
            split_for_ranks(batch, r)
            times.append(time.monotonic() - start)
        out[r] = 1e3 * min(times)
    return out


def slope(rows: list[dict[str, float]], key: str) -> float:
    """d log(key) / d log(servers) from the first row to the last: 0 flat, 1 linear."""
    a, b = rows[0], rows[-1]
    if a[key] <= 0 or b[key] <= 0:
        return float("nan")
    return math.log(b[key] / a[key]) / math.log(b["servers"] / a["servers"])


COLUMNS = [("servers", "servers", "{:.0f}"), ("ranks", "ranks", "{:.0f}"),
           ("probe_core_pct", "probes % core", "{:.2f}"), ("idle_core_pct", "idle % core", "{:.2f}"),
           ("requests_per_s", "req/s (ceiling)", "{:.0f}"), ("cpu_ms_per_1k", "CPU ms / 1k req", "{:.0f}"),
           ("cpu_s_per_step", "CPU s / step", "{:.2f}"), ("dispatch_ms", "dispatch ms", "{:.1f}"),
           ("fanout_s", "one fan-out s", "{:.3f}"), ("update_s", "weight update s", "{:.2f}"),
           ("kill_evict_s", "kill → evicted s", "{:.1f}"),
           ("stop_evict_s", "stop → evicted s", "{:.1f}"), ("rss_mb", "RSS MB", "{:.0f}")]


def table(rows: list[dict[str, float]]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt.format(r[key]) for key, _, fmt in COLUMNS) + " |" for r in rows]
    if len(rows) > 1:
        lines.append("| slope | | " + " | ".join(f"{slope(rows, key):.2f}" for key, _, _ in COLUMNS[2:]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="10,100,1000")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=15.0)
    ap.add_argument("--no-append", action="store_true")
    a = ap.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a connection per server, and more
    rows = []
    for n in (int(x) for x in a.servers.split(",")):
        rows.append(at_scale(n, a.steps, a.idle_s))
        print(table(rows[-1:]), flush=True)
    kk = dispatch_alone([8, 64, 512])
    body = "\n\n".join([
        "`.venv/bin/python bench/scale.py`: the real controller against N simulated servers (bench/_simfleet.py), "
        "default health settings (5 s interval, 3 failures).",
        table(rows),
        "Karmarkar-Karp alone, 4,096 sequences: " + ", ".join(f"{r} ranks {ms:.1f} ms" for r, ms in kk.items()) + ".",
    ])
    print(body)
    if not a.no_append:
        print(f"appended to {append_benchmark('Control-plane scale', body)}")


if __name__ == "__main__":
    main()
