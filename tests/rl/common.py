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



def train_killing_a_server(tmp_path: Path, cfg: Path, log_name: str, after_steps: int, timeout: float = 400) -> None:
    """`tandem train cfg`; once `after_steps` rows are written, SIGKILL the launched server whose log
    is `log_name` (e.g. `teacher-0.log`). The run must end normally (exit 0) leaving no process."""
    import os
    import signal
    import subprocess

    from tests.launch.procs import descendants, wait_gone
    from tests.rl.test_train_e2e import _log_of, _wait_for_steps

    proc = subprocess.Popen([TANDEM, "train", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _wait_for_steps(tmp_path, proc, after_steps, timeout=300)
        tree = descendants(proc.pid)
        victim = next((pid for pid in tree if log_name in _log_of(pid)), None)
        assert victim is not None, f"no process logging to {log_name} among {sorted(tree)}"
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err[-3000:]
        assert not wait_gone(tree), "processes left behind"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
