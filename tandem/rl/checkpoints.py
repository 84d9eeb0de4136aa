"""A trial's checkpoints: immutable directories, written whole or not at all, and a `LATEST` pointer.

    checkpoints/step00000004/{trainer/, critic/ (PPO), loop_state.json}   checkpoints/LATEST

`save_checkpoint` writes into a hidden `.stepNNNNNNNN.partial-<pid>` directory, fsyncs it, renames
it and only then replaces `LATEST` (atomically), so a save cut short leaves `LATEST` on the
previous complete checkpoint; the next save removes the leftovers and all but the newest `keep`
checkpoints. See docs/recovery.md, "What a checkpoint holds" and "Writing a checkpoint, atomically"."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.errors import ConfigError
from tandem.rollout.frontier import FrontierState

CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
LOOP_STATE = "loop_state.json"
TRAINER = "trainer"
CRITIC = "critic"  # PPO's critic, next to the actor's state
FORMAT = 2  # loop_state.json's layout


@dataclass(frozen=True)
class LoopState:
    """The controller's part of a checkpoint: where the loop and the item stream stand."""

    step: int  # the weight version the trainer holds (= steps trained)
    frontier: FrontierState = field(default_factory=FrontierState)
    seed: int = 0  # the run's seed (experiment.seed): sampling seeds derive from it

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "step": self.step, "frontier": self.frontier.to_dict(), "seed": self.seed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopState:
        return cls(int(data["step"]), FrontierState.from_dict(data["frontier"]), int(data.get("seed", 0)))


def checkpoint_name(step: int) -> str:
    return f"step{step:08d}"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `LATEST` names, or None when there is none (no `LATEST`)."""
    pointer = checkpoints_dir(run_dir) / LATEST
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        return None
    path = checkpoints_dir(run_dir) / name
    if not name or "/" in name or not (path / LOOP_STATE).is_file():
        raise ConfigError(f"{pointer} names {name!r}, which is not a complete checkpoint; the trial's checkpoints "
                          "were changed by hand. Point it at a complete stepNNNNNNNN directory, or start again "
                          "with train.overwrite=true")
    return path


def read_loop_state(checkpoint: Path, key: str = "train.resume_from") -> LoopState:
    path = checkpoint / LOOP_STATE
    if not path.is_file():
        raise ConfigError(f"{key}: {str(checkpoint)!r} has no {LOOP_STATE}; pass a checkpoint directory "
                          f"written by train.save_every (runs/<name>/<trial>/{CHECKPOINTS}/stepNNNNNNNN)")
    try:
        return LoopState.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{key}: cannot read {str(path)!r} ({exc}); the checkpoint is damaged") from None


def save_checkpoint(run_dir: Path, state: LoopState, save_trainer: Callable[[Path], None], keep: int) -> Path:
    """Write the checkpoint of `state.step` (the trainer's part through `save_trainer(directory)`),
    make it `LATEST`, and keep the newest `keep`; returns its directory."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    _remove_partials(root)
    final = root / checkpoint_name(state.step)
    partial = root / f".{final.name}.partial-{os.getpid()}"
    save_trainer(partial / TRAINER)
    (partial / LOOP_STATE).write_text(json.dumps(state.to_dict()))
    fsync_tree(partial)
    replaced = None
    if final.exists():  # the same step saved before (a run that redid it): the new one replaces it
        replaced = root / f".{final.name}.replaced-{os.getpid()}"
        os.replace(final, replaced)
    os.replace(partial, final)
    fsync_dir(root)
    write_pointer(root / LATEST, final.name)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    _prune(root, keep)
    return final


def write_pointer(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically and durably."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (and `root`)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_partials(root: Path) -> None:
    """What saves cut short left behind (never loaded: only complete directories are named)."""
    for path in [*root.glob(".step*.partial-*"), *root.glob(".step*.replaced-*")]:
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(f".{LATEST}.tmp-*"):
        path.unlink(missing_ok=True)


def _prune(root: Path, keep: int) -> None:
    latest = (root / LATEST).read_text().strip()
    complete = sorted(p for p in root.glob("step*") if p.is_dir() and p.name != latest)
    for path in complete[: max(0, len(complete) - (keep - 1))]:
        with contextlib.suppress(OSError):
            shutil.rmtree(path)
