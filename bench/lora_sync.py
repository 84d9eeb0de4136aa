"""LoRA weight sync: bytes and seconds of one weight update, the adapter alone vs the whole model,
on the medium (~23M) and base (~101M) presets (`tandem init-model`), measured in the same run.

Per preset: one `tandem serve` (fp32, 1 torch thread) and a trainer (TrainEngine, world size 1,
fp32) that updates it over the distributed transport (pipelined broadcast, 16 MiB buckets) and
over disk: first as a full-model trainer (whole weights), then as a LoRA trainer (rank 16, alpha
32, all seven projections: the adapters alone, merged by the server into its base copy). Each
update is whole: pause, transfer, the server's merge (LoRA), commit, version, continue. Two untimed
updates first (the group, the server's buffers and base copies), then the median of `--reps`.
The ratio full / LoRA is the speed-up per update.

Run: `.venv/bin/python bench/lora_sync.py` (a few minutes on 2 cores); prints a table and
appends it to docs/benchmarks.md (`--no-report` to skip)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from _report import append_benchmark
from current import record, this_command

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.inference.server_utils

from tandem.fleet.http import HttpFleet
from tandem.fleet.ops import Deadlines
from tandem.models.common.lora import LoRAConfig
from tandem.models.tiny import init_model
from tandem.train import TrainEngine, TrainEngineConfig
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.updater import WeightUpdater
from tests.inference.server_utils import ServerProcess

DEADLINES = Deadlines(init_group_s=120, bucket_s=300, update_s=900, http_s=300)
LORA = LoRAConfig(rank=16, alpha=32.0)
BUCKET = 16 << 20


def measure(model_dir: Path, url: str, root: Path, kind: str, lora: bool, reps: int, first: int) -> dict:
    """Median seconds and bytes of `reps` updates of `kind` from a full or a LoRA trainer."""
    engine = TrainEngine(TrainEngineConfig(path=str(model_dir), lora=LORA if lora else LoRAConfig()))
    meta = WeightUpdateMeta(type=kind, path=str(root / "versions"), bucket_bytes=BUCKET, deadlines=DEADLINES,
                            lora_alpha=LORA.alpha if lora else None)
    trainable = sum(p.numel() for p in engine.trainable_parameters())
    seconds, nbytes = [], 0
    try:
        with contextlib.ExitStack() as stack:
            fleet = stack.enter_context(HttpFleet([url], deadlines=DEADLINES))
            updater = stack.enter_context(WeightUpdater(engine, fleet, meta))
            for i in range(reps + 2):
                with torch.no_grad():  # each version differs (the adapters' B starts at zero)
                    for p in engine.trainable_parameters():
                        p.add_(1e-4)
                report = updater.update(first + i)
                if i >= 2:
                    seconds.append(report.seconds)
                    nbytes = report.bytes
    finally:
        engine.close()
    return {"seconds": statistics.median(seconds), "bytes": nbytes, "trainable": trainable,
            "optimizer_mb": 8 * trainable / 1e6}


def run_preset(preset: str, root: Path, reps: int) -> list[dict]:
    model_dir = init_model(root / preset, arch="qwen3", preset=preset, seed=0)
    rows = []
    version = 0
    for kind in ("distributed", "disk"):
        server = ServerProcess(model_dir, root / "logs", "--kv-cache-tokens", "1024", "--weight-sync-timeout", "600",
                               "--weights-dir", str(root / f"{preset}-{kind}" / "versions"), timeout=600)
        try:
            out = {}
            for lora in (False, True):
                out["lora" if lora else "full"] = measure(model_dir, server.url, root / f"{preset}-{kind}", kind,
                                                          lora, reps, version + 1)
                version += reps + 2
        finally:
            server.stop()
        row = {"preset": preset, "kind": kind, **out}
        print(f"  {preset} {kind}: full {out['full']['seconds']:.3f} s / {out['full']['bytes'] / 1e6:.1f} MB, "
              f"LoRA {out['lora']['seconds']:.3f} s / {out['lora']['bytes'] / 1e6:.2f} MB", flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| preset | transport | full: MB | full: s | LoRA r16: MB | LoRA r16: s | bytes full / LoRA | "
             "seconds full / LoRA | trainable params full / LoRA | AdamW state full / LoRA (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, lo = r["full"], r["lora"]
        lines.append(f"| {r['preset']} | {r['kind']} | {f['bytes'] / 1e6:.1f} | {f['seconds']:.3f} | "
                     f"{lo['bytes'] / 1e6:.2f} | {lo['seconds']:.3f} | {f['bytes'] / lo['bytes']:.0f}x | "
                     f"{f['seconds'] / lo['seconds']:.1f}x | {f['trainable']:,} / {lo['trainable']:,} | "
                     f"{f['optimizer_mb']:.0f} / {lo['optimizer_mb']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="medium,base")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "logs").mkdir()
        for preset in args.presets.split(","):
            print(f"preset {preset} ...", flush=True)
            rows += run_preset(preset, root, args.reps)
    text = (table(rows) + "\n\nOne update each (median of " + str(args.reps) + "): pause, transfer, the server's "
            "merge of the adapter into its base copy (LoRA), commit, version, continue; fp32 trainer (world size 1) "
            "and `tandem serve` (fp32, 1 torch thread), 16 MiB buckets; LoRA rank 16 on q/k/v/o/gate/up/down, "
            "alpha 32. AdamW state = 8 bytes per trainable parameter (exp_avg, exp_avg_sq).")
    print(text)
    if not args.no_report:
        append_benchmark("LoRA weight sync: the adapter alone vs the whole model (issue 46)", text)
        big = [r for r in rows if r["kind"] == "distributed"][-1]
        record("lora_sync", f"{big['preset']} distributed update: LoRA {big['lora']['seconds']:.3f} s, "
                            f"{big['lora']['bytes'] / 1e6:.2f} MB",
               f"whole model {big['full']['seconds']:.3f} s, {big['full']['bytes'] / 1e6:.1f} MB",
               f"{big['full']['seconds'] / big['lora']['seconds']:.1f}x faster, "
               f"{big['full']['bytes'] / big['lora']['bytes']:.0f}x fewer bytes", this_command())


if __name__ == "__main__":
    main()
