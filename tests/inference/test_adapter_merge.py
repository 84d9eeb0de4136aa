"""`AdapterMerger`, the server's LoRA merge, on a native model in process: merges equal
`W + alpha / r * B @ A` computed by hand from the checkpoint's weights; each update merges from
the base (two updates equal one of the second adapter); a module the previous adapter adapted and
this one does not gets its base back; bad adapters are refused naming the tensor; whole-weight
updates meet the rules of a merged base."""

from __future__ import annotations

import pytest
import torch

from tandem.inference.adapter_merge import AdapterMerger, is_adapter_update
from tandem.inference.errors import WeightUpdateError
from tandem.inference.weight_swap import served_tensor, stage_weights, swap_weights
from tandem.models import load_model
from tandem.models.hf_checkpoint import iter_hf_tensors
from tests.inference.conftest import make_model_dir

Q = "model.layers.0.self_attn.q_proj"
V = "model.layers.1.self_attn.v_proj"


def adapter(modules: list[str], seed: int, r: int = 2) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for m in modules:
        w = 64 if "q_proj" in m else 32  # tiny preset: 4 query heads x 16, 2 kv heads x 16, hidden 64
        out.append((f"base_model.model.{m}.lora_A.weight", torch.randn(r, 64, generator=gen)))
        out.append((f"base_model.model.{m}.lora_B.weight", torch.randn(w, r, generator=gen)))
    return out


@pytest.fixture
def model(tmp_path):
    path = make_model_dir(tmp_path, "qwen3", seed=2)
    return load_model(path), dict(iter_hf_tensors(path))


def apply(merger: AdapterMerger, model, named, alpha: float) -> None:
    swap_weights(model, stage_weights(model, merger.merged(model, named, alpha), partial=True))
    merger.served(named)


def by_hand(base: torch.Tensor, named, module: str, alpha: float) -> torch.Tensor:
    t = dict(named)
    a, b = t[f"base_model.model.{module}.lora_A.weight"], t[f"base_model.model.{module}.lora_B.weight"]
    return base + alpha / a.shape[0] * b @ a


def test_merges_from_the_base_and_restores_what_the_next_adapter_leaves(model):
    model, base = model
    merger = AdapterMerger()
    first, second = adapter([Q, V], seed=1), adapter([Q], seed=2)
    apply(merger, model, first, alpha=4.0)
    for m in (Q, V):
        torch.testing.assert_close(served_tensor(model, f"{m}.weight"), by_hand(base[f"{m}.weight"], first, m, 4.0),
                                   rtol=0, atol=1e-6)
    apply(merger, model, second, alpha=4.0)  # from the base, not from the first merge
    torch.testing.assert_close(served_tensor(model, f"{Q}.weight"), by_hand(base[f"{Q}.weight"], second, Q, 4.0),
                               rtol=0, atol=1e-6)
    assert torch.equal(served_tensor(model, f"{V}.weight"), base[f"{V}.weight"])  # V's base is back
    assert set(merger.checksums(None)) == {n for n, _ in second}


def test_bad_adapters_and_whole_weight_updates(model):
    model, base = model
    merger = AdapterMerger()
    good = adapter([Q], seed=3)
    with pytest.raises(WeightUpdateError, match="lora_A but not its pair"):
        merger.merged(model, good[:1], 4.0)
    with pytest.raises(WeightUpdateError, match=r"lora_A has shape \(2, 63\)"):
        AdapterMerger.check(model, [(good[0][0], torch.zeros(2, 63)), good[1]])
    with pytest.raises(WeightUpdateError, match="no linear weight"):
        AdapterMerger.check(model, [("base_model.model.model.layers.0.self_attn.x_proj.lora_A.weight",
                                     torch.zeros(2, 64))])
    with pytest.raises(WeightUpdateError, match="mixes ranks"):
        AdapterMerger.check(model, good + adapter([V], seed=4, r=3))
    with pytest.raises(WeightUpdateError, match="not a PEFT LoRA tensor"):
        AdapterMerger.check(model, [("base_model.model.x.weight", torch.zeros(1))])
    assert is_adapter_update([n for n, _ in good]) and not is_adapter_update([f"{Q}.weight"])
    apply(merger, model, good, alpha=4.0)
    with pytest.raises(WeightUpdateError, match=r"partial weight update .* while a LoRA adapter is merged"):
        merger.replaced([f"{Q}.weight"], full=False)
    merger.replaced(["model.norm.weight"], full=False)  # not adapted: fine
    merger.replaced(list(base), full=True)  # a whole set is the new base
    assert merger.base == {} and merger.checksums(None) == {}
