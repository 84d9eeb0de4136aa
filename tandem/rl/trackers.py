"""The experiment trackers a run's numbers also go to: Weights & Biases and MLflow, both optional.

`MetricsLogger` (tandem.rl.metrics) drives them: each tracker starts a run of its own with the
run's config, receives every step's values (`phase/key` names, as TensorBoard gets them), and at
the end the files the run leaves (`plot.png`, `summary.txt`) as artifacts. `start_trackers` starts
the ones `stats.*` asks for. A run that resumes starts new tracker runs (the same name), from the
step it resumes at.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tandem.rl.config import StatsConfig

INSTALL = "pip install 'tandem[trackers]'"
_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's SQLAlchemy stores (not in mlflow-skinny)


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float], time_s: float) -> None:
        """One step's finite numbers, keyed `phase/key`; `time_s` is when they were logged (Unix time)."""

    def finish(self, artifacts: Sequence[Path] = (), failed: bool = False) -> None:
        """Upload the files in `artifacts` that exist and end the tracker's run (as failed when `failed`)."""


class WandbTracker:
    """A W&B run in `mode` (online, offline or disabled); its local files go to `run_dir/wandb`
    (an offline run is uploaded later with `wandb sync`)."""

    def __init__(self, project: str, run_dir: Path, *, mode: str = "online", name: str = "",
                 config: dict[str, Any] | None = None, key: str = "stats.wandb_project"):
        try:
            import wandb
        except ImportError as exc:  # a config asked for it: say how to get it
            raise RuntimeError(f"{key} is set but wandb is not installed: pip install wandb (or {INSTALL})") from exc
        self._wandb = wandb
        self.run = wandb.init(project=project, name=name or None, config=config, mode=mode, dir=str(run_dir))

    def log(self, step: int, values: dict[str, float], time_s: float) -> None:
        self.run.log(values, step=step)

    def finish(self, artifacts: Sequence[Path] = (), failed: bool = False) -> None:
        files = [path for path in artifacts if path.is_file()]
        if files:
            # One artifact of the run's outputs; "immutable": referenced where they are (no staging copy).
            artifact = self._wandb.Artifact(f"run-{self.run.id}-outputs", type="run-outputs")
            for path in files:
                artifact.add_file(str(path), name=path.name, policy="immutable")
            self.run.log_artifact(artifact)
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run in `experiment` at `tracking_uri` (through `MlflowClient`: no global active
    run); the config goes in as flattened params (`actor.optimizer.lr`), values as metrics."""

    def __init__(self, tracking_uri: str, experiment: str, *, name: str = "", config: dict[str, Any] | None = None,
                 key: str = "stats.mlflow_tracking_uri"):
        try:
            from mlflow.entities import Param
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
        except ImportError as exc:
            raise RuntimeError(f"{key} is set but MLflow is not installed: pip install mlflow-skinny (or "
                               f"{INSTALL})") from exc
        try:
            self.client = MlflowClient(tracking_uri)
            self.experiment_id = _experiment_id(self.client, experiment)
            self.run_id = self.client.create_run(self.experiment_id, run_name=name or None).info.run_id
        except MlflowException as exc:
            hint = ""
            if tracking_uri.split(":", 1)[0].split("+", 1)[0] in _DATABASES and importlib.util.find_spec("sqlalchemy") is None:
                hint = " (a database store needs the full MLflow: pip install mlflow)"
            raise RuntimeError(f"{key}={tracking_uri!r}: MLflow refused it{hint}: {exc.message}") from None
        params = [Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in flat_params(config or {}).items()]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):  # a tracking server takes 100 a call
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, step: int, values: dict[str, float], time_s: float) -> None:
        from mlflow.entities import Metric

        stamp = int(time_s * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), stamp, step) for k, v in values.items()])

    def finish(self, artifacts: Sequence[Path] = (), failed: bool = False) -> None:
        for path in artifacts:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def _experiment_id(client: Any, name: str) -> str:
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # another run created it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """MLflow params of a nested config: dotted keys; strings as they are, other values as JSON
    (`true`, `null`, `[1, 2]`), an empty section as `{}`."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def start_trackers(stats: StatsConfig, run_dir: Path, *, name: str, experiment: str,
                   config: dict[str, Any] | None = None) -> list[Tracker]:
    """The trackers `stats` asks for, each with a run named `name`; MLflow's experiment is
    `stats.mlflow_experiment`, else `experiment`. One that fails to start ends those started."""
    trackers: list[Tracker] = []
    try:
        if stats.wandb_project:
            trackers.append(WandbTracker(stats.wandb_project, run_dir, mode=stats.wandb_mode, name=name, config=config))
        if stats.mlflow_tracking_uri:
            trackers.append(MlflowTracker(stats.mlflow_tracking_uri, stats.mlflow_experiment or experiment, name=name,
                                          config=config))
    except BaseException:
        for tracker in trackers:
            tracker.finish(failed=True)
        raise
    return trackers
