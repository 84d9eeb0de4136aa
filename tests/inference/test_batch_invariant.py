"""`batch_invariant=True` (`tandem serve --batch-invariant`): a request's tokens and logprobs are
bit-identical whether it runs alone or inside a batch of 64, beside longer and shorter prompts or
prompts sharing its prefix, in float32 and bfloat16. The default engine is not (shared prefixes
take the cascade decode passes; where prefill attention runs in PyTorch, a longer prompt beside
it pads it): the contrast below is what the flag is for."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tandem.inference.engine import LLMEngine
from tandem.inference.outputs import RequestOutput
from tandem.inference.request import GenerationRequest
from tandem.inference.sampling_params import SamplingParams
from tests.inference.conftest import prompts
from tests.inference.server_utils import ServerProcess

TARGET = prompts([37], seed=1)[0]


def generate(engine: LLMEngine, others: list[list[int]]) -> RequestOutput:
    """The target request (sampled, seeded) with `others` added before it in the same steps."""
    engine.flush_cache()
    for i, ids in enumerate(others):
        params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=i, ignore_eos=True)
        engine.add_request(GenerationRequest(f"other-{i}", ids, params, return_logprob=True))
    params = SamplingParams(max_new_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    engine.add_request(GenerationRequest("target", TARGET, params, return_logprob=True))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.rid: o for o in engine.step()})
    return outs["target"]


BATCHES = {
    "63 others, longer and shorter": prompts([5 + (i * 7) % 60 for i in range(63)], seed=3),
    "one longer prompt": prompts([60], seed=3),
    "63 sharing its first 32 tokens": [TARGET[:32] + p for p in prompts([3 + i % 9 for i in range(63)], seed=4)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_request_is_bit_identical_alone_and_in_a_batch(qwen3_dir, dtype):
    engine = LLMEngine(qwen3_dir, kv_cache_tokens=8192, block_size=16, max_num_seqs=256, dtype=dtype,
                       batch_invariant=True)
    alone = generate(engine, [])
    for name, others in BATCHES.items():
        batched = generate(engine, others)
        assert batched.output_ids == alone.output_ids, name
        assert torch.equal(torch.tensor(batched.output_logprobs), torch.tensor(alone.output_logprobs)), name


def test_the_default_engine_depends_on_its_batch(qwen3_dir):
    """Catches the test above passing for want of sensitivity: without the flag, the same request
    beside others sharing its prefix (cascade decode passes) gets other logprobs; and, where
    prefill attention runs in PyTorch instead of the CPU kernel, beside one longer prompt too."""
    engine = LLMEngine(qwen3_dir, kv_cache_tokens=8192, block_size=16, max_num_seqs=256, dtype=torch.float32)
    alone, beside = generate(engine, []), generate(engine, BATCHES["63 sharing its first 32 tokens"])
    assert not torch.equal(torch.tensor(beside.output_logprobs), torch.tensor(alone.output_logprobs))
    engine = LLMEngine(qwen3_dir, kv_cache_tokens=8192, block_size=16, max_num_seqs=256, dtype=torch.bfloat16)
    engine.runner.attention_kernel = False
    alone, beside = generate(engine, []), generate(engine, BATCHES["one longer prompt"])
    assert not torch.equal(torch.tensor(beside.output_logprobs), torch.tensor(alone.output_logprobs))


def test_tandem_serve_batch_invariant_over_http(qwen3_dir, tmp_path):
    """`tandem serve --batch-invariant --dtype bfloat16`: the target sent alone, then again with 63
    other requests sent at once (the server batches them as they arrive), gets the same tokens
    and the same logprobs, to the bit; /get_server_info reports the flag."""
    def body(ids, seed, n_new):
        return {"input_ids": ids, "return_logprob": True,
                "sampling_params": {"max_new_tokens": n_new, "temperature": 0.8, "seed": seed, "ignore_eos": True}}

    server = ServerProcess(qwen3_dir, tmp_path, "--batch-invariant", "--dtype", "bfloat16")
    try:
        assert server.ok("/get_server_info", method="GET")["batch_invariant"] is True
        alone = server.ok("/generate", body(TARGET, 7, 24))
        others = BATCHES["63 others, longer and shorter"]
        with ThreadPoolExecutor(16) as pool:
            busy = [pool.submit(server.ok, "/generate", body(ids, i, 30)) for i, ids in enumerate(others)]
            batched = server.ok("/generate", body(TARGET, 7, 24))
            [f.result(120) for f in busy]
        assert batched["output_ids"] == alone["output_ids"]
        assert batched["meta_info"]["output_token_logprobs"] == alone["meta_info"]["output_token_logprobs"]
    finally:
        server.stop()
