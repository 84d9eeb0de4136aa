"""Helpers of the GPU checks: `tandem serve` on the tests' device, transformers' greedy decoding
as the oracle of served tokens, and the trainer's recompute of served logprobs."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tandem.data.batch import SequenceBatch
from tandem.train import TrainEngine
from tests.gpu.conftest import require_server_modules
from tests.inference.server_utils import ServerProcess
from tests.weights.common import start_server

SERVER_START_S = 90  # a fresh GPU machine: CUDA context, model load (~10-20 s); a hung start fails fast
FP32_NEAR_TIE = 1e-4  # an fp32 greedy step whose top two logits are closer may swap on another device


def start_device_server(model_dir: Path, log_dir: Path, device: torch.device, dtype_name: str,
                        weights_dir: Path | None = None) -> ServerProcess:
    """`tandem serve --device DEVICE --dtype DTYPE` (started, not yet ready: `wait_ready`)."""
    require_server_modules()
    return start_server(model_dir, log_dir, weights_dir, "--device", str(device), "--dtype", dtype_name, wait=False)


def wait_all(servers: list[ServerProcess]) -> None:
    for server in servers:
        server.wait_ready(SERVER_START_S)


def hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


@torch.no_grad()
def hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int, device: torch.device) -> list[int]:
    """`generate` greedy, exactly `n` new tokens (EOS suppressed as the server's ignore_eos
    keeps going; tests/inference/test_parity.py does the same)."""
    ids = torch.tensor([prompt], device=device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                      min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def compare_greedy(hf: transformers.PreTrainedModel, prompt: list[int], served: list[int], ref: list[int],
                   device: torch.device) -> tuple[int, bool, str]:
    """(how many leading tokens agree, whether the first difference is excusable, why they part).
    At the first difference, the raw logits of transformers (no logits processors) after the
    common prefix say whether it is a near-tie: the served token's logit within `FP32_NEAR_TIE`
    of transformers' choice, or the served token is the raw argmax (transformers'
    `min_new_tokens` suppressed an EOS there)."""
    agree = next((k for k, (a, b) in enumerate(zip(served, ref, strict=True)) if a != b), len(ref))
    if agree == len(ref):
        return agree, True, ""
    logits = hf(torch.tensor([prompt + ref[:agree]], device=device)).logits[0, -1].float()
    gap = float(logits[ref[agree]] - logits[served[agree]])
    raw_choice = int(logits.argmax())
    why = (f"prompt {prompt} step {agree}: served {served[agree]}, transformers {ref[agree]} "
           f"(logit gap {gap:.2e}, raw argmax {raw_choice})")
    return agree, gap <= FP32_NEAR_TIE or raw_choice == served[agree], why


def recompute(engine: TrainEngine, prompts: list[list[int]], outputs: list[list[int]]) -> list[torch.Tensor]:
    """The trainer's logprobs of each served output, given its prompt: one `forward_logprobs` over
    the prompt + output sequences (as the trainer scores a rollout), float32 on CPU."""
    batch = SequenceBatch([{"input_ids": torch.tensor(p + o)} for p, o in zip(prompts, outputs, strict=True)])
    lps = engine.forward_logprobs(batch).logprobs
    return [lp[len(p) - 1: len(p) - 1 + len(o)] for lp, p, o in zip(lps, prompts, outputs, strict=True)]


def max_logprob_diff(served: list[list[float]], recomputed: list[torch.Tensor]) -> float:
    return max(float((torch.tensor(s) - r).abs().max()) for s, r in zip(served, recomputed, strict=True))
