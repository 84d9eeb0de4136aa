"""Worker bodies of the context-parallel tests (module level, so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tandem.models import build_model
from tandem.models.common import packed_causal_attention
from tandem.models.tiny import hf_config_for
from tandem.parallel.context_parallel import ulysses_attention
from tandem.parallel.context_split import ContextSplit
from tandem.train.logprobs import LogprobModel

# Documents crossing the slice boundaries at cp=2 and cp=4 (T=29 pads to 30 and 32). The first
# set runs the padded attention kernel, the second (one long document) the dense-mask one.
STREAMS = ([5, 9, 2, 13], [24, 1, 3, 1])
HEADS = ((4, 2), (4, 4), (8, 1), (4, 1))  # (query heads, KV heads): GQA, MHA, MQA


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _attention_case(split: ContextSplit, lengths: list[int], heads: int, kv_heads: int) -> dict[str, float]:
    """Ulysses on this rank's slice vs one-process packed attention on the whole stream: output
    and q/k/v gradients of the same weighted sum (every rank builds the same global tensors)."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    total, dim = sum(lengths), 8
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    weight = torch.randn(total, heads, dim, generator=gen)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = packed_causal_attention(*full, cu, scale=0.3)
    (ref * weight).sum().backward()

    local = [split.local(t).requires_grad_() for t in (q, k, v)]
    kernel = lambda q_, k_, v_: packed_causal_attention(q_, k_, v_, cu, scale=0.3)  # noqa: E731
    out = ulysses_attention(*local, kernel, split.group)
    (out * split.local(weight)).sum().backward()  # the ranks' sums add up to the reference's
    real = min(split.local_tokens, max(0, total - split.start))  # rows of this slice before the padding
    res = {"out": _max_diff(out[:real], split.local(ref.detach())[:real])}
    for name, a, b in zip("qkv", local, full, strict=True):
        res[f"grad_{name}"] = _max_diff(a.grad[:real], split.local(b.grad)[:real])
    res["scale"] = ref.abs().max().item()
    return res


def _model_case(split_group: dist.ProcessGroup, lengths: list[int], sparse: bool) -> dict[str, float]:
    """LogprobModel on a tiny Qwen3 with `cp_group` vs without: log-probs / entropy on every rank,
    and the parameter gradients summed over the group (as FSDP does) vs one process."""
    config = hf_config_for("qwen3", "tiny", {"eos_token_id": 1, "pad_token_id": 0})
    model = build_model(config, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # larger than the init's 0.02, so attention is far from uniform
            p.normal_(0.0, 0.3, generator=gen)
    total = sum(lengths)
    ids = torch.randint(0, 512, (total,), generator=gen)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    wanted = torch.rand(total, generator=gen) > 0.4 if sparse else None
    coef = torch.randn(total, generator=gen)

    def run(cp_group):
        model.zero_grad()
        lp, ent = LogprobModel(model, chunk_size=7, cp_group=cp_group)(ids, cu, 1.3, wanted)
        ((lp * coef).sum() - 0.1 * ent.sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_lp, ref_ent, ref_grads = run(None)
    lp, ent, grads = run(split_group)
    for g in grads.values():
        dist.all_reduce(g, group=split_group)
    return {
        "logprobs": _max_diff(lp, ref_lp), "entropy": _max_diff(ent, ref_ent),
        "grads": max(_max_diff(grads[n], ref_grads[n]) for n in grads),
        "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
        "n_params": float(len(grads)),
    }


def ulysses_checks(rank: int, world_size: int) -> dict:
    group = dist.group.WORLD
    res: dict = {"attention": {}, "model": {}}
    for lengths in STREAMS:
        split = ContextSplit.of(sum(lengths), group)
        for heads, kv_heads in HEADS:
            res["attention"][(tuple(lengths), heads, kv_heads)] = _attention_case(split, lengths, heads, kv_heads)
        for sparse in (False, True):
            res["model"][(tuple(lengths), sparse)] = _model_case(group, lengths, sparse)
    return res
