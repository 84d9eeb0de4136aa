"""The trackers a run's numbers go to (tandem.rl.trackers), with the real packages, read back
through their own readers: W&B offline through `wandb leet inspect --json` (wandb's reader of
the run's `.wandb` transaction log; the Python DataStore of older versions is gone in wandb
0.31), MLflow through `MlflowClient` against a `file:` store. Nothing reaches the network: W&B
runs offline with its server pointed at a closed local port, and the test checks its logs for
any attempt to connect."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.errors import ConfigError
from tandem.rl.config import load_run_config
from tandem.rl.metrics import read_metrics
from tandem.rl.sft import sft_metrics
from tandem.rl.trackers import MlflowTracker, WandbTracker, flat_params
from tests.rl.common import TANDEM, run_dir, write_config

WANDB = str(Path(sys.executable).with_name("wandb"))
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once


def tracker_env(tmp_path: Path) -> dict[str, str]:
    """W&B and MLflow kept local: W&B's config, cache and data directories under `tmp_path`, its
    server and any proxy a closed local port, no API key; MLflow's file store allowed (MLflow 3
    refuses it unless asked)."""
    home = tmp_path / "wandb-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(WANDB_SILENT="true", WANDB_CONFIG_DIR=str(home / "config"), WANDB_CACHE_DIR=str(home / "cache"),
               WANDB_DATA_DIR=str(home / "data"), WANDB_BASE_URL=CLOSED, WANDB_DISABLE_GIT="true",
               HTTP_PROXY=CLOSED, HTTPS_PROXY=CLOSED, MLFLOW_ALLOW_FILE_STORE="true")
    return env


@pytest.fixture
def local_trackers(tmp_path, monkeypatch):
    """`tracker_env` in this process (and the commands it starts)."""
    for key in [k for k in os.environ if k.startswith(("WANDB_", "MLFLOW_"))]:
        monkeypatch.delenv(key)
    for key, value in tracker_env(tmp_path).items():
        monkeypatch.setenv(key, value)


def wandb_records(run_dir: Path) -> list[dict]:
    """The records of the one offline W&B run under `run_dir/wandb`, as wandb's reader prints them."""
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    out = subprocess.run([WANDB, "leet", "inspect", "--json", str(files[0])], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def wandb_history(records: list[dict]) -> dict[int, dict]:
    """step -> the values logged at it (W&B's own `_step`, `_runtime`, ... left out)."""
    return {int(r["history"]["step"]["num"]): {k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
            for r in records if r["type"] == "history"}


def wandb_config(records: list[dict]) -> dict:
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    return {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}


def assert_no_network_attempt(run_dir: Path, tmp_path: Path) -> None:
    """W&B's debug logs (the run's, and wandb-core's in its cache directory) show no connection
    tried: any would have gone to the closed port (`tracker_env`) and been refused."""
    logs = [*(run_dir / "wandb").rglob("debug*.log"), *(tmp_path / "wandb-home").rglob("core-debug-*.log")]
    names = {p.name for p in logs}
    assert "debug-internal.log" in names and any(n.startswith("core-debug-") for n in names), names
    text = "".join(p.read_text(errors="replace") for p in logs).lower()
    for sign in (r"127\.0\.0\.1:9\b", "connection refused", r"api\.wandb\.ai", "retrying"):
        assert not re.search(sign, text), f"W&B tried the network ({sign!r} in its logs)"


def mlflow_run(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    (run,) = client.search_runs([found.experiment_id])
    return client, run


def mlflow_history(client, run) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for key in run.data.metrics:  # every key logged (the latest value); its history has every step
        for m in client.get_metric_history(run.info.run_id, key):
            by_step.setdefault(m.step, {})[key] = m.value
    return by_step


def expected_rows(path: Path) -> dict[int, dict]:
    """step -> `phase/key`: value of the finite numbers in a metrics file (what the trackers get)."""
    out: dict[int, dict] = {}
    for row in read_metrics(path):
        values = {f"{row['phase']}/{k}": v for k, v in row.items() if k not in ("phase", "step", "time")
                  and isinstance(v, int | float) and math.isfinite(v)}
        out.setdefault(row["step"], {}).update(values)
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_reaches_wandb_offline_and_mlflow(tmp_path, model_dir, local_trackers):
    """`tandem train` with both trackers on: W&B (offline, files in the run directory) and MLflow
    each hold the run's config, every step's metrics equal to metrics.jsonl's rows, and plot.png
    and summary.txt as artifacts; W&B never tries the network."""
    uri = (tmp_path / "mlruns").as_uri()
    cfg = write_config(tmp_path, model_dir, actor={"backend": "archon:d1"}, rollout={"backend": "tandem:d1"},
                       task={"eval_size": 4},
                       stats={"wandb_project": "tandem-tests", "wandb_mode": "offline", "mlflow_tracking_uri": uri,
                              "mlflow_experiment": "trackers"})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = run_dir(tmp_path)
    expected = expected_rows(out / "metrics.jsonl")
    assert sorted(expected) == [0, 1, 2] and "rl/reward/mean" in expected[1] and "rl/eval/accuracy" in expected[0]
    config = yaml.safe_load((out / "config.yaml").read_text())
    outputs = {name: (out / name).stat().st_size for name in ("plot.png", "summary.txt")}

    records = wandb_records(out)
    assert wandb_config(records) == config
    assert wandb_history(records) == expected
    (artifact,) = [r["artifact"] for r in records if r["type"] == "artifact"]
    assert {e["path"]: int(e["size"]) for e in artifact["manifest"]["contents"]} == outputs
    assert [r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"] == [0]
    assert_no_network_attempt(out, tmp_path)

    client, run = mlflow_run(uri, "trackers")
    assert run.info.run_name == "e2e/t" and run.info.status == "FINISHED"
    assert run.data.params == flat_params(config)
    assert (run.data.params["actor.path"], run.data.params["train.total_steps"], run.data.params["stats.wandb_mode"],
            run.data.params["task.options.difficulty"]) == (str(model_dir), "2", "offline", "add1")
    assert mlflow_history(client, run) == expected
    assert {a.path: a.file_size for a in client.list_artifacts(run.info.run_id)} == outputs


@pytest.mark.timeout(120)
def test_sft_rows_reach_both_trackers(tmp_path, local_trackers):
    """`tandem sft`'s metrics logger starts the trackers too (a run named name/trial/sft), and a
    run that fails ends them as failed."""
    uri = (tmp_path / "mlruns").as_uri()
    cfg = load_run_config(None, ["stats.wandb_project=tandem-tests", "stats.wandb_mode=offline",
                                 f"stats.mlflow_tracking_uri={uri}", "experiment.name=sft-e"], command="sft")
    metrics = sft_metrics(cfg, tmp_path)
    metrics.log(1, {"loss": 2.5, "grad_norm": float("nan")}, phase="sft")
    metrics.log(2, {"loss": 2.0, "grad_norm": 1.0}, phase="sft")
    metrics.close(failed=True)
    expected = {1: {"sft/loss": 2.5}, 2: {"sft/loss": 2.0, "sft/grad_norm": 1.0}}  # NaN: null in the file, not sent
    assert expected_rows(tmp_path / "sft-metrics.jsonl") == expected
    records = wandb_records(tmp_path)
    assert wandb_history(records) == expected
    assert wandb_config(records)["sft"]["steps"] == cfg.sft.steps
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [1]
    assert_no_network_attempt(tmp_path, tmp_path)
    client, run = mlflow_run(uri, "sft-e")  # experiment: experiment.name
    assert (run.info.run_name, run.info.status) == ("sft-e/trial0/sft", "FAILED")
    assert mlflow_history(client, run) == expected


def test_bad_tracker_settings_are_refused_naming_the_key():
    refused = {
        "stats.wandb_mode=sometimes": r"stats\.wandb_mode: 'sometimes' is not one of 'online', 'offline', 'disabled'",
        "stats.wandb_mode=offline": r"stats\.wandb_mode is set but does nothing in this run: it needs "
                                    r"stats\.wandb_project",
        "stats.mlflow_experiment=e": r"stats\.mlflow_experiment is set but does nothing in this run: it needs "
                                     r"stats\.mlflow_tracking_uri",
        "stats.mlflow_tracking_uri=' http://h:5000'": r"stats\.mlflow_tracking_uri: ' http://h:5000' has surrounding "
                                                      r"spaces",
    }
    for override, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            load_run_config(None, [override])
    cfg = load_run_config(None, ["stats.wandb_project=p", "stats.wandb_mode=disabled", "stats.mlflow_tracking_uri=x",
                                 "stats.mlflow_experiment=e"])
    assert (cfg.stats.wandb_mode, cfg.stats.mlflow_experiment) == ("disabled", "e")
    assert load_run_config(None).stats.wandb_mode == "online"


@pytest.mark.timeout(60)
def test_a_tracker_that_is_not_installed_is_named_with_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    for name in [n for n in sys.modules if n == "mlflow" or n.startswith("mlflow.")] or ["mlflow"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"stats\.wandb_project is set but wandb is not installed: pip install wandb"):
        load_run_config(None, ["stats.wandb_project=p"])
    with pytest.raises(ConfigError, match=r"stats\.mlflow_tracking_uri is set but mlflow is not installed: pip "
                                          r"install mlflow-skinny"):
        load_run_config(None, ["stats.mlflow_tracking_uri=http://h:5000"])
    # The same from the trackers themselves (a MetricsLogger built in code, without the loader).
    with pytest.raises(RuntimeError, match=r"stats\.wandb_project is set but wandb is not installed: pip install"):
        WandbTracker("p", tmp_path)
    with pytest.raises(RuntimeError, match=r"stats\.mlflow_tracking_uri is set but MLflow is not installed: pip "
                                          r"install mlflow-skinny"):
        MlflowTracker("http://h:5000", "e")


@pytest.mark.timeout(60)
def test_a_uri_mlflow_refuses_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(RuntimeError, match=r"stats\.mlflow_tracking_uri='nope://x': MLflow refused it"):
        MlflowTracker("nope://x", "e")
    uri = (tmp_path / "mlruns").as_uri()  # MLflow 3 refuses a file store unless asked: its message says how
    with pytest.raises(RuntimeError, match=r"stats\.mlflow_tracking_uri='file:.*MLFLOW_ALLOW_FILE_STORE=true"):
        MlflowTracker(uri, "e")
