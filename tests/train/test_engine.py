"""TrainEngine in one process: micro-batching and packing equivalence, determinism, activation
checkpointing, dtype policy, LR schedules, checkpoints and weight export."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from tandem.errors import ConfigError
from tandem.models import load_model, save_model
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.parallel import ParallelizeConfig
from tandem.train import LRSchedule, MicroBatchConfig, TrainEngine
from tandem.train.config import OptimizerConfig
from tests.train.helpers import (
    engine_config,
    full_params,
    make_batch,
    max_param_diff,
    rel_diff,
    train_steps,
)

TOL = 1e-5


def _run(path, steps=3, **overrides):
    engine = TrainEngine(engine_config(str(path), **overrides))
    stats = train_steps(engine, make_batch(engine.model.args.vocab_size), steps)
    params = full_params(engine)
    engine.close()
    return stats, params


def _assert_same_run(ref, other, label):
    (s_ref, p_ref), (s_other, p_other) = ref, other
    loss = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(s_ref, s_other, strict=True))
    gnorm = max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in zip(s_ref, s_other, strict=True))
    param = max_param_diff(p_ref, p_other)
    print(f"\n[{label}] max rel diff: loss {loss:.2e}, grad norm {gnorm:.2e}; max |param diff| {param:.2e}")
    assert loss <= TOL and gnorm <= TOL and param <= TOL


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """One micro-batch, 3 steps."""
    return _run(tiny_dir)


def test_stats(reference):
    stats, _ = reference
    batch = make_batch(512)
    first = stats[0]
    assert first["n_tokens"] == sum(batch.lengths) and first["n_mbs"] == 1
    # Loss tokens: predicted positions whose target is in the response (the shifted mask).
    assert first["n_loss_tokens"] == sum(int(s["loss_mask"][1:].sum()) for s in batch.seqs)
    assert first["lr"] == 1e-3 and first["time"] > 0 and first["skipped"] == 0
    assert stats[2]["loss"] < stats[0]["loss"]  # it learns


@pytest.mark.slow
def test_n_mbs_1_vs_4(tiny_dir, reference):
    _assert_same_run(reference, _run(tiny_dir, mb=MicroBatchConfig(n_mbs=4)), "n_mbs 1 vs 4")


@pytest.mark.slow
def test_ffd_vs_kk_packing(tiny_dir):
    ffd = _run(tiny_dir, mb=MicroBatchConfig(max_tokens_per_mb=48, packing="ffd"))
    kk = _run(tiny_dir, mb=MicroBatchConfig(max_tokens_per_mb=48, packing="kk"))
    assert ffd[0][0]["n_mbs"] >= 4 and kk[0][0]["n_mbs"] >= 4
    _assert_same_run(ffd, kk, "FFD vs KK")


def test_balance_chooses_the_cost_kk_packing_evens(tiny_dir):
    """Catches the engine packing by tokens whatever `balance` says, or measuring FLOPs with another
    hidden size than its model's (64 here: FLOP cost 768·L + L²). Lengths 1000, 200, 400, 400, 400
    in two micro-batches: tokens even out as {1000, 200} / {400, 400, 400} (1200 / 1200), FLOPs as
    {1000} / {200, 400, 400, 400} (1,768,000 / 1,595,200; {1000, 200} would be 1,961,600)."""
    plans = {}
    for balance in ("tokens", "flops"):
        engine = TrainEngine(engine_config(str(tiny_dir), balance=balance,
                                           mb=MicroBatchConfig(max_tokens_per_mb=None, n_mbs=2, packing="kk")))
        assert engine.model.args.dim == 64
        batch = make_batch(engine.model.args.vocab_size, [1000, 200, 400, 400, 400])
        plans[balance] = sorted(list(mb.indices) for mb in engine._micro_batches(batch))
        engine.close()
    assert plans == {"tokens": [[0, 1], [2, 3, 4]], "flops": [[0], [1, 2, 3, 4]]}


@pytest.mark.slow
def test_activation_checkpointing_modes_match(tiny_dir, reference):
    full = ParallelizeConfig(activation_checkpoint="full")
    _assert_same_run(reference, _run(tiny_dir, parallelize=full), "AC full")
    selective = ParallelizeConfig(activation_checkpoint="selective", ac_every=2)
    _assert_same_run(reference, _run(tiny_dir, parallelize=selective), "AC sel/2")
    op_level = ParallelizeConfig(activation_checkpoint="selective", ac_selective="op")
    _assert_same_run(reference, _run(tiny_dir, parallelize=op_level), "AC sel/op")


@pytest.mark.slow
def test_memory_budget_checkpointing_through_compile(tiny_dir, reference, monkeypatch, functorch_config):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    budget = ParallelizeConfig(activation_checkpoint="memory_budget", ac_memory_budget=0.25, compile=True)
    _assert_same_run(reference, _run(tiny_dir, parallelize=budget), "AC memory budget 0.25 (compiled)")
    assert functorch_config.activation_memory_budget == 0.25
    with pytest.raises(ConfigError, match=r"parallelize.activation_checkpoint=memory_budget works through "
                                          r"torch.compile's partitioner: set parallelize.compile=true"):
        TrainEngine(engine_config(str(tiny_dir), parallelize=ParallelizeConfig(activation_checkpoint="memory_budget")))


def test_offload_is_refused_on_a_cpu_run_with_the_reason(tiny_dir):
    with pytest.raises(ConfigError, match=r"parallelize.offload_params=true needs an accelerator"):
        TrainEngine(engine_config(str(tiny_dir), parallelize=ParallelizeConfig(offload_params=True)))


def test_deterministic_mode_sets_the_environment(tiny_dir, monkeypatch):
    for key in ("NCCL_ALGO", "TORCH_COMPILE_DETERMINISTIC"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own value is kept
    TrainEngine(engine_config(str(tiny_dir), deterministic=True)).close()
    assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["TORCH_COMPILE_DETERMINISTIC"] == "1"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_deterministic_mode_is_bit_identical(tiny_dir):
    runs = [_run(tiny_dir, deterministic=True, seed=3) for _ in range(2)]
    losses = [[s["loss"] for s in stats] for stats, _ in runs]
    print(f"\n[deterministic] losses {losses[0]} / {losses[1]}")
    assert losses[0] == losses[1]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_bf16_compute_dtype(tiny_dir, reference):
    stats, params = _run(tiny_dir, steps=1, dtype="bfloat16")
    diff = rel_diff(stats[0]["loss"], reference[0][0]["loss"])
    print(f"\n[bf16] first loss rel diff vs fp32: {diff:.2e}")
    assert 0 < diff < 2e-2  # bf16 compute changes the loss (actor.dtype is applied), a little
    assert all(t.dtype == torch.float32 for t in params.values())  # float32 master weights


def test_lr_schedules():
    def lrs(kind, warmup, total=10, min_ratio=0.1):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        sched = LRSchedule(opt, kind, total, warmup, min_ratio)
        out = []
        for _ in range(total + 2):
            out.append(sched.get_lr())
            sched.step()
        return out

    assert lrs("constant", 0) == [2.0] * 12
    assert lrs("constant", 4)[:5] == [0.5, 1.0, 1.5, 2.0, 2.0]
    lin = lrs("linear", 2)
    assert lin[:3] == [1.0, 2.0, 2.0] and lin[10:] == [0.2, 0.2]
    assert math.isclose(lin[6], 0.2 + 1.8 * (1 - 4 / 8))
    cos = lrs("cosine", 0)
    assert cos[0] == 2.0 and math.isclose(cos[5], 0.2 + 1.8 * 0.5) and math.isclose(cos[10], 0.2)
    assert all(a >= b for a, b in itertools.pairwise(cos))


def test_save_hf_then_transformers_loads_it(tiny_dir, tmp_path):
    import transformers

    engine = TrainEngine(engine_config(str(tiny_dir)))
    batch = make_batch(512)
    train_steps(engine, batch, 1)
    out = engine.save_hf(tmp_path / "hf", tokenizer_dir=tiny_dir, max_shard_bytes=100_000)
    ours = engine.forward_logprobs(batch)
    exported = full_params(engine)
    engine.close()
    saved = dict(iter_hf_tensors(out))
    assert saved.keys() == exported.keys() and all(torch.equal(saved[k], exported[k]) for k in saved)
    assert (out / "model.safetensors.index.json").is_file()  # the small shard limit split it
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    diff = 0.0
    with torch.no_grad():
        for seq, logprobs in zip(batch.seqs, ours.logprobs, strict=True):
            ids = seq["input_ids"]
            ref = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)[:-1].gather(-1, ids[1:, None])[:, 0]
            diff = max(diff, (logprobs[:-1] - ref).abs().max().item())
    print(f"\n[save_hf] max |logprob diff| vs transformers on the saved dir: {diff:.2e}")
    assert diff <= TOL
    assert transformers.AutoTokenizer.from_pretrained(out).vocab_size > 0


def test_resume_gives_the_uninterrupted_loss(tiny_dir, tmp_path):
    optimizer = OptimizerConfig(lr=1e-3, lr_scheduler="cosine", warmup_steps_proportion=0.25, min_lr_ratio=0.1)
    cfg = dict(optimizer=optimizer, total_train_steps=4, mb=MicroBatchConfig(n_mbs=2))
    batch = make_batch(512)
    uninterrupted, _ = _run(tiny_dir, steps=3, **cfg)

    first = TrainEngine(engine_config(str(tiny_dir), **cfg))
    train_steps(first, batch, 2)
    first.save_state(tmp_path / "state")
    first.close()
    resumed = TrainEngine(engine_config(str(tiny_dir), **cfg))
    resumed.load_state(tmp_path / "state")
    assert resumed.step == 2
    stats = train_steps(resumed, batch, 1)[0]
    resumed.close()
    print(f"\n[resume] step-3 loss {stats['loss']!r} vs uninterrupted {uninterrupted[2]['loss']!r}")
    assert stats["loss"] == uninterrupted[2]["loss"]
    assert stats["lr"] == uninterrupted[2]["lr"] and stats["grad_norm"] == uninterrupted[2]["grad_norm"]


def test_weight_export_buckets_match_save_model(tiny_dir, tmp_path):
    reference = dict(iter_hf_tensors(save_model(load_model(tiny_dir), tmp_path / "ref")))
    engine = TrainEngine(engine_config(str(tiny_dir)))
    limit = 40_000
    buckets = [[(n, t.clone()) for n, t in b] for b in engine.export_weights(limit, torch.float32)]
    engine.close()
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(reference) and len(names) == len(set(names))
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1
    assert all(torch.equal(t, reference[n]) for b in buckets for n, t in b)
    print(f"\n[export] {len(names)} tensors in {len(buckets)} buckets of <= {limit} bytes")


@pytest.mark.slow
def test_compiled_blocks_match_eager(tiny_dir, reference, monkeypatch):
    """Per-block torch.compile (cold compile: ~20 s on 2 CPU cores)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "compile_threads", 1)
    _assert_same_run(reference, _run(tiny_dir, parallelize=ParallelizeConfig(compile=True)), "compile")


def test_weight_export_gathers_lazily(tiny_dir, monkeypatch):
    import tandem.train.weight_export as weight_export

    gathered = []
    real = weight_export.gather_bucket
    monkeypatch.setattr(weight_export, "gather_bucket",
                        lambda entries, *a: gathered.append(len(entries)) or real(entries, *a))
    engine = TrainEngine(engine_config(str(tiny_dir)))
    buckets = engine.export_weights(40_000)
    first = next(buckets)
    assert gathered == [len(first)]  # only the first bucket has been materialised
    rest = list(buckets)
    engine.close()
    assert gathered == [len(first)] + [len(b) for b in rest] and sum(gathered) == 24
    assert all(t.dtype == torch.float32 for b in rest for _, t in b)  # the compute dtype by default


def test_engine_refuses_an_invalid_config_naming_the_key(tiny_dir):
    with pytest.raises(ConfigError, match=r"parallelize.ac_every: 0 is below the minimum 1"):
        TrainEngine(engine_config(str(tiny_dir), parallelize=ParallelizeConfig(activation_checkpoint="selective",
                                                                                ac_every=0)))
