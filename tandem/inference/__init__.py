"""Tandem's inference engine: continuous batching over a paged KV cache, running the trainer's
native model so returned logprobs are the ones the trainer recomputes. See docs/inference.md.

    engine = LLMEngine("path/to/model")
    outs = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=16, n=4))
"""

from tandem.inference.engine import LLMEngine
from tandem.inference.errors import EngineBusyError, RequestError, WeightUpdateError
from tandem.inference.outputs import RequestOutput, TokenDelta
from tandem.inference.request import GenerationRequest
from tandem.inference.sampling_params import SamplingParams

__all__ = [
    "EngineBusyError",
    "GenerationRequest",
    "LLMEngine",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "TokenDelta",
    "WeightUpdateError",
]
