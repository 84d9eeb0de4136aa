"""LoRA under the engine's parallel layouts against one rank (d1) on the same global batch, on the
untied 4-layer tiny model: d2 (FSDP), t2, p2 (1F1B and ZBV), c2 at world 2, d2t2 and p2d2 at world
4, each rank on its share of the batch: per-step loss and grad norm (clipped), the trained adapters
(exported to rank 0 under PEFT names, and saved as a PEFT directory), log-probs, a DCP resume (at
the layout and at d1), a start from the saved adapter, and the merged export (refused under pp).
Then d2, t2 and p2 in bfloat16 (base frozen in bf16, adapters float32), and SFT of a tiny
Qwen3-MoE with adapters on its attention and dense MLP at archon:d2e2 and d4e2 (experts split over
ep pairs) against d1. One spawned group per world size runs every layout of that size.
Tolerances: the layouts' own tests (test_engine_distributed, test_engine_tp, test_engine_pipeline,
test_engine_context_parallel)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tandem.models.common.lora import PEFT_PREFIX, merged_weight, read_adapter
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.models.tiny import init_model
from tests.distributed import run_distributed
from tests.train.helpers import make_batch, max_param_diff, rel_diff, train_steps
from tests.train.lora_workers import (
    BF16_LAYOUTS,
    LAYOUTS,
    LORA,
    MOE_LAYOUTS,
    MOE_STEPS,
    SCHEDULE,
    STEPS,
    all_layouts,
    layout_checks,
    lora_engine,
    moe_sft,
)

pytestmark = pytest.mark.slow
# layout -> (loss, grad norm (both relative), adapter and merged weights, log-probs (absolute)): the
# layouts' own tests'
TOLS = {"d2": (1e-5, 1e-5, 1e-5, 1e-5), "c2": (1e-5, 1e-4, 1e-5, 1e-5)} | {
    name: (1e-5, 1e-4, 1e-5, 1e-5) for name in ("t2", "d2t2", "p2", "p2-zbv", "p2d2")}
MOE_TOL = 1e-5  # the acceptance line: LoRA SFT of Qwen3-MoE at archon:d2e2 equals d1


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny untied Qwen3-MoE, one dense layer among the MoE ones (8 experts, top-2)."""
    return init_model(tmp_path_factory.mktemp("models") / "qwen3-moe", arch="qwen3_moe", preset="tiny", seed=0,
                      overrides={"num_hidden_layers": 3, "mlp_only_layers": [1], "tie_word_embeddings": False})


@pytest.fixture(scope="module")
def d1(untied4_dir, moe_dir, tmp_path_factory):
    res = layout_checks(0, 1, str(untied4_dir), str(tmp_path_factory.mktemp("lora-d1")), {})
    res["moe"] = moe_sft(0, 1, str(moe_dir), {})
    if dist.is_initialized():
        dist.destroy_process_group()
    return res


@pytest.fixture(scope="module")
def spawned(untied4_dir, moe_dir, tmp_path_factory):
    """world size -> (every rank's results of `all_layouts`, their directory); one group per world
    size, spawned when first asked for."""
    groups: dict[int, tuple[list[dict], Path]] = {}

    def get(world: int) -> tuple[list[dict], Path]:
        if world not in groups:
            out = tmp_path_factory.mktemp(f"lora-world{world}")
            groups[world] = run_distributed(all_layouts, world, args=(str(untied4_dir), str(moe_dir), str(out)),
                                            timeout=900), out
        return groups[world]
    return get


def gathered(buckets: list[list[tuple[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    return {n: t for b in buckets for n, t in b}


def logprob_diff(res: dict, ref: dict) -> float:
    return max((a - ref["logprobs"][i]).abs().max().item()
               for i, a in zip(res["indices"], res["logprobs"], strict=True))


def test_d1_reference_is_lora(d1, untied4_dir):
    """What the layouts are held to: only adapters train, they move, every step is clipped, and the
    merged export is `W + (alpha / r) B A` of the checkpoint's W (by hand)."""
    assert all(".lora." in n and dtype == torch.float32 for n, (_, dtype) in d1["trainable"].items())
    assert all(s["grad_norm"] > SCHEDULE["optimizer"].gradient_clipping for s in d1["stats"] + d1["moe"]["stats"])
    adapters = gathered(d1["adapter"])
    assert len(adapters) == 7 * 4 * 2 and all(n.startswith(PEFT_PREFIX) for n in adapters)
    assert all(float(t.abs().max()) > 0 for n, t in adapters.items() if "lora_B" in n)
    base, merged = dict(iter_hf_tensors(untied4_dir)), gathered(d1["merged"])
    assert merged.keys() == base.keys()
    for name, w in merged.items():
        module = name.removesuffix(".weight")
        a, b = adapters.get(f"{PEFT_PREFIX}{module}.lora_A.weight"), adapters.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
        want = base[name] if a is None else merged_weight(base[name], a, b, LORA.scale)
        assert torch.equal(w, want), name


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_d1(spawned, d1, name):
    ranks, out = spawned(LAYOUTS[name][0])
    loss_tol, gnorm_tol, weight_tol, lp_tol = TOLS[name]
    want = gathered(d1["adapter"])
    # The same parameters train, float32: the adapters (under TP, torch's SequenceParallel would make
    # the frozen norms trainable again), each pipeline stage its own.
    trainable = [{n: dtype for n, (_, dtype) in r[name]["trainable"].items()} for r in ranks]
    want_trainable = {n: dtype for n, (_, dtype) in d1["trainable"].items()}
    holders = len(ranks) // LAYOUTS[name][1].get("pp", 1)  # ranks holding each stage
    assert {n: d for t in trainable for n, d in t.items()} == want_trainable
    assert all(sum(n in t for t in trainable) == holders for n in want_trainable)
    for rank, r in enumerate(ranks):
        res = r[name]
        loss = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(res["stats"], d1["stats"], strict=True))
        gnorm = max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in zip(res["stats"], d1["stats"], strict=True))
        assert [s["n_tokens"] for s in res["stats"]] == [s["n_tokens"] for s in d1["stats"]]
        assert [s["lr"] for s in res["stats"]] == [s["lr"] for s in d1["stats"]]
        lp = logprob_diff(res, d1)
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
def test_merged_export(spawned, d1, name):
    """The merged weights (`W + scale * B A`, HF names) equal d1's; pipeline parallelism refuses them."""
    ranks, _ = spawned(LAYOUTS[name][0])
    if "pp" in LAYOUTS[name][1]:
        assert all("merged LoRA weights under pipeline parallelism is not implemented" in r[name]["merged"]
                   for r in ranks)
        return
    merged, want = gathered(ranks[0][name]["merged"]), gathered(d1["merged"])
    assert merged.keys() == want.keys()
    assert all(b == [] for r in ranks[1:] for b in r[name]["merged"])
    diff = max_param_diff(merged, want)
    print(f"\n[LoRA {name} merged export vs d1] max |diff| {diff:.2e}")
    assert diff <= TOLS[name][2]


@pytest.mark.parametrize("name", ["d2", "t2", "c2", "p2"])
def test_layout_state_resumes_at_d1(spawned, d1, untied4_dir, name):
    """DCP reshards: the adapters' state a layout saved after step 2 resumes at one rank, whose
    step 3 is the layout's."""
    ranks, out = spawned(LAYOUTS[name][0])
    engine = lora_engine(str(untied4_dir))
    engine.load_state(out / name / "state")
    stats = train_steps(engine, make_batch(512), 1)[0]
    engine.close()
    assert engine.step == 3
    assert rel_diff(stats["loss"], ranks[0][name]["stats"][2]["loss"]) <= TOLS[name][0]
    assert rel_diff(stats["grad_norm"], ranks[0][name]["stats"][2]["grad_norm"]) <= TOLS[name][1]


@pytest.mark.parametrize("name", BF16_LAYOUTS)
def test_bfloat16(spawned, d1, name):
    """FSDP mixed precision: the frozen base held in bfloat16, the adapters float32; they train."""
    ranks, _ = spawned(LAYOUTS[name][0])
    for r in ranks:
        res = r[f"bf16 {name}"]
        assert all((dtype, trains) == ((torch.float32, True) if ".lora." in n else (torch.bfloat16, False))
                   for n, (dtype, trains) in res["dtypes"].items())
        assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in res["stats"])
        assert rel_diff(res["stats"][0]["loss"], d1["stats"][0]["loss"]) < 1e-2  # bf16 rounding only
    before, after = gathered(ranks[0][f"bf16 {name}"]["before"]), gathered(ranks[0][f"bf16 {name}"]["after"])
    assert before.keys() == after.keys() and len(before) == 7 * 4 * 2
    assert all(float((after[n] - before[n]).abs().max()) > 0 for n in before)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_sft_equals_d1(spawned, d1, name):
    ranks, _ = spawned(MOE_LAYOUTS[name][0])
    ref = d1["moe"]
    want = [gathered(a) for a in ref["adapters"]]
    names = sorted(want[0])
    # Attention everywhere, the dense layer's MLP; the experts take no adapters.
    assert sum("self_attn" in n for n in names) == 3 * 4 * 2 and sum(".mlp." in n for n in names) == 3 * 2
    assert all("layers.1.mlp" in n for n in names if ".mlp." in n)
    for rank, r in enumerate(ranks):
        res = r[name]
        loss = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(res["stats"], ref["stats"], strict=True))
        gnorm = max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in zip(res["stats"], ref["stats"], strict=True))
        lp = logprob_diff(res, ref)
        if rank == 0:
            weights = max(max_param_diff(gathered(a), b) for a, b in zip(res["adapters"], want, strict=True))
            print(f"\n[LoRA Qwen3-MoE SFT {name} vs d1, {MOE_STEPS} steps] max rel diff: loss {loss:.2e}, "
                  f"grad norm {gnorm:.2e}; max |adapter diff| {weights:.2e}; max |logprob diff| {lp:.2e}")
            assert weights <= MOE_TOL
        assert loss <= MOE_TOL and gnorm <= MOE_TOL and lp <= MOE_TOL
    assert ref["stats"][0]["loss"] != ref["stats"][-1]["loss"]  # it trains
