"""Run-level keys that `tandem train` hands to its parts, loaded through the run config and shown
on what those parts build: the task data (`tandem.rl.data.load_task_data`), the weight update of
the run (`tandem.rl.trainer.weight_update_meta`), the sampling parameters of the workflow
(`tandem.rl.trainer.workflow_for`) and the metrics logger's event files (its W&B and MLflow runs:
tests/rl/test_trackers.py). What the parts then do with the values is tested with the parts (the
transports, the sampler, the executor)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.errors import ConfigError
from tandem.models.tiny import build_tokenizer
from tandem.rl.config import load_run_config
from tandem.rl.data import load_task_data
from tandem.rl.metrics import MetricsLogger
from tandem.rl.trainer import weight_update_meta, workflow_for
from tandem.rollout.reward import RewardRunner
from tests.rollout import rewards


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(vocab_size=512)


def _data(tokenizer, *overrides: str):
    return load_task_data(load_run_config(None, ["task.train_size=5", "task.eval_size=3", *overrides]), tokenizer)


def test_task_and_seed_keys_shape_the_data(tokenizer):
    """Catches `task.name`, `task.train_size`, `task.eval_size`, `task.system_prompt` or
    `experiment.seed` not reaching the run's data: another task gives other items, the sizes are
    the configured ones, a system prompt lengthens every rendered prompt, another seed draws
    other problems."""
    base = _data(tokenizer)
    assert (len(base.train), len(base.eval)) == (5, 3) and base.task.name == "arithmetic"
    assert [len(d.train) for d in (_data(tokenizer, "task.train_size=9"),)] == [9]
    assert len(_data(tokenizer, "task.eval_size=7").eval) == 7
    countdown = _data(tokenizer, "task.name=countdown")
    assert countdown.task.name == "countdown" and "target" in countdown.train[0] and "target" not in base.train[0]
    prompted = _data(tokenizer, "task.system_prompt=Answer briefly.")
    assert all(len(p["input_ids"]) > len(b["input_ids"]) for p, b in zip(prompted.train, base.train, strict=True))
    assert [i["prompt"] for i in prompted.train] == [i["prompt"] for i in base.train]
    reseeded = _data(tokenizer, "experiment.seed=2")
    assert [i["prompt"] for i in reseeded.train] != [i["prompt"] for i in base.train]


def test_weight_update_keys_make_the_runs_update(tmp_path):
    """Catches `train.weight_sync`, `train.bucket_mb`, `cluster.host_ip` or `experiment.device` not
    reaching the run's weight update: its transport, bucket size (what the engine's export cuts
    at, test_engine.py::test_weight_export_buckets_match_save_model), the group's address and
    its backend."""
    default = weight_update_meta(load_run_config(None), tmp_path)
    assert (default.type, default.path, default.bucket_bytes) == ("distributed", None, 64 * 1024**2)
    assert (default.master_address, default.backend) == ("127.0.0.1", "gloo")
    disk = weight_update_meta(load_run_config(None, ["train.weight_sync=disk", "train.bucket_mb=3"]), tmp_path)
    assert (disk.type, disk.path, disk.bucket_bytes) == ("disk", str(tmp_path / "weights"), 3 * 1024**2)
    remote = weight_update_meta(load_run_config(None, ["cluster.host_ip=10.1.2.3", "experiment.device=cuda"]),
                                tmp_path)
    assert (remote.master_address, remote.backend) == ("10.1.2.3", "nccl")


@pytest.mark.parametrize(("backend", "sync", "adapters"), [
    ("tandem:d1", "distributed", True), ("tandem:d1", "shm", True), ("vllm:d1", "disk", True),
    ("vllm:d1", "distributed", False)])
def test_lora_runs_send_the_adapter_where_the_servers_take_it(tmp_path, backend, sync, adapters):
    """Catches `actor.lora.rank` not choosing what a run's updates carry: the adapter alone
    (`lora_alpha` = actor.lora.alpha) to tandem servers over every transport and to vLLM over disk,
    which then runs in LoRA mode (`rollout.vllm.lora_rank`, derived, and the client's adapter);
    merged whole weights to vLLM over a transfer group."""
    cfg = load_run_config(None, ["actor.lora.rank=8", "actor.lora.alpha=32", f"rollout.backend={backend}",
                                 f"train.weight_sync={sync}"])
    assert weight_update_meta(cfg, tmp_path).lora_alpha == (32.0 if adapters else None)
    vllm_lora = adapters and backend.startswith("vllm")
    assert cfg.rollout.vllm.lora_rank == (8 if vllm_lora else 0)
    assert cfg.rollout.client_config().vllm_lora == vllm_lora
    assert weight_update_meta(load_run_config(None, [f"rollout.backend={backend}", f"train.weight_sync={sync}"]),
                              tmp_path).lora_alpha is None  # no LoRA: whole weights
    assert load_run_config(None, [f"rollout.backend={backend}", "train.weight_sync=disk"]).rollout.vllm.lora_rank == 0


def test_vllm_lora_keys_are_refused_where_vllm_cannot_serve_them():
    with pytest.raises(ConfigError, match=r"rollout.vllm.lora_rank is derived, not set: set actor.lora.rank"):
        load_run_config(None, ["rollout.backend=vllm:d1", "rollout.vllm.lora_rank=8"])
    with pytest.raises(ConfigError, match=r"actor.lora.rank=600 is above 512, the largest adapter rank vLLM serves"):
        load_run_config(None, ["actor.lora.rank=600", "rollout.backend=vllm:d1", "train.weight_sync=disk"])
    with pytest.raises(ConfigError, match=r"train.verify_weights=true compares per-tensor checksums"):
        load_run_config(None, ["actor.lora.rank=8", "rollout.backend=vllm:d1", "train.weight_sync=disk",
                               "train.verify_weights=true"])


def test_generation_keys_are_the_workflows_sampling(tokenizer):
    """Catches a `gen.*` key not reaching the requests the workflow sends: the sampling parameters
    (the sampler applies them: tests/inference/test_sampler.py) and the group size."""
    runner = RewardRunner(max_workers=1, timeout_s=1.0)
    try:
        default = workflow_for(load_run_config(None), tokenizer, rewards.parity_reward, runner)
        cfg = load_run_config(None, ["gen.temperature=0.5", "gen.top_p=0.9", "gen.top_k=7", "gen.max_new_tokens=11",
                                     "gen.n_samples=3"])
        configured = workflow_for(cfg, tokenizer, rewards.parity_reward, runner)
    finally:
        runner.close()
    fields = ("temperature", "top_p", "top_k", "max_new_tokens")
    assert [getattr(default.params, f) for f in fields] == [1.0, 1.0, -1, 16] and default.n_samples == 4
    assert [getattr(configured.params, f) for f in fields] == [0.5, 0.9, 7, 11] and configured.n_samples == 3


def test_tensorboard_writes_event_files_only_when_asked(tmp_path):
    """Catches `stats.tensorboard` being ignored by the metrics logger (the run passes it on:
    tests/rl/test_train_e2e.py shows a run with it off writes none)."""
    for on in (True, False):
        run = tmp_path / str(on)
        run.mkdir()
        logger = MetricsLogger(run, tensorboard=load_run_config(None, [f"stats.tensorboard={on}"]).stats.tensorboard)
        logger.log(1, {"reward/mean": 0.5})
        logger.close()
        assert bool(list(Path(run).glob("tensorboard/events.out.tfevents.*"))) is on
