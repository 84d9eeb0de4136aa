"""The wire form of routed experts (SGLang's `meta_info.routed_experts`): what `tandem serve`
encodes, `tandem.fleet.routed_experts` decodes; the layout checks; splicing a resubmitted request's
chunks; the adapters' request fields."""

from __future__ import annotations

import base64
import struct

import pytest
import torch

from tandem.fleet.adapters import UnsupportedOperation, adapter_for
from tandem.fleet.generation import GenerationParams
from tandem.fleet.routed_experts import RoutedExpertLayout, decode_routed_experts, splice_routed_experts
from tandem.inference.server.http_api import encode_routed_experts
from tandem.rollout.client import ClientConfig

LAYOUT = RoutedExpertLayout(num_layers=3, top_k=2, moe_layers=(0, 2))


def test_encoding_is_sglangs_int32_little_endian_base64_and_decodes_to_the_moe_layers():
    routes = torch.arange(4 * 3 * 2, dtype=torch.int32).reshape(4, 3, 2)
    routes[:, 1] = -1  # a dense layer
    encoded = encode_routed_experts(routes)
    raw = base64.b64decode(encoded)
    assert struct.unpack(f"<{4 * 3 * 2}i", raw) == tuple(routes.flatten().tolist())
    rows = decode_routed_experts(encoded, 4, LAYOUT)
    assert rows == routes[:, [0, 2]].tolist()
    assert rows[1] == [[6, 7], [10, 11]]


def test_decoding_names_a_layout_that_does_not_match():
    encoded = encode_routed_experts(torch.zeros(4, 3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"holds 96 bytes; 5 tokens x 3 layers x top_k 2 int32 need 120"):
        decode_routed_experts(encoded, 5, LAYOUT)
    with pytest.raises(ValueError, match="not base64"):
        decode_routed_experts("%%%", 4, LAYOUT)
    with pytest.raises(ValueError, match=r"moe_layers \[3\] are not layers of a 3-layer model"):
        RoutedExpertLayout(3, 2, (3,))


def test_splice_takes_the_newest_known_rows():
    a, b, c, unknown = [[1, 2], [3, 4]], [[5, 6], [7, 0]], [[0, 1], [2, 3]], [[-1, -1], [-1, -1]]
    assert splice_routed_experts([a, b], [c, c, c]) == [c, c, c]  # a resubmission covers the prefix again
    assert splice_routed_experts([a, b, c], [unknown, unknown]) == [a, b, c]  # aborted while queued: keep
    assert splice_routed_experts([a], [unknown, b]) == [a, b]
    assert splice_routed_experts([], [unknown]) == [unknown]


def test_adapters_ask_for_routes_and_parse_them():
    body = adapter_for("sglang").generate_body("r", [1, 2], GenerationParams(), 4, return_routed_experts=True)
    assert body["return_routed_experts"] is True
    assert "return_routed_experts" not in adapter_for("tandem").generate_body("r", [1], GenerationParams(), 4)
    chunk = adapter_for("tandem").parse_generate({"output_ids": [3], "meta_info": {
        "output_token_logprobs": [[-0.5, 3, None]], "finish_reason": {"type": "length"}, "routed_experts": "AAAA"}})
    assert chunk.routed_experts == "AAAA"
    with pytest.raises(UnsupportedOperation, match="routing replay"):
        adapter_for("vllm").generate_body("r", [1], GenerationParams(), 4, return_routed_experts=True)


def test_client_config_carries_the_layout_across_processes():
    from dataclasses import asdict

    config = ClientConfig(routed_expert_layout=LAYOUT)
    assert ClientConfig(**asdict(config)).routed_expert_layout == LAYOUT


def test_a_request_seed_reaches_every_server_kind_under_its_name():
    """rollout.seed_sampling: SGLang's (and tandem serve's) `sampling_params.sampling_seed`, vLLM's `seed`;
    a call that continues a seeded request after an abort gets a seed of its own, the same in every rerun."""
    from tandem.rollout.frontier import continuation_seed, sampling_seed

    seed = sampling_seed(1, 40, 3)
    assert seed == sampling_seed(1, 40, 3) and len({seed, sampling_seed(1, 40, 2), sampling_seed(2, 40, 3)}) == 3
    assert 0 <= seed < 2**63 and seed == sampling_seed(1, 40, 0) + 3  # sample i: sample 0's seed + i
    for kind in ("sglang", "tandem"):
        body = adapter_for(kind).generate_body("r", [1], GenerationParams(seed=seed), 4)
        assert body["sampling_params"]["sampling_seed"] == seed
        assert "sampling_seed" not in adapter_for(kind).generate_body("r", [1], GenerationParams(), 4)["sampling_params"]
    assert adapter_for("vllm").generate_body("r", [1], GenerationParams(seed=seed), 4)["sampling_params"]["seed"] == seed
    assert continuation_seed(seed, 0) == seed and continuation_seed(seed, 7) == continuation_seed(seed, 7) != seed
