"""Serving Qwen3-MoE: greedy equals transformers, and the routed experts the engine and `tandem
serve` return (SGLang's `return_routed_experts`) equal a trainer-side forward that records its
routes, through prefix-cache hits, copy-on-write between samples, preemption and resubmitted
requests; the rollout client and the RLVR workflow carry them into `Trajectory.routed_experts`.

The test model has three layers, the middle one dense, so the wire's layer axis (all layers, -1 in
dense ones) differs from the trajectory's (MoE layers only)."""

from __future__ import annotations

import asyncio
import base64
import threading

import pytest
import torch
import transformers

from tandem.fleet.generation import GenerationParams
from tandem.fleet.routed_experts import RoutedExpertLayout, decode_routed_experts
from tandem.inference.engine import LLMEngine
from tandem.inference.errors import RequestError
from tandem.inference.request import GenerationRequest
from tandem.inference.sampling_params import SamplingParams
from tandem.models import load_model
from tandem.models.common.moe import Routing
from tandem.rollout.client import ClientConfig, InferenceClient
from tandem.rollout.types import ModelRequest
from tandem.rollout.workflows.multi_turn import Feedback, MultiTurnWorkflow
from tandem.rollout.workflows.rlvr import RLVRWorkflow
from tests.inference.conftest import prompts
from tests.inference.server_utils import ServerProcess, sse_events, wait_for

BLOCK = 8
LONG = 2000  # max_new_tokens of a request that must still be running when the server is paused


@pytest.fixture(scope="module")
def trainer_model(moe_dir):
    return load_model(moe_dir).eval()


@torch.no_grad()
def recorded_experts(model, tokens: list[int]) -> torch.Tensor:
    """`[len(tokens), n_layers, top_k]` routes of one trainer-side forward (-1 in dense layers)."""
    routing = Routing(record=True)
    model(torch.tensor(tokens), torch.tensor([0, len(tokens)], dtype=torch.int32), routing=routing)
    args = model.args
    out = torch.full((len(tokens), args.n_layers, args.num_experts_per_tok), -1, dtype=torch.int32)
    for layer in args.moe_layers:
        out[:, layer] = routing.recorded[layer].to(torch.int32)
    return out


def assert_experts(model, prompt: list[int], output: list[int], routes: torch.Tensor) -> None:
    tokens = prompt + output
    assert routes.shape == (len(tokens) - 1, model.args.n_layers, model.args.num_experts_per_tok)
    assert torch.equal(routes, recorded_experts(model, tokens)[:-1])


# -------------------------------------------------------------------------------- engine
@torch.no_grad()
def test_engine_greedy_equals_transformers_and_routes_equal_the_trainer(moe_dir, trainer_model):
    assert trainer_model.args.moe_layers == [0, 2]
    # A small cache: the batch joins, leaves and is preempted (re-prefilled: routes written again).
    engine = LLMEngine(moe_dir, kv_cache_tokens=160, block_size=BLOCK, max_num_batched_tokens=64)
    batch = prompts([7, 40, 1, 17, 33], seed=1)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    outs = engine.generate(batch, params, return_routed_experts=True)
    assert engine.scheduler.num_preemptions > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    for ids, out in zip(batch, outs, strict=True):
        ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=16)
        assert out.output_ids == ref[0, len(ids):].tolist()
        assert_experts(trainer_model, ids, out.output_ids, out.routed_experts)
    # A prefix-cache hit: the prompt's cached blocks still know their routes.
    again = engine.generate([batch[1]], params, return_routed_experts=True)[0]
    assert again.cached_tokens >= 32 and again.output_ids == outs[1].output_ids
    assert torch.equal(again.routed_experts, outs[1].routed_experts)
    # Samples of one prompt share its blocks; the partly filled last one is copied on write.
    sampled = engine.generate([batch[3]], SamplingParams(max_new_tokens=12, temperature=1.0, n=3, seed=5),
                              return_routed_experts=True)
    assert len({tuple(o.output_ids) for o in sampled}) > 1
    for out in sampled:
        assert_experts(trainer_model, batch[3], out.output_ids, out.routed_experts)
    # Only requests that ask get routes.
    assert engine.generate([batch[0]], params)[0].routed_experts is None


def test_engine_bf16_serves_moe_with_routes(moe_dir):
    engine = LLMEngine(moe_dir, kv_cache_tokens=512, block_size=BLOCK, dtype=torch.bfloat16)
    ids = prompts([20], seed=3)[0]
    out = engine.generate([ids], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
                          return_routed_experts=True)[0]
    assert len(out.output_ids) == 8 and out.routed_experts.shape == (27, 3, 2)
    assert (out.routed_experts[:, [0, 2]] >= 0).all() and (out.routed_experts[:, 1] == -1).all()


def test_dense_engine_refuses_routed_experts(qwen3_dir):
    engine = LLMEngine(qwen3_dir, kv_cache_tokens=256, block_size=BLOCK)
    with pytest.raises(RequestError, match="return_routed_experts needs a mixture-of-experts model"):
        engine.add_request(GenerationRequest("r", [11, 12], return_routed_experts=True))


# -------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server(moe_dir, tmp_path_factory):
    srv = ServerProcess(moe_dir, tmp_path_factory.mktemp("serve-moe"), "--block-size", str(BLOCK),
                        "--kv-cache-tokens", "4096")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def layout(moe_dir):
    return RoutedExpertLayout.of_model(moe_dir)


def wire_experts(body: dict, layout: RoutedExpertLayout) -> torch.Tensor:
    """The response's routes on the whole layer axis (`[rows, n_layers, top_k]`)."""
    meta = body["meta_info"]
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    full = RoutedExpertLayout(layout.num_layers, layout.top_k, tuple(range(layout.num_layers)))
    return torch.tensor(decode_routed_experts(meta["routed_experts"], rows, full), dtype=torch.int32)


def test_generate_returns_routes_as_sglang(server, trainer_model, layout):
    assert layout == RoutedExpertLayout(3, 2, (0, 2))
    ids = prompts([21], seed=7)[0]
    body = {"input_ids": ids, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}}
    first = server.ok("/generate", body)
    assert isinstance(first["meta_info"]["routed_experts"], str)
    assert_experts(trainer_model, ids, first["output_ids"], wire_experts(first, layout))
    again = server.ok("/generate", body)  # prefix-cache hit
    assert again["meta_info"]["cached_tokens"] == 16 and again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["routed_experts"] == first["meta_info"]["routed_experts"]
    # n samples share the prompt's blocks (copy-on-write of the last one); each has its own routes.
    sampled = server.ok("/generate", {**body, "sampling_params": {"max_new_tokens": 10, "n": 2, "seed": 1}})
    assert sampled[0]["output_ids"] != sampled[1]["output_ids"]
    for item in sampled:
        assert_experts(trainer_model, ids, item["output_ids"], wire_experts(item, layout))
    # Streaming: the final event carries them; without the flag there are none.
    events = sse_events(server.url, "/generate", {**body, "stream": True})
    assert events[-1] == "[DONE]" and all("routed_experts" not in e["meta_info"] for e in events[:-2])
    assert events[-2]["meta_info"]["routed_experts"] == first["meta_info"]["routed_experts"]
    plain = server.ok("/generate", {**body, "return_routed_experts": False})
    assert "routed_experts" not in plain["meta_info"]
    status, err = server.post("/generate", {**body, "return_routed_experts": "sometimes"})
    assert status == 400 and "return_routed_experts" in err["message"]
    # routed_experts_start_len s: rows s.. of the same array (SGLang: `[s, seqlen - 1)`).
    tail = server.ok("/generate", {**body, "routed_experts_start_len": 5})["meta_info"]["routed_experts"]
    full = base64.b64decode(first["meta_info"]["routed_experts"])
    row = len(full) // (len(ids) + len(first["output_ids"]) - 1)
    assert base64.b64decode(tail) == full[5 * row:]


def test_client_splices_routes_of_a_resubmitted_request(server, trainer_model, layout):
    """Paused mid-generation (abort), the client resubmits prompt + partial output; the final
    routes cover the whole sequence and equal the trainer's, the last token's row unknown."""
    ids = prompts([13], seed=9)[0]
    params = GenerationParams(max_new_tokens=LONG, temperature=0.0, ignore_eos=True)
    client = InferenceClient([server.url], ClientConfig(routed_expert_layout=layout))
    before = server.ok("/get_server_info", method="GET")["engine_stats"]["generated_tokens"]
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", asyncio.run(_generate(client, ids, params))))
    worker.start()
    wait_for(lambda: server.ok("/get_server_info", method="GET")["engine_stats"]["generated_tokens"] >= before + 20)
    server.ok("/pause_generation", {"mode": "abort"})
    server.ok("/continue_generation", {})
    worker.join(300)  # generous: a loaded CI machine once took over a minute here
    assert "r" in result, "the resubmitted generation did not finish within 300 s (or raised: see the thread's log)"
    resp = result["r"]
    assert resp.num_aborts == 1 and len(resp.output_ids) == LONG
    routes = resp.routed_experts
    assert len(routes) == len(ids) + LONG and routes[-1] == [[-1, -1], [-1, -1]]
    want = recorded_experts(trainer_model, ids + resp.output_ids)[:-1, [0, 2]]
    assert torch.equal(torch.tensor(routes[:-1], dtype=torch.int32), want)


async def _generate(client: InferenceClient, ids: list[int], params: GenerationParams):
    try:
        return await client.agenerate(ModelRequest(ids, params))
    finally:
        await client.aclose()


def one(*args, **kwargs) -> float:
    return 1.0


def test_rlvr_trajectories_carry_routes(server, trainer_model, layout):
    client = InferenceClient([server.url], ClientConfig(routed_expert_layout=layout))
    workflow = RLVRWorkflow(one, GenerationParams(max_new_tokens=6, temperature=1.0), n_samples=2)
    ids = prompts([9], seed=11)[0]

    async def run():
        try:
            return await workflow.arun_episode(client, {"input_ids": ids})
        finally:
            await client.aclose()
            workflow.close()

    for traj in asyncio.run(run()):
        n = len(traj.input_ids)
        assert n == len(ids) + 6 and len(traj.routed_experts) == n
        assert all(len(row) == 2 and all(len(e) == 2 for e in row) for row in traj.routed_experts)
        assert traj.routed_experts[-1] == [[-1, -1], [-1, -1]]
        want = recorded_experts(trainer_model, traj.input_ids)[:-1, [0, 2]]
        assert torch.equal(torch.tensor(traj.routed_experts[:-1], dtype=torch.int32), want)


def test_multi_turn_trajectory_carries_routes_of_every_turn(server, moe_dir, trainer_model, layout):
    tokenizer = transformers.AutoTokenizer.from_pretrained(moe_dir)
    client = InferenceClient([server.url], ClientConfig(routed_expert_layout=layout))
    workflow = MultiTurnWorkflow(tokenizer, lambda messages, item: Feedback("more"),
                                 GenerationParams(max_new_tokens=5, temperature=0.0, ignore_eos=True), max_turns=2)

    async def run():
        try:
            return await workflow.arun_episode(client, {"prompt": "hi"})
        finally:
            await client.aclose()

    traj = asyncio.run(run())
    assert traj.num_turns == 2 and traj.loss_mask.count(0) > 0 and len(traj.routed_experts) == len(traj.input_ids)
    assert traj.routed_experts[-1] == [[-1, -1], [-1, -1]]
    want = recorded_experts(trainer_model, traj.input_ids)[:-1, [0, 2]]
    assert torch.equal(torch.tensor(traj.routed_experts[:-1], dtype=torch.int32), want)
