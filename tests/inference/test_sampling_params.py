"""SamplingParams defaults and validation errors that name the field and the valid range."""

from __future__ import annotations

import pytest

from tandem.inference.errors import RequestError
from tandem.inference.sampling_params import SamplingParams


def test_protocol_defaults():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_new_tokens) == (128, 1.0, 1.0, -1, 0)
    assert (p.stop_token_ids, p.stop, p.ignore_eos, p.skip_special_tokens, p.n, p.seed) == ([], [], False, True, 1, None)
    assert p.frequency_penalty == p.presence_penalty == 0.0
    assert SamplingParams(temperature=1e-7).greedy and not p.greedy
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(top_k=None).vocab_top_k == 0


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": 0}, "top_k must be an integer >= 1"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens=5 must be <= max_new_tokens"),
        ({"frequency_penalty": 3.0}, "frequency_penalty must be in [-2, 2]"),
        ({"presence_penalty": "a"}, "presence_penalty"),
        ({"n": 0}, "n must be an integer >= 1"),
        ({"seed": -1}, "seed must be an integer in [0, 9223372036854775807]"),
        ({"seed": 10**23}, "seed must be an integer in [0, 9223372036854775807]"),
        ({"seed": 2**63}, "seed must be an integer in [0, 9223372036854775807]"),
        ({"seed": 1e23}, "seed must be an integer in [0, 9223372036854775807]"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop": ["ok", ""]}, "stop must be"),
        ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
        ({"temprature": 1.0}, "unknown sampling_params field(s) ['temprature']"),
    ],
)
def test_invalid_fields_raise_request_error_naming_the_field(fields, needle):
    with pytest.raises(RequestError) as err:
        SamplingParams.from_dict(fields)
    assert needle in str(err.value)
    assert isinstance(err.value, ValueError)


def test_the_largest_seed_and_top_k_beyond_the_vocabulary_are_accepted():
    assert SamplingParams(seed=2**63 - 1, n=4).seed == 2**63 - 1  # samples use seed + i < 2**64
    assert SamplingParams(top_k=10**30).vocab_top_k == 10**30  # more than the vocabulary: all of it
