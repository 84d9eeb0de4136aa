"""`GenerationRequest`: one generation request as every route builds it and `LLMEngine.add_request`
takes it, unchanged on the way (the server's gate, its engine thread)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.inference.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate from `input_ids` and what the outputs carry. `params.n` samples (sample i
    seeded `params.seed + i` when a seed is given). `return_logprob`: each output token's logprob;
    with it, `top_logprobs_num` k > 0 adds the k most likely tokens' logprobs per output token and
    `logprob_start_len` >= 0 the prompt's logprobs from that position (-1: none). `stream`: each
    step's new tokens are reported as they come (`LLMEngine.pop_deltas`). `return_routed_experts`
    (MoE models): the outputs carry the experts each token was routed to."""

    rid: str
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    stream: bool = False
    return_routed_experts: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
