"""Item 1: Tandem's training path against transformers on the device, float32 and bfloat16.

- The native model (`tandem.models.load_model`, the trainer's model code) and
  `transformers.AutoModelForCausalLM`, both loaded from the same checkpoint in the same dtype on
  the same device: logits of a few sequences.
- The `TrainEngine` (device=cuda, its one-rank group: NCCL on CUDA; FSDP mixed precision in
  bfloat16): next-token logprobs and entropy (`forward_logprobs`), then the gradients of a mean
  token NLL (`forward_backward`) for a few parameters, against transformers' autograd of the same
  loss.

float32 is compared directly (tight tolerances). bfloat16 is judged against the float32 truth
(transformers in float32 on the same device): Tandem's bf16 must be no further from it than a
few times transformers' own bf16 is (plus a small floor), which holds whatever the device's bf16
kernels round like; the figures are printed (`pytest -s`).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tandem.data.batch import SequenceBatch
from tandem.models import load_model
from tandem.train import TrainEngine
from tests.gpu.conftest import dtype_of
from tests.inference.conftest import prompts
from tests.train.helpers import engine_config

pytestmark = pytest.mark.timeout(300)

LENGTHS = [7, 19, 3, 33, 12]
FP32_LOGITS_TOL = 1e-4  # logits here reach ~10 in magnitude
FP32_LOGPROB_TOL = 1e-4
FP32_GRAD_REL_TOL = 1e-4  # max |diff| / max |reference gradient|, per parameter
BF16_FACTOR, BF16_FLOOR = 3.0, {"logits": 0.05, "logprob": 0.05, "grad": 0.02}
# Native names of the parameters whose gradients are compared (tied: the embedding is the head too).
GRAD_PARAMS = ("tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.k_norm.weight",
               "layers.1.feed_forward.w2.weight", "layers.1.ffn_norm.weight", "norm.weight")


def _sequences() -> list[list[int]]:
    return prompts(LENGTHS, seed=3)


def _hf(model_dir, dtype: torch.dtype, device: torch.device) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def _hf_logits(hf, seqs: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Each sequence alone (no padding), float32 logits `[n, vocab]`."""
    return [hf(torch.tensor([s], device=device)).logits[0].float() for s in seqs]


def _hf_terms(hf, seqs: list[list[int]], device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence `[n-1]` log p(token t+1) and the entropy of that distribution (autograd on)."""
    logprobs, entropies = [], []
    for s, logits in zip(seqs, _hf_logits(hf, seqs, device), strict=True):
        logp = torch.log_softmax(logits, -1)[:-1]
        logprobs.append(logp.gather(-1, torch.tensor(s[1:], device=device)[:, None])[:, 0])
        entropies.append(-(logp.exp() * logp).sum(-1))
    return logprobs, entropies


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.detach().float().cpu() - y.detach().float().cpu()).abs().max()) for x, y in zip(a, b, strict=True))


def _bf16_bound(kind: str, hf_bf16_err: float) -> float:
    return BF16_FACTOR * hf_bf16_err + BF16_FLOOR[kind]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A gradient as a plain tensor (an FSDP parameter's gradient is a DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def nll_loss(logprobs: torch.Tensor, entropy: torch.Tensor, mb) -> torch.Tensor:
    """The summed NLL of every predicted token (logprobs are 0 at each sequence's last token);
    the engine divides by the loss-token count, the batch's predicted tokens."""
    del entropy, mb
    return -logprobs.sum()


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@torch.no_grad()
def test_native_model_logits_match_transformers(model_dir, device, dtype_name):
    dtype = dtype_of(dtype_name)
    seqs = _sequences()
    native = load_model(model_dir, dtype=dtype, device=device).eval()
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    ends = torch.tensor([0, *LENGTHS], device=device).cumsum(0).to(torch.int32)
    ours = native(ids, ends).float().split(LENGTHS)
    ref = _hf_logits(_hf(model_dir, dtype, device), seqs, device)
    diff = _max_diff(list(ours), ref)
    scale = max(float(r.abs().max()) for r in ref)
    label = f"[native vs transformers, {dtype_name}, {device}]"
    if dtype == torch.float32:
        print(f"\n{label} max |logit diff| {diff:.3e} (logits up to {scale:.2f}; tol {FP32_LOGITS_TOL})")
        assert diff <= FP32_LOGITS_TOL
        return
    truth = _hf_logits(_hf(model_dir, torch.float32, device), seqs, device)
    ours_err, hf_err = _max_diff(list(ours), truth), _max_diff(ref, truth)
    bound = _bf16_bound("logits", hf_err)
    print(f"\n{label} max |logit diff| vs transformers bf16 {diff:.3e}; vs fp32 truth: ours {ours_err:.3e}, "
          f"transformers bf16 {hf_err:.3e} (bound {bound:.3e}; logits up to {scale:.2f})")
    assert ours_err <= bound


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_engine_logprobs_and_gradients_match_transformers(model_dir, device, dtype_name):
    dtype = dtype_of(dtype_name)
    seqs = _sequences()
    batch = SequenceBatch([{"input_ids": torch.tensor(s)} for s in seqs])
    engine = TrainEngine(engine_config(str(model_dir), device=str(device), dtype=dtype_name))
    try:
        assert engine.device.type == device.type and engine.param_dtype == dtype
        if device.type == "cuda":
            assert torch.distributed.get_backend() == "nccl"
        out = engine.forward_logprobs(batch)
        ours_lp = [lp[:-1] for lp in out.logprobs]  # the last token predicts nothing (0)
        ours_ent = [e[:-1] for e in out.entropy]
        stats = engine.forward_backward(batch, nll_loss)
        adapter = engine.model.spec.state_dict_adapter_cls(engine.model.args)
        params = dict(engine.model.named_parameters())
        ours_grad = {adapter.native_to_hf(n): _full(params[n].grad).detach().float().cpu() for n in GRAD_PARAMS}
        engine.optimizer.zero_grad(set_to_none=True)
    finally:
        engine.close()
    n_loss = int(stats["n_loss_tokens"])
    assert n_loss == sum(n - 1 for n in LENGTHS)

    def reference(ref_dtype: torch.dtype):
        hf = _hf(model_dir, ref_dtype, device)
        lp, ent = _hf_terms(hf, seqs, device)
        loss = -sum(x.sum() for x in lp) / n_loss
        loss.backward()
        named = dict(hf.named_parameters())
        grads = {n: named[n].grad.detach().float().cpu() for n in ours_grad}
        return [x.detach() for x in lp], [x.detach() for x in ent], float(loss.detach()), grads

    def grad_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
        """Per parameter max |diff| / max |b|."""
        return {n: float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12)) for n in a}

    label = f"[engine vs transformers, {dtype_name}, {device}]"
    ref_lp, ref_ent, ref_loss, ref_grad = reference(dtype)
    lp_diff, ent_diff = _max_diff(ours_lp, ref_lp), _max_diff(ours_ent, ref_ent)
    g_rel = grad_err(ours_grad, ref_grad)
    print(f"\n{label} loss {stats['loss']:.6f} vs {ref_loss:.6f}; max |logprob diff| {lp_diff:.3e}, "
          f"|entropy diff| {ent_diff:.3e}; gradient max rel diff "
          f"{ {n: f'{v:.2e}' for n, v in g_rel.items()} }")
    if dtype == torch.float32:
        assert lp_diff <= FP32_LOGPROB_TOL and ent_diff <= FP32_LOGPROB_TOL
        assert abs(stats["loss"] - ref_loss) <= FP32_LOGPROB_TOL
        assert max(g_rel.values()) <= FP32_GRAD_REL_TOL, g_rel
        return
    truth_lp, truth_ent, truth_loss, truth_grad = reference(torch.float32)
    errs = {
        "logprob": (_max_diff(ours_lp, truth_lp), _max_diff(ref_lp, truth_lp)),
        "entropy": (_max_diff(ours_ent, truth_ent), _max_diff(ref_ent, truth_ent)),
        "loss": (abs(stats["loss"] - truth_loss), abs(ref_loss - truth_loss)),
    }
    ours_g, hf_g = grad_err(ours_grad, truth_grad), grad_err(ref_grad, truth_grad)
    print(f"{label} vs the fp32 truth (ours, transformers bf16): "
          f"{ {k: (f'{a:.2e}', f'{b:.2e}') for k, (a, b) in errs.items()} }; gradient max rel "
          f"{ {n: (f'{ours_g[n]:.2e}', f'{hf_g[n]:.2e}') for n in ours_g} }")
    for kind, (ours_err, hf_err) in errs.items():
        assert ours_err <= _bf16_bound("logprob", hf_err), (kind, ours_err, hf_err)
    for n in ours_g:
        assert ours_g[n] <= _bf16_bound("grad", hf_g[n]), (n, ours_g[n], hf_g[n])


def test_moe_native_and_engine_match_transformers_fp32(moe_model_dir, device):
    """Qwen3-MoE (8 experts, top-2 on the tiny preset; a dense layer between two MoE ones) in float32:
    the native model's logits and the engine's logprobs (live routing) vs transformers on the device."""
    seqs = _sequences()
    hf = _hf(moe_model_dir, torch.float32, device)
    with torch.no_grad():
        native = load_model(moe_model_dir, dtype=torch.float32, device=device).eval()
        ids = torch.tensor([t for s in seqs for t in s], device=device)
        ends = torch.tensor([0, *LENGTHS], device=device).cumsum(0).to(torch.int32)
        logit_diff = _max_diff(list(native(ids, ends).float().split(LENGTHS)), _hf_logits(hf, seqs, device))
        ref_lp, _ = _hf_terms(hf, seqs, device)
    engine = TrainEngine(engine_config(str(moe_model_dir), device=str(device)))
    try:
        out = engine.forward_logprobs(SequenceBatch([{"input_ids": torch.tensor(s)} for s in seqs]))
    finally:
        engine.close()
    lp_diff = _max_diff([lp[:-1] for lp in out.logprobs], ref_lp)
    print(f"\n[qwen3_moe vs transformers, float32, {device}] native max |logit diff| {logit_diff:.3e}; "
          f"engine max |logprob diff| {lp_diff:.3e}")
    assert logit_diff <= FP32_LOGITS_TOL and lp_diff <= FP32_LOGPROB_TOL
