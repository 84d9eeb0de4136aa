"""The `dashboard.*` keys, each shown by what changes when it changes (the run side:
`tandem.rl.recording`, with the run's config and the tiny model's tokenizer)."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tandem.data.batch import INPUT_IDS
from tandem.data.trajectory import Trajectory
from tandem.errors import ConfigError
from tandem.rl.config import load_run_config
from tandem.rl.recording import run_recorder, score_and_record

FLEET = {"version": 0, "servers": [{"address": "http://127.0.0.1:1", "state": "healthy", "version": 0,
                                    "in_flight": 0, "tokens_served": 0, "last_error": ""}]}


class Scorer:
    """Stands in for the trainer at the dashboard's boundary: counts the sequences it scores and
    answers each token's logprob as -token_id/1000 (prediction alignment: entry t scores t + 1)."""

    dp_size = 2

    def __init__(self):
        self.scored = []

    def compute_logprobs(self, shards, temperature, loss_tokens_only):
        self.scored += [seq[INPUT_IDS].tolist() for shard in shards for seq in shard.seqs]
        return [type("Out", (), {"logprobs": [torch.cat([-seq[INPUT_IDS][1:].float() / 1000, torch.zeros(1)])
                                              for seq in shard.seqs]}) for shard in shards]


def cfg_with(tmp_path, model_dir, **dashboard):
    return load_run_config(None, [f"actor.path={model_dir}", f"experiment.fileroot={tmp_path}",
                            *[f"dashboard.{k}={v}" for k, v in dashboard.items()]])


def trajs(n: int) -> list[Trajectory]:
    return [Trajectory.from_generation([5, 6], [7 + i, 8 + i, 9 + i], [-0.1] * 3, [0] * 3, reward=float(i)) for i in range(n)]


def run_one_step(tmp_path, cfg, model_dir, scorer) -> Path:
    run = tmp_path / "run"
    run.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with run_recorder(cfg, run, tokenizer, lambda: FLEET, api_key="servers-key", resume_step=None) as rec:
        if rec is not None:
            score_and_record(rec, cfg, scorer, 1, 0, trajs(5))
    return run


def test_enabled_records_the_run_and_off_writes_nothing(tmp_path, model_dir):
    run = run_one_step(tmp_path / "on", cfg_with(tmp_path, model_dir), model_dir, Scorer())
    assert (run / "dashboard" / "steps.jsonl").is_file() and (run / "dashboard" / "key").is_file()
    off = run_one_step(tmp_path / "off", cfg_with(tmp_path, model_dir, enabled="false"), model_dir, Scorer())
    assert not (off / "dashboard").exists()


def test_trajectories_per_step_and_trainer_logprobs_choose_what_is_kept_and_scored(tmp_path, model_dir):
    scorer = Scorer()
    run = run_one_step(tmp_path / "a", cfg_with(tmp_path, model_dir, trajectories_per_step=3, trainer_logprobs="true"),
                       model_dir, scorer)
    step = json.loads((run / "dashboard" / "steps.jsonl").read_text())
    assert step["sampled"] == 3 and step["n"] == 5
    assert len(scorer.scored) == 3  # three sequences over two ranks: one each, and one more on rank 0
    with gzip.open(run / "dashboard" / "trajectories" / "step-000001.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    for row in rows:  # trajectory i (its reward) is [5, 6, 7+i, 8+i, 9+i]; the prompt is not scored, and
        i = int(row["reward"])  # token t's logprob is the prediction at t - 1 (input alignment)
        assert row["trainer_logprobs"] == pytest.approx([None, None, -(7 + i) / 1000, -(8 + i) / 1000, -(9 + i) / 1000])
    unscored = Scorer()
    run = run_one_step(tmp_path / "b", cfg_with(tmp_path, model_dir), model_dir, unscored)  # the default: off
    assert unscored.scored == []
    with gzip.open(run / "dashboard" / "trajectories" / "step-000001.jsonl.gz", "rt") as f:
        assert all(json.loads(line)["trainer_logprobs"] is None for line in f)


def test_fleet_interval_s_sets_how_often_the_fleet_is_recorded(tmp_path, model_dir):
    calls = []

    def members():
        calls.append(time.monotonic())
        return FLEET

    cfg = cfg_with(tmp_path, model_dir, fleet_interval_s=0.2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with run_recorder(cfg, tmp_path, tokenizer, members, api_key=None, resume_step=None):
        time.sleep(1.1)
    assert 5 <= len(calls) <= 9, len(calls)  # 1.1 s / 0.2 s polls, plus the one at the close
    with pytest.raises(ConfigError, match=r"dashboard\.fleet_interval_s"):
        cfg_with(tmp_path, model_dir, fleet_interval_s=0)
    with pytest.raises(ConfigError, match=r"dashboard\.trajectories_per_step"):
        cfg_with(tmp_path, model_dir, trajectories_per_step=-1)
