"""`tandem serve` over real HTTP on 127.0.0.1: every generation and control route, protocol shapes,
pause/abort semantics, oracles (transformers greedy, teacher-forced logprobs), 400s, disconnects,
memory release, and the official OpenAI client."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from tandem.models import load_model
from tests.inference.conftest import prompts
from tests.inference.server_utils import ServerProcess, sse_events, wait_for
from tests.inference.test_parity import teacher_forced_logprobs

MAX_NUM_SEQS = 8
LONG = 3000  # max_new_tokens of requests that must still be running when we act on them
META_KEYS = {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
             "finish_reason"}


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    srv = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("serve"), "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--kv-cache-tokens", "8192", "--block-size", "8")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(8) as ex:
        yield ex


def greedy(ids, n=8, **extra):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True, **extra}


def long_request(rid, n=1):
    return {"rid": rid, "input_ids": [11, 12, 13], "return_logprob": True,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "n": n, "temperature": 1.0}}


def engine_stats(server):
    return server.ok("/get_server_info", method="GET")["engine_stats"]


def wait_idle(server):
    return wait_for(lambda: (s := engine_stats(server))["running"] == 0 and s["waiting"] == 0
                    and s["used_blocks"] == 0 and s)


def wait_running(server, count=1):
    wait_for(lambda: engine_stats(server)["running"] >= count)


# ------------------------------------------------------------------------------ info routes
def test_info_routes(server, qwen3_dir):
    assert server.get("/health") == (200, {"status": "ok", "weight_version": "0"})
    info = server.ok("/get_model_info", method="GET")
    assert info == {"model_path": str(qwen3_dir), "tokenizer_path": str(qwen3_dir), "is_generation": True,
                    "weight_version": "0"}
    si = server.ok("/get_server_info", method="GET")
    assert si["max_total_num_tokens"] == 8192 and si["max_req_input_len"] == 4095
    assert si["max_num_seqs"] == MAX_NUM_SEQS and si["port"] == int(server.url.rsplit(":", 1)[1])
    assert si["weight_version"] == "0" and si["engine_stats"]["weight_version"] == "0"
    assert {"free_blocks", "used_blocks", "num_blocks", "running", "waiting"} <= set(si["engine_stats"])
    assert server.ok("/get_weight_version", method="GET") == {"weight_version": "0"}
    models = server.ok("/v1/models", method="GET")
    assert models["object"] == "list" and models["data"][0]["id"] == str(qwen3_dir)


# ------------------------------------------------------------------------------ generation
def test_generate_shape_and_transformers_greedy(server, qwen3_dir):
    batch = prompts([7, 30, 1, 17], seed=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    for i, ids in enumerate(batch):
        out = server.ok("/generate", greedy(ids, 24, rid=f"greedy-{i}"))
        assert set(out) == {"text", "output_ids", "meta_info"}
        meta = out["meta_info"]
        assert set(meta) == META_KEYS | {"input_token_logprobs", "output_token_logprobs"}
        assert meta["id"] == f"greedy-{i}" and meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == 24 and meta["finish_reason"] == {"type": "length", "length": 24}
        assert meta["weight_version"] == "0" and isinstance(meta["e2e_latency"], float)
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        assert all(x is None for _, _, x in meta["output_token_logprobs"])
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24, min_new_tokens=24)
        assert out["output_ids"] == ref[0, len(ids):].tolist()
    # Without return_logprob there is no list; a generated rid is returned.
    out = server.ok("/generate", {"input_ids": batch[0], "sampling_params": {"max_new_tokens": 3}})
    assert "output_token_logprobs" not in out["meta_info"] and len(out["meta_info"]["id"]) == 32


@pytest.mark.parametrize("sp", [{"temperature": 1.0, "seed": 3}, {"temperature": 0.7, "top_p": 0.9, "top_k": 50},
                                {"temperature": 0.0}], ids=["t1", "t0.7-top", "greedy"])
def test_logprobs_equal_teacher_forced_recomputation(server, qwen3_dir, sp):
    model = load_model(qwen3_dir, dtype=torch.float32)
    worst = 0.0
    for ids in prompts([5, 23, 40], seed=2):
        out = server.ok("/generate", {"input_ids": ids, "return_logprob": True,
                                      "sampling_params": {"max_new_tokens": 32, **sp}})
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        with torch.no_grad():
            ref = teacher_forced_logprobs(model, ids, out["output_ids"], sp["temperature"] or 1.0)
        worst = max(worst, (got - ref).abs().max().item())
    print(f"\n[server logprobs] {sp}: max |diff| = {worst:.2e}")
    assert worst <= 1e-5


def test_n_samples_text_and_stop(server):
    outs = server.ok("/generate", {"rid": "grp", "input_ids": [11, 12, 13, 14],
                                   "sampling_params": {"max_new_tokens": 6, "n": 3, "seed": 1}})
    assert isinstance(outs, list) and [o["index"] for o in outs] == [0, 1, 2]
    assert all(o["meta_info"]["id"] == "grp" and o["meta_info"]["completion_tokens"] == 6 for o in outs)
    text = server.ok("/generate", {"text": "the answer is", "sampling_params": {"max_new_tokens": 4}})
    assert isinstance(text["text"], str) and text["meta_info"]["prompt_tokens"] > 0
    first = server.ok("/generate", greedy([20, 21, 22], 4))["output_ids"][0]
    stop = server.ok("/generate", {"input_ids": [20, 21, 22],
                                   "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first]}})
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": first} and stop["output_ids"] == [first]


def test_stream_events(server):
    ids = [30, 31, 32, 33]
    plain = server.ok("/generate", greedy(ids, 6))
    events = sse_events(server.url, "/generate", greedy(ids, 6, stream=True))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [len(c["output_ids"]) for c in chunks[:6]] == [1, 2, 3, 4, 5, 6]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == plain["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]
    grouped = sse_events(server.url, "/generate", {"input_ids": ids, "stream": True,
                                                  "sampling_params": {"max_new_tokens": 3, "n": 2}})
    assert {c["index"] for c in grouped[:-1]} == {0, 1} and grouped[-1] == "[DONE]"


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("raw, needle", [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"input_ids": "abc"}).encode(), "list of token ids"),
    (json.dumps({"input_ids": [1, 2], "return_logprob": "maybe"}).encode(), "'return_logprob' must be true or false"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -5}}).encode(), "max_new_tokens"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}).encode(), "temperature"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}}).encode(), "unknown sampling_params"),
    (json.dumps({"input_ids": [1, 2], "colour": 3}).encode(), "unknown request field"),
    (json.dumps({"input_ids": [1, 2], "return_routed_experts": True}).encode(),
     "return_routed_experts needs a mixture-of-experts model"),
    (json.dumps({"input_ids": [5] * 4090, "sampling_params": {"max_new_tokens": 16}}).encode(), "exceeds the context"),
    (json.dumps({"input_ids": [10**6]}).encode(), "token ids in"),
    (json.dumps({"sampling_params": {}}).encode(), "send 'input_ids'"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"seed": 10**23}}).encode(),
     "sampling_params.seed must be an integer in [0, 9223372036854775807]"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"seed": 2**64 - 1, "n": 2}}).encode(),
     "sampling_params.seed must be an integer in [0, 9223372036854775807]"),
    (b'{"input_ids": [1, 2], "sampling_params": {"temperature": 1e400}}', "temperature must be a finite number"),
])
def test_bad_requests_answer_400_and_server_keeps_serving(server, raw, needle):
    status, body = server.post("/generate", raw=raw)
    assert status == 400, body
    assert body["object"] == "error" and body["type"] == "Bad Request" and body["code"] == 400
    assert needle in body["message"], body["message"]
    assert server.ok("/generate", greedy([11, 12], 2))["meta_info"]["completion_tokens"] == 2


def test_top_k_beyond_the_vocabulary_samples_from_all_of_it(server):
    # Once crashed the engine thread (int64 overflow in the sampler): every later request got 503.
    body = {"input_ids": [11, 12], "sampling_params": {"max_new_tokens": 3, "top_k": 10**30, "top_p": 0.5}}
    assert server.ok("/generate", body)["meta_info"]["completion_tokens"] == 3
    assert server.get("/health") == (200, {"status": "ok", "weight_version": "0"})


@pytest.mark.parametrize("extra, needle", [
    ({"seed": 10**23}, "sampling_params.seed must be an integer in [0, 9223372036854775807]"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"best_of": "x"}, "'best_of' must be an integer"),
])
def test_openai_bad_numbers_answer_400(server, extra, needle):
    body = {"model": "m", "prompt": [11, 12], "max_tokens": 2, **extra}
    status, answer = server.post("/v1/completions", raw=json.dumps(body).encode())
    assert status == 400, answer
    assert answer["object"] == "error" and answer["code"] == 400 and needle in answer["message"], answer
    assert server.get("/health") == (200, {"status": "ok", "weight_version": "0"})


def test_unknown_route_and_control_errors(server):
    status, body = server.post("/no_such_route", {})
    assert status == 404 and body["code"] == 404
    status, body = server.post("/abort_request", {"rid": 5})
    assert status == 400 and "'rid' must be a string" in body["message"]
    status, body = server.post("/pause_generation", {"mode": "sideways"})
    assert status == 400


# ------------------------------------------------------------------------------ abort / pause
def test_abort_running_and_queued_requests(server, pool):
    running = pool.submit(server.ok, "/generate", long_request("fill-0", n=MAX_NUM_SEQS))
    wait_running(server, MAX_NUM_SEQS)
    queued = pool.submit(server.ok, "/generate", long_request("queued-1"))
    wait_for(lambda: engine_stats(server)["waiting"] == 1)
    assert server.ok("/abort_request", {"rid": "queued-"})["success"] is True
    q = queued.result(30)
    assert q["meta_info"]["finish_reason"]["type"] == "abort"
    assert q["meta_info"]["completion_tokens"] == 0 and q["output_ids"] == []
    assert q["meta_info"]["output_token_logprobs"] == []  # SGLang's answer: present and empty
    assert q["meta_info"]["finish_reason"]["message"] == "Abort before prefill"
    assert not running.done()
    res = server.ok("/abort_request", {"rid": "fill-"})
    assert res == {"success": True, "message": "aborted 1 request(s)", "rids": ["fill-0"]}
    outs = running.result(30)
    assert len(outs) == MAX_NUM_SEQS
    for o in outs:
        meta = o["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < LONG
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(o["output_ids"])
    wait_idle(server)


def test_pause_aborts_in_flight_and_holds_new_requests_until_continue(server, pool):
    inflight = pool.submit(server.ok, "/generate", long_request("pause-a"))
    wait_running(server)
    time.sleep(0.2)
    res = server.ok("/pause_generation", {"mode": "abort"})
    assert res["success"] is True
    out = inflight.result(30)
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] > 0
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    # New requests wait inside the server ...
    held = pool.submit(server.ok, "/generate", greedy([40, 41, 42], 5))
    gone = pool.submit(server.ok, "/generate", {**greedy([40, 41], 5), "rid": "held-x"})
    wait_for(lambda: server.ok("/get_server_info", method="GET")["waiting_at_gate"] == 2)
    time.sleep(0.5)
    assert not held.done() and not gone.done()
    assert server.ok("/get_server_info", method="GET")["paused"] is True
    # ... one is aborted while held (zero tokens, an empty logprob list), the other runs after continue.
    server.ok("/abort_request", {"rid": "held-"})
    g = gone.result(10)
    assert g["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort before prefill"}
    assert g["meta_info"]["output_token_logprobs"] == []
    assert server.ok("/continue_generation", {})["success"] is True
    h = held.result(30)
    assert h["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    wait_idle(server)


def test_pause_in_place_keeps_requests(server, pool):
    inflight = pool.submit(server.ok, "/generate", greedy([50, 51], 200))
    wait_running(server)
    server.ok("/pause_generation", {"mode": "in_place"})
    before = engine_stats(server)["generated_tokens"]
    time.sleep(0.3)
    assert engine_stats(server)["generated_tokens"] == before and not inflight.done()
    server.ok("/continue_generation", {})
    assert inflight.result(30)["meta_info"]["completion_tokens"] == 200


def test_flush_cache(server, pool):
    assert server.ok("/flush_cache", {}) == {"success": True, "message": "prefix cache flushed"}
    inflight = pool.submit(server.ok, "/generate", long_request("flush-a"))
    wait_running(server)
    status, body = server.post("/flush_cache", {})
    assert status == 400 and body["success"] is False and "in flight" in body["message"]
    server.ok("/abort_request", {"abort_all": True})
    inflight.result(30)
    wait_idle(server)
    assert server.ok("/flush_cache", {})["success"] is True
    assert engine_stats(server)["cached_blocks"] == 0


# ------------------------------------------------------------------------------ versions, weights
def test_weight_version_and_weights_by_name(server, qwen3_dir):
    assert server.ok("/update_weight_version", {"new_version": "7"})["success"] is True
    assert server.ok("/get_weight_version", method="GET") == {"weight_version": "7"}
    out = server.ok("/generate", greedy([11, 12], 2))
    assert out["meta_info"]["weight_version"] == "7"
    values = server.ok("/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 5})
    ref = load_model(qwen3_dir).tok_embeddings.weight.flatten()[:5].tolist()
    assert values == pytest.approx(ref)
    status, body = server.post("/get_weights_by_name", {"name": "model.nope.weight"})
    assert status == 400 and "no parameter" in body["message"]
    server.ok("/update_weight_version", {"new_version": "0"})


def test_release_and_resume_memory(server, pool, qwen3_dir):
    ids = [60, 61, 62, 63]
    before = server.ok("/generate", greedy(ids, 10))["output_ids"]
    inflight = pool.submit(server.ok, "/generate", long_request("mem-a"))
    wait_running(server)
    status, body = server.post("/release_memory_occupation", {})
    assert status == 400 and "in flight" in body["message"]
    server.ok("/abort_request", {"rid": "mem-a"})
    inflight.result(30)
    wait_idle(server)
    assert server.ok("/release_memory_occupation", {"tags": ["kv_cache", "weights"]})["success"] is True
    assert server.ok("/get_server_info", method="GET")["memory_released"] == ["kv_cache", "weights"]
    waiting = pool.submit(server.ok, "/generate", greedy(ids, 10))
    time.sleep(0.5)
    assert not waiting.done()
    status, body = server.post("/update_weights_from_disk", {"model_path": str(qwen3_dir)})
    assert status == 400 and "weights are released" in body["message"], body
    assert server.ok("/resume_memory_occupation", {})["success"] is True
    assert waiting.result(30)["output_ids"] == before
    status, body = server.post("/release_memory_occupation", {"tags": ["gpu"]})
    assert status == 400 and "unknown memory tag" in body["message"]


# ------------------------------------------------------------------------------ disconnects
def open_request(server, body: dict, path: str = "/generate") -> socket.socket:
    """POST `body` on a raw socket (so the test can drop the connection mid-answer)."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_client_disconnect_aborts_and_frees_blocks(server, stream):
    sock = open_request(server, {**long_request(f"disc-{stream}"), "stream": stream})
    wait_running(server)
    if stream:
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
    sock.close()
    stats = wait_idle(server)
    assert stats["free_blocks"] == stats["num_blocks"]
    assert server.ok("/generate", greedy([11, 12], 2))["meta_info"]["completion_tokens"] == 2


# ------------------------------------------------------------------------------ OpenAI
def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60)
    comp = client.completions.create(model="tiny", prompt="the cat", max_tokens=5, temperature=0.0, logprobs=1,
                                     extra_body={"ignore_eos": True})
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 5
    assert len(comp.choices[0].logprobs.token_logprobs) == 5
    ids = client.completions.create(model="tiny", prompt=[[11, 12, 13], [14, 15]], max_tokens=3, n=2,
                                    extra_body={"ignore_eos": True, "top_k": 20})
    assert sorted(c.index for c in ids.choices) == [0, 1, 2, 3] and ids.usage.prompt_tokens == 5
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0.5, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens == 6
    assert [m.id for m in client.models.list().data] == [server.ok("/get_model_info", method="GET")["model_path"]]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
