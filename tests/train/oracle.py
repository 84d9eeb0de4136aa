"""An independent reference for one training step: plain `transformers` + hand-written losses +
`torch.nn.utils.clip_grad_norm_` + `torch.optim.AdamW`, one process, the whole batch, one
sequence at a time (no packing, no micro-batches, no FSDP, nothing from `tandem.train`).

The optimizer settings are written out here from `OptimizerConfig`'s documented meaning, not
built by `tandem.train.optim`; the learning rate of each step is passed in by the caller, who
computes it by hand from the schedule's definition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.train import SequenceBatch
from tandem.train.config import OptimizerConfig

ENTROPY_COEF = 0.01  # the entropy bonus of `tests.train.helpers.weighted_loss`


def load_hf(path: str | Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def next_token_terms(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[n-1]` log p(ids[t+1] | ids[:t+1]) and the entropy of that distribution, for t < n-1."""
    logp = torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1)[:-1]
    token_logp = logp.gather(-1, ids[1:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def pg_loss_sum(model: torch.nn.Module, seq: dict) -> torch.Tensor:
    """The policy-gradient-like loss of `weighted_loss`, from scratch for one sequence: over the
    predicted tokens t+1 that are in the response, -(advantage[t+1] + reward) * log p(t+1) minus
    `ENTROPY_COEF` * entropy at t. Summed (the caller divides by the batch's loss-token count)."""
    token_logp, entropy = next_token_terms(model, seq["input_ids"])
    mask = seq["loss_mask"][1:].float()
    weight = seq["advantages"][1:] + seq["reward"]
    return -(weight * token_logp * mask).sum() - ENTROPY_COEF * (entropy * mask).sum()


def nll_sum(model: torch.nn.Module, seq: dict) -> torch.Tensor:
    """Supervised fine-tuning: -log p of every predicted token that is in the loss mask, summed."""
    token_logp, _ = next_token_terms(model, seq["input_ids"])
    return -(token_logp * seq["loss_mask"][1:].float()).sum()


def loss_tokens(batch: SequenceBatch) -> int:
    """Tokens that get a loss: predicted positions whose target is under the loss mask."""
    return sum(int(s["loss_mask"][1:].sum()) for s in batch.seqs)


@dataclass
class OracleTrainer:
    """AdamW on an HF model, one step per call of `step`, the global token mean of `loss_sum`."""

    path: str | Path
    config: OptimizerConfig
    loss_sum: Callable[[torch.nn.Module, dict], torch.Tensor] = pg_loss_sum
    adapter: str | Path | None = None  # a PEFT LoRA adapter: `peft` trains it, the base frozen
    model: torch.nn.Module = field(init=False)
    optimizer: torch.optim.AdamW = field(init=False)

    def __post_init__(self) -> None:
        self.model = load_hf(self.path)
        if self.adapter is not None:
            import peft

            self.model = peft.PeftModel.from_pretrained(self.model, str(self.adapter), is_trainable=True)
        self.model.train()
        c = self.config
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                                           weight_decay=c.weight_decay, foreach=False)

    def step(self, batch: SequenceBatch, lr: float) -> dict[str, float]:
        """One step at learning rate `lr`; the loss before it and the gradient norm before clipping."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = sum(self.loss_sum(self.model, s) for s in batch.seqs) / loss_tokens(batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.gradient_clipping)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return {"loss": float(loss.detach()), "grad_norm": float(norm)}

    def adapter_params(self) -> dict[str, torch.Tensor]:
        """PEFT name (as saved in `adapter_model.safetensors`) -> the adapter's tensor."""
        import peft

        return {n: t.detach().clone() for n, t in peft.get_peft_model_state_dict(self.model).items()}

    def params(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor, each shared (tied) tensor under every name it has."""
        return {n: t.detach().clone() for n, t in self.model.state_dict().items()}
