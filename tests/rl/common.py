"""What the end-to-end tests of `tandem train` share: a tiny model, a small config, the run's rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

TANDEM = str(Path(sys.executable).with_name("tandem"))


def write_config(tmp_path: Path, model: Path, **sections: dict) -> Path:
    cfg = {
        "experiment": {"name": "e2e", "trial": "t", "fileroot": str(tmp_path / "runs")},
        "actor": {"path": str(model), "backend": "archon:d2", "num_threads": 1, "optimizer": {"lr": 1e-3}},
        "rollout": {"backend": "tandem:d2", "server_args": ["--num-threads", "1"], "consumer_batch_size": 4},
        "gen": {"n_samples": 2, "max_new_tokens": 6},
        "task": {"name": "arithmetic", "options": {"difficulty": "add1", "instruction": False},
                 "train_size": 64, "eval_size": 8},
        "train": {"total_steps": 2},
        "stats": {"progress": False},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs" / "e2e" / "t"


def rl_rows(tmp_path: Path) -> list[dict]:
    path = run_dir(tmp_path) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["phase"] == "rl" and r["step"] > 0]

