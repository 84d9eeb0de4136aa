"""Mixture-of-experts feed-forward: a softmax top-k router over stacked SwiGLU experts, computed
grouped (`grouped_swiglu`: one batched matmul per projection, no loop over tokens).

A `Routing` passed down the model records the routed experts and replays them; a replayed row fixes *which*
experts a token goes to, while its weights stay the live router probabilities (the router still
gets gradients). `GroupedExperts.dispatch` is the seam expert parallelism replaces: assignments
sorted by expert in, their outputs in the same order out. See docs/moe.md, "The model"."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Routing:
    """Per-forward control of every MoE layer of a model, keyed by layer index.

    `replay[layer]`: `[T, top_k]` integer expert ids to route the forward's tokens to; a row with a
    negative id routes that token live. `record`: each MoE layer stores the `[T, top_k]` ids it
    used in `recorded[layer]` (int64, on the tokens' device). `record_live`: each layer stores the
    `[T, top_k]` ids its router chose live in `live[layer]` (the same as `recorded` unless routes
    were replayed; route agreement). `keep_logits`: each layer stores its `[T, num_experts]`
    float32 router logits in `logits[layer]`, differentiable (load balancing).

    A plain class on purpose, not a dataclass: FSDP2 rebuilds dataclass arguments of a wrapped
    module's forward (`torch.distributed.utils._apply_to_tensors`, to cast or move their tensors),
    so a block would record into a copy and the caller would never see it.
    """

    def __init__(self, replay: dict[int, torch.Tensor] | None = None, record: bool = False,
                 keep_logits: bool = False, record_live: bool = False):
        self.replay = replay
        self.record, self.keep_logits, self.record_live = record, keep_logits, record_live
        self.recorded: dict[int, torch.Tensor] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.live: dict[int, torch.Tensor] = {}

    def with_replay(self, replay: dict[int, torch.Tensor] | None) -> Routing:
        """The same control with other replay rows (e.g. a rank's slice of them); what the forward
        records lands in this object's dicts (shared, not copied)."""
        view = Routing(replay, self.record, self.keep_logits, self.record_live)
        view.recorded, view.logits, view.live = self.recorded, self.logits, self.live
        return view

    def __repr__(self) -> str:
        return (f"Routing(replay={None if self.replay is None else sorted(self.replay)}, record={self.record}, "
                f"keep_logits={self.keep_logits}, record_live={self.record_live})")


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor) -> torch.Tensor:
    """`w2_e(silu(w1_e x) * w3_e x)` for rows `x [N, dim]` sorted by expert, `counts [E]` rows per
    expert (summing to N); weights `w1, w3 [E, hidden, dim]`, `w2 [E, dim, hidden]` (HF's
    per-expert Linear layout, stacked). -> `[N, dim]`.

    Rows are scattered into an `[E, max_count, dim]` grid and multiplied with one `bmm` per
    projection (padding rows are zero and dropped); exact, differentiable, any device and dtype.
    """
    num_experts = w1.shape[0]
    n, dim = x.shape
    expert = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(n, device=x.device) - starts[expert]
    capacity = int(counts.max()) if n else 0
    grid = x.new_zeros(num_experts, capacity, dim).index_put((expert, slot), x)
    hidden = F.silu(torch.bmm(grid, w1.transpose(1, 2))) * torch.bmm(grid, w3.transpose(1, 2))
    return torch.bmm(hidden, w2.transpose(1, 2))[expert, slot]


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts stacked: w1 (gate) and w3 (up) `[E, hidden, dim]`, w2 (down)
    `[E, dim, hidden]`; `w*[e]` is exactly HF's `experts.{e}.{gate,up,down}_proj.weight`."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def dispatch(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs for rows sorted by expert (`counts [E]` per expert), in the same order. Expert
        parallelism replaces this with an all-to-all to the experts' owners and back."""
        return grouped_swiglu(x_sorted, counts, self.w1, self.w2, self.w3)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`x [T, dim]`, `expert_ids [T, k]`, `weights [T, k]` (x's dtype) -> `[T, dim]`:
        sum over k of `weights[t, j] * expert_{ids[t, j]}(x[t])`."""
        num_tokens, top_k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = torch.div(order, top_k, rounding_mode="floor")
        counts = torch.bincount(flat, minlength=self.num_experts)
        out = self.dispatch(x[token], counts) * weights.reshape(-1)[order, None]
        return x.new_zeros(num_tokens, x.shape[1]).index_add(0, token, out.to(x.dtype))


class MoE(nn.Module):
    """Router + experts of one block (`layer` is its index in the model, the key of its routes)."""

    def __init__(self, layer: int, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be between 1 and num_experts ({num_experts})")
        self.layer, self.top_k, self.norm_topk_prob = layer, top_k, norm_topk_prob
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim)

    def forward(self, x: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if routing is not None and routing.record_live:
            routing.live[self.layer] = expert_ids
        replay = None if routing is None or routing.replay is None else routing.replay.get(self.layer)
        if replay is not None:
            replay = replay.to(device=x.device, dtype=torch.long)
            if replay.shape != expert_ids.shape:
                raise ValueError(f"replayed routes of layer {self.layer} have shape {tuple(replay.shape)}, "
                                 f"expected {tuple(expert_ids.shape)} (tokens, top_k)")
            recorded = (replay >= 0).all(-1, keepdim=True)
            expert_ids = torch.where(recorded, replay, expert_ids)
            weights = probs.gather(-1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if routing is not None:
            if routing.record:
                routing.recorded[self.layer] = expert_ids
            if routing.keep_logits:
                routing.logits[self.layer] = logits.float()
        return self.experts(x, expert_ids, weights.to(x.dtype))


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss, averaged over layers: `E * sum_e f_e * P_e`, where `f_e` is
    the fraction of (token, slot) assignments that went to expert e and `P_e` its mean router
    probability. 1.0 for perfectly uniform routing; gradients reach the router through `P_e`."""
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        num_experts = probs.shape[-1]
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        fraction = torch.bincount(chosen, minlength=num_experts).to(probs.dtype) / max(chosen.numel(), 1)
        losses.append(num_experts * (fraction * probs.mean(0)).sum())
    return torch.stack(losses).mean()
