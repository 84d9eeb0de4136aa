"""LoRA under the engine's parallel layouts against one rank (d1) on the same global batch, on the
untied 4-layer tiny model: d2 (FSDP), t2, p2 (1F1B and ZBV) and c2, each at world 2 on its share of the
batch: per-step loss and grad norm, the trained adapters (exported to rank 0 under PEFT names, and
saved as a PEFT directory), log-probs, a DCP resume, a start from the saved adapter, and the merged
export (refused under pp). Then d2 in bfloat16 (base frozen in bf16, adapters float32), and SFT of
a tiny Qwen3-MoE with adapters on its attention and dense MLP at archon:d2e2 (experts split over
the two ranks) against d1. One spawned group runs every layout. Tolerances: the layouts' own tests
(test_engine_distributed, test_engine_tp, test_engine_pipeline, test_engine_context_parallel)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tandem.models.common.lora import PEFT_PREFIX, merged_weight, read_adapter
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.models.tiny import init_model
from tests.distributed import run_distributed
from tests.train.dist_workers import split
from tests.train.helpers import make_batch, max_param_diff, rel_diff
from tests.train.lora_workers import (
    LAYOUTS,
    LORA,
    MOE_STEPS,
    SCHEDULE,
    STEPS,
    all_layouts,
    layout_checks,
    moe_sft,
)

pytestmark = pytest.mark.slow
# layout -> (loss, grad norm (both relative), adapter and merged weights, log-probs (absolute))
TOLS = {"d2": (1e-5, 1e-5, 1e-5, 1e-5), "t2": (1e-5, 1e-4, 1e-5, 1e-5), "p2": (1e-5, 1e-4, 1e-5, 1e-5),
        "p2-zbv": (1e-5, 1e-4, 1e-5, 1e-5), "c2": (1e-5, 1e-4, 1e-5, 1e-5)}
MOE_TOL = 1e-5  # the acceptance line: LoRA SFT of Qwen3-MoE at archon:d2e2 equals d1


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny untied Qwen3-MoE, one dense layer among the MoE ones (8 experts, top-2)."""
    return init_model(tmp_path_factory.mktemp("models") / "qwen3-moe", arch="qwen3_moe", preset="tiny", seed=0,
                      overrides={"num_hidden_layers": 3, "mlp_only_layers": [1], "tie_word_embeddings": False})


@pytest.fixture(scope="module")
def d1(untied4_dir, moe_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-d1")
    res = layout_checks(0, 1, str(untied4_dir), str(out), {})
    res["moe"] = moe_sft(str(moe_dir), make_batch(512))
    if dist.is_initialized():
        dist.destroy_process_group()
    return res, out


@pytest.fixture(scope="module")
def world2(untied4_dir, moe_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-world2")
    return run_distributed(all_layouts, 2, args=(str(untied4_dir), str(moe_dir), str(out)), timeout=900), out


def gathered(buckets: list[list[tuple[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    return {n: t for b in buckets for n, t in b}


def test_d1_reference_is_lora(d1, untied4_dir):
    """What the layouts are held to: only adapters train, they move, and the merged export is
    `W + (alpha / r) B A` of the checkpoint's W (by hand)."""
    ref, _ = d1
    assert all(".lora." in n and dtype == torch.float32 for n, (_, dtype) in ref["trainable"].items())
    # Every step is clipped (the layouts' clipping is compared too).
    assert all(s["grad_norm"] > SCHEDULE["optimizer"].gradient_clipping for s in ref["stats"] + ref["moe"]["stats"])
    adapters = gathered(ref["adapter"])
    assert len(adapters) == 7 * 4 * 2 and all(n.startswith(PEFT_PREFIX) for n in adapters)
    assert all(float(t.abs().max()) > 0 for n, t in adapters.items() if "lora_B" in n)
    base, merged = dict(iter_hf_tensors(untied4_dir)), gathered(ref["merged"])
    assert merged.keys() == base.keys()
    for name, w in merged.items():
        module = name.removesuffix(".weight")
        a, b = adapters.get(f"{PEFT_PREFIX}{module}.lora_A.weight"), adapters.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
        want = base[name] if a is None else merged_weight(base[name], a, b, LORA.scale)
        assert torch.equal(w, want), name


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_d1(world2, d1, name):
    ranks, out = world2
    ref, _ = d1
    loss_tol, gnorm_tol, weight_tol, lp_tol = TOLS[name]
    want = gathered(ref["adapter"])
    # The same parameters train, float32: the adapters (under TP, torch's SequenceParallel would make
    # the frozen norms trainable again), each pipeline stage its own.
    trainable = [{n: dtype for n, (_, dtype) in r[name]["trainable"].items()} for r in ranks]
    want_trainable = {n: dtype for n, (_, dtype) in ref["trainable"].items()}
    assert (trainable[0] | trainable[1] if name.startswith("p2") else trainable[0]) == want_trainable
    assert name.startswith("p2") or trainable[1] == want_trainable
    for rank, r in enumerate(ranks):
        res = r[name]
        loss = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(res["stats"], ref["stats"], strict=True))
        gnorm = max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in zip(res["stats"], ref["stats"], strict=True))
        assert [s["n_tokens"] for s in res["stats"]] == [s["n_tokens"] for s in ref["stats"]]
        assert [s["lr"] for s in res["stats"]] == [s["lr"] for s in ref["stats"]]
        indices = split(2)[res["dp_rank"]] if name == "d2" else range(len(ref["logprobs"]))
        lp = max((a - ref["logprobs"][i]).abs().max().item() for i, a in zip(indices, res["logprobs"], strict=True))
        if rank == 0:
            got = gathered(res["adapter"])
            assert got.keys() == want.keys()
            weights = max_param_diff(got, want)
            print(f"\n[LoRA {name} vs d1, {STEPS} steps] max rel diff: loss {loss:.2e}, grad norm {gnorm:.2e}; "
                  f"max |adapter diff| {weights:.2e}; max |logprob diff| {lp:.2e}")
            assert weights <= weight_tol
            # save_adapter writes what the export gathered, under the same names.
            saved = read_adapter(out / name / "adapter")
            assert saved.keys() == got.keys() and all(torch.equal(saved[n], got[n]) for n in saved)
        else:
            assert all(b == [] for b in res["adapter"])  # exported to rank 0 only
        assert loss <= loss_tol and gnorm <= gnorm_tol and lp <= lp_tol
        # The DCP state saved after step 2, resumed in a fresh engine: step 3 again, exactly.
        assert res["resumed"]["loss"] == res["stats"][2]["loss"]
        assert res["resumed"]["grad_norm"] == res["stats"][2]["grad_norm"]
        resumed = gathered(res["resumed_adapter"])
        assert all(torch.equal(resumed[n], t) for n, t in gathered(res["adapter"]).items())
        # An engine started from the saved adapter (each rank loads its slices) computes what the
        # trained one did.
        assert all(torch.equal(a, b) for a, b in zip(res["started_logprobs"], res["logprobs"], strict=True))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_merged_export(world2, d1, name):
    """The merged weights (`W + scale * B A`, HF names) equal d1's; pipeline parallelism refuses them."""
    ranks, _ = world2
    ref, _ = d1
    if name.startswith("p2"):
        assert all("merged LoRA weights under pipeline parallelism is not implemented" in r[name]["merged"]
                   for r in ranks)
        return
    merged, want = gathered(ranks[0][name]["merged"]), gathered(ref["merged"])
    assert merged.keys() == want.keys()
    assert all(b == [] for b in ranks[1][name]["merged"])
    diff = max_param_diff(merged, want)
    print(f"\n[LoRA {name} merged export vs d1] max |diff| {diff:.2e}")
    assert diff <= TOLS[name][2]


def test_bfloat16_at_d2(world2, d1):
    """FSDP mixed precision: the frozen base held in bfloat16, the adapters float32; they train."""
    ranks, _ = world2
    ref, _ = d1
    for r in ranks:
        res = r["bf16"]
        assert all((dtype, trains) == ((torch.float32, True) if ".lora." in n else (torch.bfloat16, False))
                   for n, (dtype, trains) in res["dtypes"].items())
        assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in res["stats"])
        assert rel_diff(res["stats"][0]["loss"], ref["stats"][0]["loss"]) < 1e-2  # bf16 rounding only
    before, after = gathered(ranks[0]["bf16"]["before"]), gathered(ranks[0]["bf16"]["after"])
    assert all(float((after[n] - before[n]).abs().max()) > 0 for n in before)


def test_moe_sft_at_d2e2_equals_d1(world2, d1):
    ranks, _ = world2
    ref, _ = d1
    want = [gathered(a) for a in ref["moe"]["adapters"]]
    names = sorted(want[0])
    # Attention everywhere, the dense layer's MLP; the experts take no adapters.
    assert sum("self_attn" in n for n in names) == 3 * 4 * 2 and sum(".mlp." in n for n in names) == 3 * 2
    assert all("layers.1.mlp" in n for n in names if ".mlp." in n)
    for rank, r in enumerate(ranks):
        res = r["moe"]
        loss = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(res["stats"], ref["moe"]["stats"], strict=True))
        gnorm = max(rel_diff(a["grad_norm"], b["grad_norm"])
                    for a, b in zip(res["stats"], ref["moe"]["stats"], strict=True))
        indices = split(2)[rank]
        lp = max((a - ref["moe"]["logprobs"][i]).abs().max().item()
                 for i, a in zip(indices, res["logprobs"], strict=True))
        if rank == 0:
            weights = max(max_param_diff(gathered(a), b) for a, b in zip(res["adapters"], want, strict=True))
            print(f"\n[LoRA Qwen3-MoE SFT d2e2 vs d1, {MOE_STEPS} steps] max rel diff: loss {loss:.2e}, "
                  f"grad norm {gnorm:.2e}; max |adapter diff| {weights:.2e}; max |logprob diff| {lp:.2e}")
            assert weights <= MOE_TOL
        assert loss <= MOE_TOL and gnorm <= MOE_TOL and lp <= MOE_TOL
    assert ref["moe"]["stats"][0]["loss"] != ref["moe"]["stats"][-1]["loss"]  # it trains
