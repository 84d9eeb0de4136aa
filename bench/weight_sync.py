"""Weight sync: a trainer (TrainEngine: one process, or `--trainer-world N` FSDP ranks spawned with
gloo) and one `tandem serve` process per transport on this host, for Qwen-shaped models of ~10M,
~100M and ~500M parameters (random init).

Weights travel in bf16: the trainer keeps fp32 master weights and computes in bf16, so each
exported bucket is cast on the fly (at world size 1 the only work of the "gather"; at world size
N > 1 each rank casts its shards and rank 0 gathers the bucket); the server serves bf16. Per
model, every transport runs the full update (pause, transfer, commit, version, continue):
- **serial**: distributed broadcast, one bucket at a time (gather, send, wait, next);
- **pipelined**: distributed broadcast, bucket k + 1 gathered while bucket k is broadcast;
- **disk**: HF checkpoint written by the trainer, staged by the server;
- **shm**: one /dev/shm segment per bucket, served in place by the server (zero-copy: two sets of
  segments written in turn; the default `shm_reuse=True` keeps them between updates, created by
  two untimed first updates);
  **shm, fresh segments** (`shm_reuse=False`): segments created and unlinked by every update.
Distributed buckets travel as one flat buffer each (one broadcast per bucket) into persistent
receive buffers on the server; the group and those buffers are made by an untimed first update.
Also measured in the same run, on the same bytes: **raw gloo** (a plain broadcast to a bare
receiver process that receives into buffers allocated once; the faster of one broadcast per
tensor and one per flat bucket), **raw memcpy** (one copy of the same tensors into buffers
allocated once) and the **data plane** without its control plane: the fp32 weights cast bucket
by bucket into two flat buffers and broadcast to a bare receiver, serial and pipelined (a worker
thread sends bucket k while k + 1 is cast), no HTTP: the ceiling this host puts on pipelining and
on the broadcast, and the share of the real update its round trips take. GB/s = payload bytes /
seconds of the whole update.

Run: `.venv/bin/python bench/weight_sync.py` (about 2-3 minutes on 2 cores); prints a table and
appends it to docs/benchmarks.md (`--no-report` to skip). `--sizes 10M,100M` picks models;
`--trainer-world 2` measures an FSDP trainer of two ranks (each bucket gathered, then sent).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _report import append_benchmark
from current import record, this_command

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.inference.server_utils

from tandem.fleet.http import HttpFleet
from tandem.fleet.ops import Deadlines
from tandem.models import build_model, save_model
from tandem.train import TrainEngine, TrainEngineConfig
from tandem.weights import host_store, init_weight_group
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.packing import plan_buckets
from tandem.weights.shm import layout, pack
from tandem.weights.updater import WeightUpdater
from tests.distributed import run_distributed
from tests.inference.server_utils import ServerProcess

# Qwen2/Qwen3-shaped sizes (tied embeddings).
SIZES = {
    "10M": dict(vocab_size=16384, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                head_dim=64, intermediate_size=1024),
    "100M": dict(vocab_size=32768, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64, intermediate_size=2048),
    "500M": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, intermediate_size=4864),
}
REPS = {"10M": 15, "100M": 7, "500M": 3}  # small models: ms-scale updates, more rounds for a steady median
DEADLINES = Deadlines(init_group_s=120, bucket_s=300, update_s=1200, http_s=120)


def make_model(root: Path, size: str) -> tuple[Path, int]:
    from transformers import Qwen2Config

    cfg = Qwen2Config(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0,
                      rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0).to_dict()
    cfg["model_type"] = "qwen2"
    model = build_model(cfg, dtype=torch.bfloat16, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    return save_model(model, root / f"qwen-{size}"), n_params


def _raw_receiver(port: int, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], reps: int) -> None:
    torch.set_num_threads(1)
    group = init_weight_group("127.0.0.1", port, 1, 2, timeout_s=300)
    bufs = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]
    for _ in range(reps):
        for b in bufs:
            group.broadcast(b)
        group.barrier()
    group.destroy()
    os._exit(0)


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs of this host since boot (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    """Share of all CPUs' time spent busy between two `cpu_jiffies` samples (nan off Linux)."""
    if before is None or after is None or after[1] == before[1]:
        return float("nan")
    return (after[0] - before[0]) / (after[1] - before[1])


def raw_gloo(tensors: list[torch.Tensor], reps: int) -> tuple[float, float]:
    """Seconds for a plain gloo broadcast of `tensors` (one op each) to another process (the best
    round), and the share of this host's CPUs kept busy over the timed rounds."""
    store = host_store("127.0.0.1", 0, timeout_s=300)
    proc = mp.get_context("spawn").Process(
        target=_raw_receiver, args=(store.port, [tuple(t.shape) for t in tensors], [t.dtype for t in tensors],
                                    reps + 1))
    proc.start()
    group = init_weight_group("127.0.0.1", store.port, 0, 2, timeout_s=300, store=store)
    times, before = [], None
    for round_ in range(reps + 1):  # round 0 warms both sides up and is not timed
        if round_ == 1:
            before = cpu_jiffies()
        start = time.perf_counter()
        for t in tensors:
            group.broadcast(t)
        group.barrier()
        times.append(time.perf_counter() - start)
    busy = busy_share(before, cpu_jiffies())
    group.destroy()
    proc.join(30)
    return min(times[1:]), busy


def data_plane(sources: list[list[torch.Tensor]], wire: torch.dtype, reps: int) -> dict[str, float]:
    """The updater's data plane alone, no HTTP: each bucket of fp32 `sources` cast into one of two
    flat buffers (allocated once) and sent as one gloo broadcast to a bare receiver; serial (cast,
    send, next) and pipelined (bucket k + 1 cast while a worker thread broadcasts k). What the
    transfer would cost with a free control plane, on this host: seconds, the best of `reps`."""
    layouts = [layout(b, wire) for b in sources]
    store = host_store("127.0.0.1", 0, timeout_s=300)
    rounds = 2 * (reps + 1)
    proc = mp.get_context("spawn").Process(
        target=_raw_receiver, args=(store.port, [(n,) for _, n in layouts], [torch.uint8] * len(layouts), rounds))
    proc.start()
    group = init_weight_group("127.0.0.1", store.port, 0, 2, timeout_s=300, store=store)
    bufs = [torch.empty(max(n for _, n in layouts), dtype=torch.uint8) for _ in range(2)]
    best = {"serial": float("inf"), "pipelined": float("inf")}
    with ThreadPoolExecutor(1) as worker:
        for r in range(rounds):  # serial and pipelined in turn; the first round of each warms up
            mode = "serial" if r % 2 == 0 else "pipelined"
            start = time.perf_counter()
            sending = None
            for k, (tensors, (offsets, nbytes)) in enumerate(zip(sources, layouts, strict=True)):
                buf = bufs[k % 2][:nbytes]
                pack(buf, tensors, offsets, wire)
                if mode == "serial":
                    group.broadcast(buf)
                    continue
                if sending is not None:
                    sending.result()
                sending = worker.submit(group.broadcast, buf)
            if sending is not None:
                sending.result()
            group.barrier()  # received, as raw_gloo measures it
            if r >= 2:
                best[mode] = min(best[mode], time.perf_counter() - start)
    group.destroy()
    proc.join(30)
    return best


def cast_alone(sources: list[list[torch.Tensor]], wire: torch.dtype, reps: int) -> float:
    """Seconds to cast every bucket of fp32 `sources` into two flat buffers (allocated once), nothing
    sent: the data plane's own work besides the broadcast, the best of `reps`."""
    layouts = [layout(b, wire) for b in sources]
    bufs = [torch.empty(max(n for _, n in layouts), dtype=torch.uint8) for _ in range(2)]
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        for k, (tensors, (offsets, nbytes)) in enumerate(zip(sources, layouts, strict=True)):
            pack(bufs[k % 2][:nbytes], tensors, offsets, wire)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def copy_scaling(nbytes: int = 128 << 20, reps: int = 5) -> float:
    """Throughput of memory-bound copies on two threads at once / on one (1.0: the two CPUs share one
    memory bandwidth, so overlapping the cast with the socket copies cannot speed the transfer up;
    2.0: they scale). Each thread copies its own `nbytes` buffer `reps` times; the best of 3 rounds."""
    srcs = [torch.ones(nbytes, dtype=torch.uint8) for _ in range(2)]
    dsts = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2)]

    def copies(i: int) -> None:
        for _ in range(reps):
            dsts[i].copy_(srcs[i])

    one, two = float("inf"), float("inf")
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            start = time.perf_counter()
            copies(0)
            one = min(one, time.perf_counter() - start)
            start = time.perf_counter()
            list(pool.map(copies, range(2)))
            two = min(two, time.perf_counter() - start)
    return 2 * one / two


def flat_buckets(buckets: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each bucket as one uint8 buffer (the layout the updater sends)."""
    out = []
    for tensors in buckets:
        offsets, nbytes = layout(tensors)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        pack(buf, tensors, offsets)
        out.append(buf)
    return out


def raw_memcpy(tensors: list[torch.Tensor], reps: int) -> float:
    dst = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t)
        times.append(time.perf_counter() - start)
    return min(times[1:])


LABELS = ("serial", "pipelined", "disk", "shm", "shm_fresh")
KIND = {"serial": "distributed", "pipelined": "distributed", "shm_fresh": "shm"}  # label -> transport


def server_of(label: str) -> str:
    return "distributed" if KIND.get(label) == "distributed" else label


def run_updates(rank: int, world: int, model_dir: str, urls: dict[str, str], root: str, bucket: int,
                labels: tuple[str, ...], reps: int) -> dict | None:
    """Every trainer rank: the timed updates of every transport (rank 0 talks to the servers).
    -> {label: [(seconds, phases), ...]} on rank 0."""
    engine = TrainEngine(TrainEngineConfig(path=model_dir, dtype="bfloat16"))
    try:
        with contextlib.ExitStack() as stack:
            fleets = {kind: stack.enter_context(HttpFleet([url], deadlines=DEADLINES)) if rank == 0 else None
                      for kind, url in urls.items()}
            version = 0
            # One updater per transport, all open at once; serial and pipelined share one (and its
            # group), toggling `pipeline`. Runs are interleaved (every transport once per round), so
            # the noise of a shared machine hits all of them alike.
            updaters: dict[str, WeightUpdater] = {}
            for label in labels:
                kind = KIND.get(label, label)
                if kind == "distributed" and "distributed" in updaters:
                    updaters[label] = updaters["distributed"]
                    continue
                meta = WeightUpdateMeta(type=kind, path=f"{root}/versions", bucket_bytes=bucket, deadlines=DEADLINES)
                updater = stack.enter_context(WeightUpdater(engine, fleets[server_of(label)], meta,
                                                            shm_reuse=label != "shm_fresh"))
                updaters[label] = updater
                if kind == "distributed":
                    updaters["distributed"] = updater
                # Outside the timing: the group, the server's two sets of staging buffers (ping-pong:
                # steady from the third update on), the trainer's send buffers, both sets of shm
                # segments (written in turn).
                for _ in range(2 if kind == "distributed" or label == "shm" else 0):
                    version += 1
                    updater.update(version)
            results: dict[str, list] = {label: [] for label in labels}
            for _ in range(reps):
                for label in labels:
                    updater = updaters[label]
                    updater.pipeline = label != "serial"
                    version += 1
                    report = updater.update(version)
                    results[label].append((report.seconds, report.phases))
    finally:
        engine.close()
    return results if rank == 0 else None


def run_size(size: str, root: Path, log_dir: Path, bucket_mib: float | None = None,
             labels: tuple[str, ...] = LABELS, world: int = 1, reps: int | None = None) -> dict:
    model_dir, n_params = make_model(root, size)
    # One server per transport (serial and pipelined share one): each reaches its own steady state
    # (distributed: two sets of staging buffers; shm: parameters in the trainer's segments) as in a
    # deployment that uses one transport; sharing a server, every switch of transport would cost
    # fresh pages (and shm's commit would pay for freeing shm_fresh's segments).
    kinds = {server_of(label) for label in labels}
    # The disk server may load the trainer's versioned copies (`run_updates` writes them under
    # `{root}/run-{size}/versions`); servers refuse other directories than --model and --weights-dir.
    servers = {kind: ServerProcess(model_dir, log_dir, "--dtype", "bfloat16", "--kv-cache-tokens", "1024",
                                   "--weight-sync-timeout", "300", "--weights-dir", f"{root}/run-{size}/versions",
                                   timeout=600) for kind in sorted(kinds)}
    engine = TrainEngine(TrainEngineConfig(path=str(model_dir), dtype="bfloat16"))
    payload = sum(p.numel() for p in engine.model.parameters()) * 2
    bucket = int(bucket_mib * 2**20) if bucket_mib else max(4 << 20, payload // 16)
    reps = reps or REPS[size]
    out = {"size": size, "params": n_params, "bytes": payload, "bucket": bucket, "reps": reps}
    buckets = [[t.clone() for _, t in b] for b in engine.export_weights(bucket)]
    sources = [[t.clone() for _, t in b] for b in plan_buckets(engine.local_weights(), bucket, torch.bfloat16)]
    engine.close()
    del engine
    tensors = [t for b in buckets for t in b]
    out["raw_gloo_tensors"], _ = raw_gloo(tensors, reps)
    out["raw_gloo_flat"], out["raw_gloo_busy"] = raw_gloo(flat_buckets(buckets), reps)
    out["raw_gloo"] = min(out["raw_gloo_tensors"], out["raw_gloo_flat"])
    out["raw_memcpy"] = raw_memcpy(tensors, reps)
    plane = data_plane(sources, torch.bfloat16, reps)
    out["plane_serial"], out["plane_pipelined"] = plane["serial"], plane["pipelined"]
    out["cast"] = cast_alone(sources, torch.bfloat16, reps)
    out["copy_scaling"] = copy_scaling()
    del tensors, buckets, sources
    print(f"  {size} raw gloo: {out['raw_gloo_tensors']:.3f}s per tensor, {out['raw_gloo_flat']:.3f}s per flat bucket; "
          f"raw memcpy {out['raw_memcpy']:.3f}s; CPUs busy during the flat broadcasts "
          f"{out['raw_gloo_busy'] * 100:.0f}%", flush=True)
    print(f"  {size} data plane (cast + flat broadcast, no HTTP): serial {plane['serial']:.3f}s, "
          f"pipelined {plane['pipelined']:.3f}s; cast alone {out['cast']:.3f}s; memory-bound copies on 2 threads "
          f"{out['copy_scaling']:.2f}x one thread's throughput", flush=True)
    urls = {kind: server.url for kind, server in servers.items()}
    args = (str(model_dir), urls, str(root / f"run-{size}"), bucket, labels, reps)
    try:
        if world == 1:
            results = run_updates(0, 1, *args)
        else:  # FSDP over `world` spawned ranks (gloo): every bucket is gathered before it is sent
            results = run_distributed(run_updates, world, args=args, timeout=3600)[0]
    finally:
        for server in servers.values():
            server.stop()
    for label in labels:
        runs = sorted(results[label], key=lambda r: r[0])
        out[label], out[label + "_phases"] = runs[len(runs) // 2]
        shown = {p: round(v, 3) for p, v in out[label + "_phases"].items()}
        print(f"  {size} {label}: {out[label]:.3f}s (runs {[round(r[0], 3) for r in results[label]]}) "
              f"{shown}", flush=True)
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| model | params | bf16 bytes | buckets of | serial | pipelined | disk | shm | shm, fresh segments "
        "| raw gloo | raw memcpy | pipelined / serial | pipelined / raw gloo | shm / pipelined "
        "| shm fresh / pipelined |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(r: dict, key: str) -> str:
        return f"{r[key]:.2f} s ({r['bytes'] / r[key] / 1e9:.2f} GB/s)"

    for r in rows:
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['bytes'] / 2**20:.0f} MiB | {r['bucket'] / 2**20:.0f} MiB "
            f"| {cell(r, 'serial')} | {cell(r, 'pipelined')} | {cell(r, 'disk')} | {cell(r, 'shm')} "
            f"| {cell(r, 'shm_fresh')} | {cell(r, 'raw_gloo')} | {cell(r, 'raw_memcpy')} "
            f"| {r['serial'] / r['pipelined']:.2f}x | {r['raw_gloo'] / r['pipelined'] * 100:.0f}% "
            f"| {r['pipelined'] / r['shm']:.2f}x | {r['pipelined'] / r['shm_fresh']:.2f}x |"
        )
    return "\n".join(lines)


def plane_table(rows: list[dict]) -> str:
    """The transfer without its control plane (`data_plane`) next to the real update: what this host
    allows pipelining and the broadcast, and what the HTTP round trips per bucket add."""
    lines = [
        "| model | cast alone | cast / raw gloo | copies on 2 threads / 1 | CPUs busy in raw gloo "
        "| data plane serial | data plane pipelined | data plane pipelined / serial "
        "| data plane pipelined / raw gloo | pipelined update / data plane pipelined |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['cast']:.3f} s | {r['cast'] / r['raw_gloo']:.2f} | {r['copy_scaling']:.2f}x "
            f"| {r['raw_gloo_busy'] * 100:.0f}% "
            f"| {r['plane_serial']:.3f} s | {r['plane_pipelined']:.3f} s "
            f"| {r['plane_serial'] / r['plane_pipelined']:.2f}x | {r['raw_gloo'] / r['plane_pipelined'] * 100:.0f}% "
            f"| {r['plane_pipelined'] / r['pipelined'] * 100:.0f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10M,100M,500M")
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--bucket-mib", type=float, default=None, help="bucket size (default: payload / 16, >= 4 MiB)")
    ap.add_argument("--only", default=",".join(LABELS), help="transports to run (a quick look; no report)")
    ap.add_argument("--trainer-threads", type=int, default=1,
                    help="torch threads of the trainer process (the cast into send buffers / segments)")
    ap.add_argument("--trainer-world", type=int, default=1,
                    help="trainer ranks (FSDP over spawned gloo processes, 1 torch thread each); 1 = in this process")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"timed rounds per transport for every size (default: {REPS})")
    args = ap.parse_args()
    torch.set_num_threads(args.trainer_threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-ws-") as tmp:
        root = Path(tmp)
        log_dir = root / "logs"
        log_dir.mkdir()
        for size in args.sizes.split(","):
            print(f"model {size} ...", flush=True)
            rows.append(run_size(size, root, log_dir, args.bucket_mib, tuple(args.only.split(",")),
                                 args.trainer_world, args.reps))
    if args.only != ",".join(LABELS):
        return
    body = table(rows)
    phases = "\n".join(f"- {r['size']}: " + "; ".join(
        f"{k}: " + ", ".join(f"{p} {s:.2f}s" for p, s in r[f"{k}_phases"].items())
        for k in LABELS) for r in rows)
    text = (f"{body}\n\nWithout the control plane (world-size-1 data plane, same bytes, best of the rounds):\n\n"
            f"{plane_table(rows)}\n\nPhases of the median run (seconds):\n{phases}\n\n"
            "Times are whole updates (pause, transfer, commit, version, continue) between a trainer "
            + ("process (TrainEngine, world size 1, fp32 master weights cast to bf16 per bucket, "
               f"{args.trainer_threads} torch thread(s))" if args.trainer_world == 1 else
               f"of {args.trainer_world} ranks (TrainEngine, FSDP over gloo, 1 torch thread each; fp32 "
               "master shards cast to bf16 and gathered to rank 0 per bucket)")
            + " and a `tandem serve` "
            "process per transport (bf16, 1 torch thread); raw gloo = a plain broadcast of the same bytes into buffers "
            "allocated once (the faster of one broadcast per tensor and one per flat bucket); runs interleaved "
            f"across transports, median of {' / '.join(str(r['reps']) for r in rows)} rounds; "
            "raw memcpy = one copy of the same tensors into buffers allocated once. Cast alone = every bucket "
            "cast fp32 -> bf16 into the flat buffers, nothing sent; copies on 2 threads / 1 = throughput of "
            "memory-bound copies on two threads at once over one (1.0x: the CPUs share one memory bandwidth, and "
            "the cast, the sender's and the receiver's socket copies cannot overlap usefully; the pipelined / "
            "serial ceiling is about that figure, and the pipelined / raw ceiling about raw / (raw + cast) times it); "
            "CPUs busy in raw gloo = share of all this host's CPU time spent busy (/proc/stat) during the timed "
            "flat broadcasts, sender and receiver together (a cast running beside them gets at most the rest).")
    print(text)
    if not args.no_report:
        append_benchmark("Weight sync: serial vs pipelined broadcast vs disk vs shm", text)
        record_current(rows, args.trainer_world)


def record_current(rows: list[dict], trainer_world: int) -> None:
    """The Current figures row: the largest model's update times and every size's ratios."""
    big = rows[-1]
    sizes = " / ".join(r["size"] for r in rows)
    shm = " / ".join(f"{r['pipelined'] / r['shm']:.2f}x" for r in rows)
    of_raw = " / ".join(f"{r['raw_gloo'] / r['pipelined'] * 100:.0f}%" for r in rows)
    of_serial = " / ".join(f"{r['serial'] / r['pipelined']:.2f}x" for r in rows)
    world = f", trainer world size {trainer_world}" if trainer_world > 1 else ""
    record("weight_sync",
           f"{big['size']} pipelined update {big['pipelined']:.2f} s, shm {big['shm']:.2f} s{world}; "
           f"shm / pipelined {shm} ({sizes})",
           f"raw gloo broadcast {big['raw_gloo']:.2f} s ({big['size']})",
           f"pipelined / raw gloo {of_raw}; pipelined / serial {of_serial}", this_command())

if __name__ == "__main__":
    main()
