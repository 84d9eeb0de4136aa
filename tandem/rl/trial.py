"""What a launch of `tandem train` into a trial directory does: start, resume, replace, or refuse.

`runs/<experiment.name>/<experiment.trial>/` is one trial. `train.resume_from` continues from that
checkpoint; otherwise the trial's `checkpoints/LATEST` is resumed (`recover.mode=auto` or `resume`)
or refused (`off`, or already at `train.total_steps`), `recover.mode=resume` refuses a trial
without one, and earlier RL outputs without a checkpoint are refused. `train.overwrite=true`
removes the earlier RL outputs (logs and `tandem sft`'s outputs are kept) and, without
`train.resume_from`, starts at step 0. `plan_trial` reads the file system only (a refusal comes in
well under a second); `TrialPlan.prepare()` then makes the directory. The cases: docs/rl.md,
"Launching into a trial again, and resuming"."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import ConfigError
from tandem.rl.checkpoints import CHECKPOINTS, LoopState, latest_checkpoint, read_loop_state
from tandem.rl.config import TandemConfig

# What `tandem train` writes into a trial (everything but logs/ and W&B's wandb/, which holds every launch's
# runs, tandem sft's too, until synced); overwrite removes exactly these.
RL_OUTPUTS = ("config.yaml", "metrics.jsonl", "summary.txt", "plot.png", "tensorboard", "dashboard", CHECKPOINTS,
              "weights")


@dataclass(frozen=True)
class TrialPlan:
    run_dir: Path
    resume_from: Path | None  # the checkpoint directory to continue from; None: start at step 0
    loop: LoopState  # where the loop and the item stream stand (the checkpoint's; step 0: nothing drawn)
    replace: tuple[Path, ...] = ()  # earlier outputs that `prepare` removes (train.overwrite=true)
    automatic: bool = False  # the checkpoint was found in the trial, not named by train.resume_from

    @property
    def start_step(self) -> int:
        """The weight version the run starts from (= the checkpoint's step)."""
        return self.loop.step

    def describe(self) -> str:
        if self.resume_from is not None:
            how = "found in the trial" if self.automatic else "train.resume_from"
            return f"resuming at step {self.start_step} from {self.resume_from} ({how})"
        if self.replace:
            return "starting at step 0, replacing the outputs of an earlier run (train.overwrite=true)"
        return "starting at step 0"

    def prepare(self) -> None:
        """Create the trial directory; remove the earlier outputs that overwrite replaces."""
        for path in self.replace:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)


def run_dir_of(cfg: TandemConfig) -> Path:
    return Path(cfg.experiment.fileroot) / cfg.experiment.name / cfg.experiment.trial


def plan_trial(cfg: TandemConfig) -> TrialPlan:
    """Decide what this launch does with its trial directory (see the module docstring); raises
    `ConfigError` for a launch that would mix or silently discard runs."""
    run_dir = run_dir_of(cfg)
    total = cfg.train.total_steps
    earlier = [run_dir / name for name in RL_OUTPUTS if (run_dir / name).exists()]
    if cfg.train.resume_from:
        ckpt = Path(cfg.train.resume_from)
        if cfg.train.overwrite and _inside(ckpt, run_dir):
            raise ConfigError(f"train.overwrite=true would delete the checkpoint that train.resume_from names "
                              f"({str(ckpt)!r}); drop one of the two")
        return _resume(cfg, run_dir, ckpt, automatic=False, replace=tuple(earlier) if cfg.train.overwrite else ())
    fresh = LoopState(0, seed=cfg.experiment.seed)
    if cfg.train.overwrite:
        return TrialPlan(run_dir, None, fresh, replace=tuple(earlier))
    latest = latest_checkpoint(run_dir)
    mode = cfg.recover.mode
    if latest is not None and mode == "off":
        raise ConfigError(
            f"{run_dir} has checkpoints (the latest: {latest.name}) and recover.mode=off does not resume: pass "
            f"train.overwrite=true to start again, recover.mode=auto to continue, or a new experiment.trial")
    if latest is None and mode == "resume":
        raise ConfigError(f"recover.mode=resume: {run_dir} has no checkpoint to resume from (checkpoints/LATEST); "
                          "set recover.mode=auto to start at step 0 when there is none")
    if latest is not None:
        plan = _resume(cfg, run_dir, latest, automatic=True)
        if plan.start_step >= total:
            raise ConfigError(
                f"{run_dir} is complete: its latest checkpoint ({latest.name}) is at step {plan.start_step} and "
                f"train.total_steps={total}. Raise train.total_steps to train on, or start again with "
                f"train.overwrite=true or a new experiment.trial (e.g. experiment.trial={cfg.experiment.trial}-2)")
        return plan
    if earlier:
        names = ", ".join(p.name for p in earlier)
        raise ConfigError(
            f"{run_dir} already holds the outputs of an earlier run ({names}) and no checkpoint to resume from "
            f"(train.save_every was 0). Pass train.overwrite=true to replace them, or a new trial name such as "
            f"experiment.trial={cfg.experiment.trial}-2 to keep them")
    return TrialPlan(run_dir, None, fresh)


def _resume(cfg: TandemConfig, run_dir: Path, ckpt: Path, automatic: bool,
            replace: tuple[Path, ...] = ()) -> TrialPlan:
    state = read_loop_state(ckpt, "train.resume_from" if not automatic else f"checkpoint {ckpt}")
    return TrialPlan(run_dir, ckpt, state, replace=replace, automatic=automatic)


def _inside(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def relaunch_plan(cfg: TandemConfig) -> TrialPlan:
    """After a failed run of `cfg` (recover.retries): continue from the trial's latest checkpoint,
    or start again at step 0 when the run saved none."""
    run_dir = run_dir_of(cfg)
    latest = latest_checkpoint(run_dir)
    if latest is not None:
        return _resume(cfg, run_dir, latest, automatic=True)
    earlier = tuple(run_dir / name for name in RL_OUTPUTS if (run_dir / name).exists())
    return TrialPlan(run_dir, None, LoopState(0, seed=cfg.experiment.seed), replace=earlier)
