"""What `tandem train` records for `tandem dashboard` (`dashboard.*`, tandem/dashboard/record.py):
the recorder for a run, and each step's kept trajectories scored on the trainer.

`score_and_record` runs after the batch is built and before the update, so the trainer's logprobs are
those of the weights the step trains from: the proximal logprobs decoupled PPO uses, whose gap to
the servers' is `mismatch/*`, token by token. See docs/dashboard.md."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tandem.dashboard.record import RunRecorder
from tandem.data.batch import SequenceBatch
from tandem.data.trajectory import Trajectory
from tandem.rl.config import TandemConfig
from tandem.train.routed_experts import fill_missing_routed_experts


@contextlib.contextmanager
def run_recorder(cfg: TandemConfig, run_dir: Path, tokenizer: Any, members: Any, api_key: str | None,
                 resume_step: int | None) -> Iterator[RunRecorder | None]:
    """The run's recorder, polling `members` (the controller's) until the block ends; None when
    `dashboard.enabled` is off. The page gets a key of its own when the run's servers have one."""
    if not cfg.dashboard.enabled:
        yield None
        return
    recorder = RunRecorder(run_dir, cfg.dashboard, pieces=lambda ids: tokenizer.batch_decode([[i] for i in ids]),
                           text=tokenizer.decode, members=members, resume_step=resume_step,
                           key=secrets.token_urlsafe(24) if api_key else None, seed=cfg.experiment.seed)
    recorder.start()
    try:
        yield recorder
    finally:
        recorder.close()


def score_and_record(recorder: RunRecorder, cfg: TandemConfig, trainer: Any, step: int, version: int,
                trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Step `step`'s trajectories recorded (the kept ones scored on `trainer`, the actor's
    `TrainController`, at `version` when `dashboard.trainer_logprobs`; the files are written off
    this thread); -> the seconds the training loop spent, scoring (`time/dashboard_score`) and in
    all (`time/dashboard`)."""
    began = time.perf_counter()
    kept = recorder.sample(step, len(trajs))
    scored, scoring = None, 0.0
    if cfg.dashboard.trainer_logprobs and kept:
        scoring = time.perf_counter()
        scored = trainer_logprobs(trainer, [trajs[i] for i in kept], cfg.gen.temperature)
        scoring = time.perf_counter() - scoring
    recorder.record_step(step, version, trajs, kept, scored)
    return {"time/dashboard": time.perf_counter() - began, "time/dashboard_score": scoring}


def trainer_logprobs(trainer: Any, trajs: Sequence[Trajectory], temperature: float) -> list[list[float | None]]:
    """Each trajectory's logprobs on `trainer` (one forward, no gradient), in input alignment:
    entry t is log p(token t | the tokens before it) at a generated token, None elsewhere."""
    seqs = [t.to_tensors() for t in trajs]
    fill_missing_routed_experts(seqs)
    dp = trainer.dp_size
    # Sequence j goes to rank j % dp; every rank needs one, so with fewer sequences than ranks the
    # first ones go again (their second answer is ignored).
    order = list(range(len(seqs))) + [k % len(seqs) for k in range(max(0, dp - len(seqs)))]
    shards = [SequenceBatch([seqs[j] for j in order[r::dp]]) for r in range(dp)]
    outputs = trainer.compute_logprobs(shards, temperature, loss_tokens_only=True)
    scored: dict[int, list[float | None]] = {}
    for r, out in enumerate(outputs):
        for j, predicted in zip(order[r::dp], out.logprobs, strict=True):
            if j not in scored:
                mask = trajs[j].loss_mask
                values = predicted.tolist()  # prediction alignment: entry t scores token t + 1
                scored[j] = [values[t - 1] if t > 0 and mask[t] else None for t in range(len(mask))]
    return [scored[j] for j in range(len(trajs))]
