"""Weight updates of a mixture-of-experts model on the serving side: each expert is its own HF
tensor (a piece of a stacked parameter), staged once, all or nothing, with the usual errors;
checksums per HF tensor; pieces packed back to back are adopted without a copy."""

from __future__ import annotations

import pytest
import torch

from tandem.inference.engine import LLMEngine
from tandem.inference.errors import WeightUpdateError
from tandem.inference.sampling_params import SamplingParams
from tandem.inference.weight_swap import (
    ADOPTED,
    mark_adoptable,
    stage_weights,
    swap_weights,
    weight_checksums,
)
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.train.weight_export import hf_parameter_names
from tandem.weights.shm import layout, tensor_views
from tandem.weights.verify import tensor_checksum
from tests.inference.conftest import make_model_dir, prompts

PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
BATCH = prompts([20, 35, 6], seed=21)
EXPERT = "model.layers.1.mlp.experts.3.gate_proj.weight"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return make_model_dir(root / "a", "qwen3_moe", seed=1), make_model_dir(root / "b", "qwen3_moe", seed=2)


def ids(outs):
    return [o.output_ids for o in outs]


def test_moe_update_by_expert_pieces_all_or_nothing(dirs):
    old_dir, new_dir = dirs
    engine = LLMEngine(old_dir, kv_cache_tokens=1024, block_size=8)
    before = ids(engine.generate(BATCH, PARAMS))
    good = dict(iter_hf_tensors(new_dir))
    assert EXPERT in good
    bad_updates = {
        "missing": ({k: v for k, v in good.items() if k != EXPERT}, f"missing tensor(s): {EXPERT}"),
        "unknown expert": ({**good, "model.layers.1.mlp.experts.8.gate_proj.weight": good[EXPERT]},
                           "unknown tensor 'model.layers.1.mlp.experts.8.gate_proj.weight'"),
        "shape": ({**good, EXPERT: good[EXPERT][:-1]}, f"{EXPERT!r} has shape"),
        "nan": ({**good, EXPERT: good[EXPERT].clone().fill_(float("nan"))}, f"tensor {EXPERT!r} holds NaN values"),
    }
    for kind, (update, needle) in bad_updates.items():
        with pytest.raises(WeightUpdateError) as err:
            engine.load_weights(update.items(), weight_version=9)
        assert needle in str(err.value), kind
        assert engine.weight_version == 0 and ids(engine.generate(BATCH, PARAMS)) == before, kind
    with pytest.raises(WeightUpdateError, match=f"sends tensor {EXPERT!r} twice"):
        engine.load_weights([*good.items(), (EXPERT, good[EXPERT])])

    engine.load_weights(good.items(), weight_version=2)
    after = ids(engine.generate(BATCH, PARAMS))
    assert after == ids(LLMEngine(new_dir, kv_cache_tokens=1024, block_size=8).generate(BATCH, PARAMS))
    assert after != before
    # Checksums and reads are per HF tensor, experts included.
    sums = weight_checksums(engine.model)
    assert sums == {n: tensor_checksum(t) for n, t in good.items()}
    assert weight_checksums(engine.model, [EXPERT]) == {EXPERT: sums[EXPERT]}
    assert engine.get_weights_by_name(EXPERT, truncate_size=4) == good[EXPERT].flatten()[:4].tolist()


def _packed(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors as views of one flat buffer at 64-byte-aligned offsets, as a bucket is packed."""
    offsets, nbytes = layout([t for _, t in tensors])
    views = tensor_views(torch.empty(nbytes, dtype=torch.uint8), offsets, [t.shape for _, t in tensors],
                         [t.dtype for _, t in tensors])
    for v, (_, t) in zip(views, tensors, strict=True):
        v.copy_(t)
    return [(n, mark_adoptable(v)) for v, (n, _) in zip(views, tensors, strict=True)]


def test_back_to_back_pieces_are_adopted_and_scattered_ones_copied(dirs):
    old_dir, new_dir = dirs
    engine = LLMEngine(old_dir, kv_cache_tokens=256, block_size=8)
    model = engine.model
    files = dict(iter_hf_tensors(new_dir))  # the file interleaves experts (experts.0.down, experts.0.gate, ...)
    good = [(hf, files[hf]) for _, pieces, _ in hf_parameter_names(model) for hf, _ in pieces]  # export order
    stacked = dict(model.named_parameters())["layers.1.moe.experts.w1"]
    # Every tensor marked, packed in one buffer in export order: each stack becomes one view over its pieces.
    packed = _packed(good)
    assert swap_weights(model, stage_weights(model, packed))
    pieces = {n: t for n, t in packed if ".layers.1.mlp.experts." in n and "gate_proj" in n}
    assert stacked.data_ptr() == pieces["model.layers.1.mlp.experts.0.gate_proj.weight"].data_ptr()
    assert stacked.is_contiguous() and all(getattr(t, ADOPTED, False) for t in pieces.values())
    assert weight_checksums(model) == {n: tensor_checksum(t) for n, t in good}
    assert not swap_weights(model, stage_weights(model, _packed(list(files.items()))))  # file order: apart
    # One expert packed apart from its stack: nothing is adopted, everything copied in place.
    scattered = _packed(good)
    moved = [(n, mark_adoptable(t.clone())) if n == EXPERT else (n, t) for n, t in scattered]
    ptr = stacked.data_ptr()
    assert not swap_weights(model, stage_weights(model, moved))
    assert stacked.data_ptr() == ptr and not any(getattr(t, ADOPTED, False) for _, t in moved)
    assert weight_checksums(model) == {n: tensor_checksum(t) for n, t in good}


def test_a_copy_never_writes_into_a_shared_stack(dirs):
    """A stack served from another process's memory (zero-copy shared memory) gets memory of its
    own before a later update's pieces are copied in: the writer's pages are never touched."""
    old_dir, new_dir = dirs
    engine = LLMEngine(old_dir, kv_cache_tokens=256, block_size=8)
    model = engine.model
    files = dict(iter_hf_tensors(new_dir))
    order = [hf for _, pieces, _ in hf_parameter_names(model) for hf, _ in pieces]
    shared = [(n, mark_adoptable(t, shared=True)) for n, t in _packed([(hf, files[hf]) for hf in order])]
    assert swap_weights(model, stage_weights(model, shared))
    stacked = dict(model.named_parameters())["layers.1.moe.experts.w1"]
    segment = {n: t.clone() for n, t in shared}
    old = dict(iter_hf_tensors(old_dir))
    assert not swap_weights(model, stage_weights(model, old.items()))  # unmarked: copied
    assert all(torch.equal(t, segment[n]) for n, t in shared)  # the "segment" is as written
    assert stacked.data_ptr() != shared[order.index("model.layers.1.mlp.experts.0.gate_proj.weight")][1].data_ptr()
    assert weight_checksums(model) == {n: tensor_checksum(t) for n, t in old.items()}
