"""LoRA in the training engine against `peft`, the reference implementation: a saved adapter loads
with `peft.PeftModel.from_pretrained` on the `transformers` model and gives the engine's logits;
two engine steps equal the same two steps of `peft` + `torch.optim.AdamW` (`tests.train.oracle`)
on the same batch. Plus what LoRA promises about memory: frozen base in the compute dtype, float32
adapters, optimizer state for the adapters only; and a resume from a state without the base."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.errors import CheckpointError, ConfigError
from tandem.models.common.lora import ADAPTER_CONFIG, LoRAConfig, read_adapter
from tandem.train import TrainEngine
from tests.train.helpers import engine_config, make_batch, max_param_diff, rel_diff, weighted_loss
from tests.train.oracle import OracleTrainer, load_hf
from tests.train.test_optimizer_oracle import LRS, OPTIMIZER, TOTAL_STEPS

LORA = LoRAConfig(rank=4, alpha=8.0)
LOGIT_TOL, PARAM_TOL, STAT_TOL = 1e-5, 1e-6, 1e-6


def lora_engine(path, **overrides) -> TrainEngine:
    return TrainEngine(engine_config(str(path), lora=overrides.pop("lora", LORA), **overrides))


def test_saved_adapter_loads_in_peft_with_the_engines_logits(tiny_dir, tmp_path):
    import peft

    engine = lora_engine(tiny_dir)
    batch = make_batch(512)
    engine.train_batch(batch, weighted_loss)  # b moves off zero: the adapter changes the output
    engine.save_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    reference = peft.PeftModel.from_pretrained(load_hf(tiny_dir), str(tmp_path / "adapter")).eval()
    base = load_hf(tiny_dir).eval()
    logprobs = engine.forward_logprobs(batch).logprobs
    worst = moved = 0.0
    with torch.no_grad():
        for seq, ours_lp in zip(batch.seqs, logprobs, strict=True):
            ids = seq["input_ids"]
            ours = engine.model(ids, torch.tensor([0, len(ids)], dtype=torch.int32))
            theirs = reference(ids[None]).logits[0]
            worst = max(worst, float((ours - theirs).abs().max()))
            moved = max(moved, float((theirs - base(ids[None]).logits[0]).abs().max()))
            token = torch.log_softmax(theirs, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
            worst = max(worst, float((ours_lp[:-1] - token).abs().max()))
    print(f"\n[LoRA vs peft] max |logit or logprob diff| {worst:.2e}; the adapter moves the logits by {moved:.2e}")
    assert worst < LOGIT_TOL, worst
    assert moved > 1e-3, "the adapter should change the logits (else the comparison shows nothing)"


def test_two_steps_equal_peft_and_adamw(tiny_dir, tmp_path):
    engine = lora_engine(tiny_dir, optimizer=OPTIMIZER, total_train_steps=TOTAL_STEPS)
    engine.save_adapter(tmp_path / "start")  # the fresh adapter: a Kaiming-uniform, b zero
    start = read_adapter(tmp_path / "start")
    assert all(float(t.abs().max()) == 0.0 for n, t in start.items() if "lora_B" in n)
    assert all(float(t.abs().max()) > 0.0 for n, t in start.items() if "lora_A" in n)
    oracle = OracleTrainer(tiny_dir, OPTIMIZER, adapter=tmp_path / "start")
    batch = make_batch(512)
    for step, lr in enumerate(LRS):
        ours = engine.train_batch(batch, weighted_loss)
        theirs = oracle.step(batch, lr)
        assert ours["lr"] == pytest.approx(lr, rel=1e-12)
        assert rel_diff(ours["loss"], theirs["loss"]) < STAT_TOL, (step, ours, theirs)
        assert rel_diff(ours["grad_norm"], theirs["grad_norm"]) < STAT_TOL, (step, ours, theirs)
        engine.save_adapter(tmp_path / f"step{step}")
        got, want = read_adapter(tmp_path / f"step{step}"), oracle.adapter_params()
        assert sorted(got) == sorted(want)
        print(f"\n[LoRA vs peft + AdamW] step {step + 1}: max |adapter diff| {max_param_diff(got, want):.2e}, "
              f"loss rel diff {rel_diff(ours['loss'], theirs['loss']):.2e}")
        assert max_param_diff(got, want) < PARAM_TOL, step
        assert max_param_diff(got, start) > 1e-4  # the adapters did move


def test_base_frozen_in_the_compute_dtype_and_optimizer_state_for_adapters_only(tiny_dir, tmp_path):
    engine = lora_engine(tiny_dir, dtype="bfloat16")
    adapters = {n: p for n, p in engine.model.named_parameters() if ".lora." in n}
    base = {n: p for n, p in engine.model.named_parameters() if ".lora." not in n}
    # 7 target modules x 2 layers x (a, b) on the tiny preset
    assert len(adapters) == 28 and all(p.requires_grad and p.dtype == torch.float32 for p in adapters.values())
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in base.values())
    engine.train_batch(make_batch(512), weighted_loss)
    state = engine.optimizer.state
    assert len(state) == len(adapters) and all(id(p) in {id(q) for q in adapters.values()} for p in state)
    assert {id(p) for g in engine.optimizer.param_groups for p in g["params"]} == {id(p) for p in adapters.values()}
    # The training state leaves the base out (it is the run's starting checkpoint) and resumes exactly.
    engine.save_state(tmp_path / "state")
    after_save = engine.train_batch(make_batch(512, seed=1), weighted_loss)
    resumed = lora_engine(tiny_dir, dtype="bfloat16")
    resumed.load_state(tmp_path / "state")
    again = resumed.train_batch(make_batch(512, seed=1), weighted_loss)
    assert again["loss"] == after_save["loss"] and again["grad_norm"] == after_save["grad_norm"]
    # By hand: each adapter element float32 in the weights, exp_avg and exp_avg_sq, plus each
    # adapter's float32 step count; nothing of the base.
    n_elements = sum(p.numel() for p in adapters.values())
    assert saved_tensor_bytes(tmp_path / "state") == 3 * 4 * n_elements + 4 * len(adapters)


def saved_tensor_bytes(path) -> int:
    """Bytes of the tensors in a DCP checkpoint, from its metadata (float32 throughout here)."""
    import math

    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return sum(math.prod(m.size) * 4 for m in metadata.values() if hasattr(m, "size"))


def test_start_from_an_adapter_and_refusals(tiny_dir, tmp_path):
    engine = lora_engine(tiny_dir)
    engine.train_batch(make_batch(512), weighted_loss)
    engine.save_adapter(tmp_path / "trained")
    want = engine.forward_logprobs(make_batch(512)).logprobs
    started = lora_engine(tiny_dir, lora=LoRAConfig(rank=4, alpha=8.0, path=str(tmp_path / "trained")))
    got = started.forward_logprobs(make_batch(512)).logprobs
    assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)) == 0.0
    with pytest.raises(ConfigError, match=r"actor.lora.rank=8 .* set actor.lora.rank=4"):
        lora_engine(tiny_dir, lora=LoRAConfig(rank=8, alpha=8.0, path=str(tmp_path / "trained")))
    with pytest.raises(ConfigError, match=r"target_modules.*'lm_proj'"):
        lora_engine(tiny_dir, lora=LoRAConfig(rank=4, target_modules=["q_proj", "lm_proj"]))
    with pytest.raises(CheckpointError, match="not a PEFT adapter directory"):
        lora_engine(tiny_dir, lora=LoRAConfig(rank=4, path=str(tmp_path)))
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        engine.save_adapter(tmp_path / "trained")


def test_export_merged_equals_peft_merge_and_unload(tiny_dir, tmp_path):
    import subprocess
    import sys

    import peft

    engine = lora_engine(tiny_dir)
    engine.train_batch(make_batch(512), weighted_loss)
    engine.save_adapter(tmp_path / "adapter")
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "export-merged", str(tiny_dir), str(tmp_path / "adapter"),
                           str(tmp_path / "merged")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ours = load_hf(tmp_path / "merged").state_dict()
    theirs = peft.PeftModel.from_pretrained(load_hf(tiny_dir), str(tmp_path / "adapter")).merge_and_unload().state_dict()
    assert sorted(ours) == sorted(theirs)
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 1e-6
    assert float((ours["model.layers.0.self_attn.q_proj.weight"] - load_hf(tiny_dir).state_dict()[
        "model.layers.0.self_attn.q_proj.weight"]).abs().max()) > 1e-4  # the merge changed the weights
    wrong = subprocess.run([sys.executable, "-m", "tandem.cli", "export-merged", str(tmp_path / "merged"),
                            str(tmp_path), str(tmp_path / "again")], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "not a PEFT adapter directory" in wrong.stderr


def test_dropout_acts_in_training_forwards_only(tiny_dir, tmp_path):
    batch = make_batch(512)
    plain = lora_engine(tiny_dir)
    plain.train_batch(batch, weighted_loss)  # b moves off zero, so the adapter path carries signal
    plain.save_adapter(tmp_path / "adapter")
    dropped = lora_engine(tiny_dir, lora=LoRAConfig(rank=4, alpha=8.0, dropout=0.5, path=str(tmp_path / "adapter")))
    kept = lora_engine(tiny_dir, lora=LoRAConfig(rank=4, alpha=8.0, path=str(tmp_path / "adapter")))
    a, b = dropped.forward_logprobs(batch).logprobs, kept.forward_logprobs(batch).logprobs
    assert max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) == 0.0  # no dropout in eval
    assert dropped.train_batch(batch, weighted_loss)["loss"] != kept.train_batch(batch, weighted_loss)["loss"]
