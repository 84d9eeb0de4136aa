"""`bench/gpu_check.py` must work the day a GPU is lent (about 15 minutes of device time, start
included, leave no room to debug the script there): its CPU dry run (`make gpu-check DEVICE=cpu`:
`--device cpu --quick`) runs every step end to end here, as a real subprocess, and writes the
report the device run would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]


def test_the_dry_run_runs_every_step_and_reports(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}  # not pytest-under-make's flags
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check", "DEVICE=cpu", f"GPU_CHECK_OUT={out}",
                           "GPU_CHECK_ARGS=--budget-s 600", f"PY={sys.executable}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=660)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]
    report = json.loads((out / "gpu_check.json").read_text())
    steps = report["steps"]
    assert list(steps) == ["env", "correctness", "serve", "train", "weight_sync", "demo"]
    bad = {name: (s["status"], s.get("figures", {}).get("error")) for name, s in steps.items() if s["status"] != "ok"}
    assert not bad, f"{bad}\n" + "\n".join(step_log(log, name)[-4000:] for name in bad)
    figures = {name: s.get("figures", {}) for name, s in steps.items()}
    tests_gpu = len(list((ROOT / "tests" / "gpu").glob("test_*.py")))
    assert steps["correctness"]["passed"] >= tests_gpu and not steps["correctness"]["failures"], steps["correctness"]
    assert figures["serve"]["ratio"] > 0 and figures["serve"]["decode"]["steps_per_s"] > 0
    assert len(figures["train"]["configs"]) == 4
    assert figures["weight_sync"]["update_s"] > 0 and figures["weight_sync"]["copy_s"] > 0
    assert "eval_before" in figures["demo"] and "eval_after" in figures["demo"]
    assert "| demo | ok |" in (out / "gpu_check.md").read_text()


def step_log(log: str, name: str) -> str:
    """The part of gpu_check.log that step `name` wrote (from its `===== name` header to the next)."""
    start = log.find(f"\n===== {name} ")
    if start < 0:
        return log
    end = log.find("\n===== ", start + 1)
    return log[start:end if end >= 0 else len(log)]
