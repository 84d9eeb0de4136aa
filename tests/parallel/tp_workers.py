"""Worker bodies of the tensor-parallel tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from tandem.models import build_model
from tandem.models.qwen.tensor_plan import apply_tensor_parallel
from tandem.models.tiny import hf_config_for
from tandem.parallel.loss_parallel import vocab_parallel_logprobs_entropy
from tandem.parallel.tensor_parallel import shard_range, sum_partial_grads
from tandem.train.logprobs import LogprobModel, _chunk_logprobs_entropy

# Packed sequences whose total (37) is not a multiple of the TP size: the model pads and drops.
LENGTHS = [5, 13, 2, 17]
TEMPERATURE = 0.7


def tp_config(tied: bool, arch: str = "qwen3") -> dict:
    """The tiny preset with 4 layers, 4 query / 2 key-value heads, tied or untied embeddings."""
    cfg = hf_config_for(arch, "tiny", {"eos_token_id": 1, "pad_token_id": 0})
    cfg.update(num_hidden_layers=4, tie_word_embeddings=tied)
    return cfg


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    n = sum(LENGTHS)
    ids = torch.randint(0, vocab, (n,), generator=g)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    weights = torch.randn(n, generator=g)
    return ids, cu, weights


def _tp_copy(cfg: dict, ref: torch.nn.Module, mesh) -> torch.nn.Module:
    model = build_model(cfg, device="meta")
    apply_tensor_parallel(model, mesh)
    model.to_empty(device="cpu")
    model.tie_weights()
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            full = ref_params[name].detach()
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(p, DTensor) else full)
    return model


def _run(module: LogprobModel, ids, cu, weights, wanted) -> tuple[torch.Tensor, torch.Tensor, dict]:
    module.zero_grad(set_to_none=True)
    lp, ent = module(ids, cu, TEMPERATURE, wanted)
    (-(weights * lp).sum() - 0.1 * (weights * ent).sum()).backward()
    return lp.detach(), ent.detach(), module.model


def _max_grad_diff(tp_model, ref_model) -> tuple[float, float]:
    """(max over parameters of |grad diff| / max |grad|, max |grad| of the q/k norms)."""
    ref = dict(ref_model.named_parameters())
    diff, qk = 0.0, 0.0
    for name, p in tp_model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        diff = max(diff, (g - ref[name].grad).abs().max().item() / ref[name].grad.abs().max().item())
        if "q_norm" in name or "k_norm" in name:
            qk = max(qk, ref[name].grad.abs().max().item())
    return diff, qk


def model_checks(rank: int, world_size: int) -> dict:
    """The TP model against the single-process model on the same weights: full logits, log-probs
    and entropy (all positions, and the `wanted` subset, with a temperature) and every gradient,
    for Qwen3 with tied and untied embeddings and Qwen2 (q/k/v biases, no q/k norms); also the
    Qwen3 q/k-norm gradients without their TP sum."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out: dict = {}
    for arch, tied in (("qwen3", False), ("qwen3", True), ("qwen2", False)):
        cfg = tp_config(tied, arch)
        ref = build_model(cfg, seed=0)
        model = _tp_copy(cfg, ref, mesh)
        res: dict = {"n_params": len(list(model.parameters())), "ref_n_params": len(list(ref.parameters())),
                     "tied_shared": model.output.weight is model.tok_embeddings.weight}
        ids, cu, weights = _batch(cfg["vocab_size"])
        with torch.no_grad():
            local = model(ids, cu)
            gathered = [torch.empty_like(local) for _ in range(world_size)]
            dist.all_gather(gathered, local.contiguous())
            res["logits"] = (torch.cat(gathered, -1) - ref(ids, cu)).abs().max().item()
        wanted = torch.rand(ids.shape[0], generator=torch.Generator().manual_seed(5)) < 0.5
        for key, w in (("all", None), ("wanted", wanted)):
            ref_lp, ref_ent, _ = _run(LogprobModel(ref, chunk_size=8), ids, cu, weights, w)
            lp, ent, _ = _run(LogprobModel(model, chunk_size=8), ids, cu, weights, w)
            unsummed, qk_size = _max_grad_diff(model, ref)  # relative: their own scale is ~0.1-0.4
            sum_partial_grads(model, model.tensor_parallel)
            grad, _ = _max_grad_diff(model, ref)
            res[key] = {"logprobs": (lp - ref_lp).abs().max().item(), "entropy": (ent - ref_ent).abs().max().item(),
                        "grad": grad, "unsummed_grad": unsummed, "qk_grad_size": qk_size}
        out[f"{arch} {'tied' if tied else 'untied'}"] = res
    return out


def loss_parallel_checks(rank: int, world_size: int) -> dict:
    """`vocab_parallel_logprobs_entropy` on each rank's vocabulary slice (an uneven split: 37
    columns) against the single-process chunked path, values and gradients of the logits; and,
    for large logits (where the chunked path's entropy loses ~1e-6 to cancellation), against a
    float64 computation."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    vocab, n = 37, 11
    logits = torch.randn(n, vocab, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    weights = torch.randn(2, n, generator=g)
    start, stop = shard_range(vocab, world_size, rank)
    out = {}
    big = logits.detach() * 6
    lp, ent = vocab_parallel_logprobs_entropy(big[:, start:stop], labels, start, group, 0.6)
    z64 = big.double() / 0.6
    log_z = torch.logsumexp(z64, -1)
    out["float64"] = {"logprobs": (lp - (z64.gather(-1, labels[:, None]).squeeze(-1) - log_z)).abs().max().item(),
                      "entropy": (ent - (log_z - (torch.softmax(z64, -1) * z64).sum(-1))).abs().max().item()}
    for temperature in (1.0, 0.6):
        lp_ref, ent_ref = _chunk_logprobs_entropy(lambda x: x, logits, labels, temperature)
        ((weights[0] * lp_ref).sum() + (weights[1] * ent_ref).sum()).backward()
        ref_grad, logits.grad = logits.grad.clone(), None
        local = logits.detach()[:, start:stop].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs_entropy(local, labels, start, group, temperature)
        ((weights[0] * lp).sum() + (weights[1] * ent).sum()).backward()
        out[temperature] = {"logprobs": (lp - lp_ref).abs().max().item(),
                            "entropy": (ent - ent_ref).abs().max().item(),
                            "grad": (local.grad - ref_grad[:, start:stop]).abs().max().item()}
    return out


def all_checks(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    return {"model": model_checks(rank, world_size), "loss_parallel": loss_parallel_checks(rank, world_size)}
