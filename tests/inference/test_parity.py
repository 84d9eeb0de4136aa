"""The engine against its oracles: transformers greedy decoding and training-side logprobs."""

from __future__ import annotations

import pytest
import torch
import transformers

from tandem.inference.engine import LLMEngine
from tandem.inference.sampling_params import SamplingParams
from tandem.models import load_model
from tests.inference.conftest import prompts

LENGTHS = [7, 40, 1, 17, 33, 16]
MAX_NEW = 24


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
@torch.no_grad()
def test_greedy_equals_transformers_generate(arch, request):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    # A small cache and batch budget, so the run also joins/leaves the batch and crosses blocks.
    engine = LLMEngine(model_dir, kv_cache_tokens=1024, block_size=8, max_num_batched_tokens=64)
    batch = prompts(LENGTHS, seed=1)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = engine.generate(batch, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for ids, out in zip(batch, outs, strict=True):
        ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
        assert out.output_ids == ref[0, len(ids):].tolist()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def teacher_forced_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor(prompt + output)
    logits = model(ids, torch.tensor([0, len(ids)], dtype=torch.int32)).float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(ids) - 1)
    return logprobs[positions, torch.tensor(output)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=32, temperature=1.0, seed=3),
        SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, top_k=50, seed=4),
        SamplingParams(max_new_tokens=32, temperature=0.0),
    ],
    ids=["t1.0", "t0.7-topp-topk", "greedy"],
)
@torch.no_grad()
def test_logprobs_equal_teacher_forced_recomputation(qwen3_dir, params):
    engine = LLMEngine(qwen3_dir, kv_cache_tokens=2048, block_size=16)
    batch = prompts([5, 23, 40, 12], seed=2)
    outs = engine.generate(batch, params)
    trainer_model = load_model(qwen3_dir)
    temperature = 1.0 if params.greedy else params.temperature
    worst = 0.0
    for ids, out in zip(batch, outs, strict=True):
        ref = teacher_forced_logprobs(trainer_model, ids, out.output_ids, temperature)
        got = torch.tensor(out.output_logprobs)
        assert got.dtype == torch.float32 and len(got) == out.completion_tokens > 0
        worst = max(worst, (got - ref).abs().max().item())
    print(f"\n[logprobs] T={params.temperature} top_p={params.top_p} top_k={params.top_k}: max |diff| = {worst:.2e}")
    assert worst <= 1e-5
