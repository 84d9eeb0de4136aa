"""`tandem serve`'s /generate as real SGLang clients use it (issue 22, item 3): AReaL's request
body, prompt logprobs (`logprob_start_len`) against the trainer's recompute, top logprobs against a
hand softmax, SGLang's abort answers, and every GenerateReqInput / SamplingParams field sorted
(refused ones named). One real server process over HTTP on 127.0.0.1."""

from __future__ import annotations

import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers

from tandem.inference.server import sglang_fields
from tandem.models import load_model
from tests.inference.areal_client import areal_generate_body, areal_parse
from tests.inference.conftest import prompts
from tests.inference.server_utils import ServerProcess, wait_for
from tests.inference.test_parity import teacher_forced_logprobs

MAX_NUM_SEQS = 2
LONG = 3000


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    srv = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("serve"), "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--kv-cache-tokens", "8192", "--block-size", "8")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def trainer_model(qwen3_dir):
    return load_model(qwen3_dir)


def test_areal_generate_body_is_answered_in_the_shape_areal_parses(server, trainer_model):
    prompt = prompts([9], seed=11)[0]
    out = server.ok("/generate", areal_generate_body(prompt, 6, 0.8))
    tokens, logprobs, reason = areal_parse(out)
    assert reason == "length" and tokens == out["output_ids"] and len(tokens) == 6
    expected = teacher_forced_logprobs(trainer_model, prompt, tokens, 0.8)
    assert max(abs(a - b) for a, b in zip(logprobs, expected.tolist(), strict=True)) <= 1e-5


def test_prompt_logprobs_equal_the_trainer_recompute_and_top_logprobs_a_hand_softmax(server, trainer_model):
    prompt, temperature, k = prompts([12], seed=12)[0], 0.7, 3
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k,
            "sampling_params": {"max_new_tokens": 4, "temperature": temperature, "sampling_seed": 5}}
    meta = server.ok("/generate", body)["meta_info"]
    with torch.no_grad():
        ids = torch.tensor(prompt + [t for _, t, _ in meta["output_token_logprobs"]])
        logits = trainer_model(ids, torch.tensor([0, len(ids)], dtype=torch.int32)).float() / temperature
    # input_token_logprobs: [logprob, id, null] per prompt position, position 0's logprob null.
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == prompt and inputs[0][0] is None
    recompute = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert max(abs(a[0] - b) for a, b in zip(inputs[1:], recompute.tolist(), strict=True)) <= 1e-5
    # top logprobs: exp(l / T) / sum exp(l / T) by hand, in float64.
    probs = (logits.double() - logits.double().amax(-1, keepdim=True)).exp()
    probs /= probs.sum(-1, keepdim=True)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(prompt)
    rows = [(p - 1, top) for p, top in enumerate(meta["input_top_logprobs"]) if top is not None]
    rows += [(len(prompt) - 1 + i, top) for i, top in enumerate(meta["output_top_logprobs"])]
    assert len(meta["output_top_logprobs"]) == 4
    for pos, top in rows:
        want = torch.topk(probs[pos], k)
        assert [t for _, t, _ in top] == want.indices.tolist()
        assert max(abs(lp - math.log(p)) for (lp, _, _), p in zip(top, want.values.tolist(), strict=True)) <= 1e-5
    # From a later position, and prefill only (max_new_tokens 0, how a trainer scores a sequence).
    later = server.ok("/generate", {**body, "logprob_start_len": 5, "top_logprobs_num": 0})["meta_info"]
    assert later["input_token_logprobs"] == inputs[5:] and "input_top_logprobs" not in later
    scored = server.ok("/generate", {**body, "sampling_params": {"max_new_tokens": 0, "temperature": temperature}})
    assert scored["output_ids"] == [] and scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert scored["meta_info"]["input_token_logprobs"] == inputs
    assert scored["meta_info"]["input_top_logprobs"] == meta["input_top_logprobs"]


def slime_generate_body(prompt_ids: list[int], stop_token_ids: list[int], seed: int) -> dict:
    """The body slime's `generate` (slime/rollout/sglang_rollout.py, THUDM/slime) posts: the
    sampling params its `GenerateState` builds (no_stop_trim, spaces_between_special_tokens false,
    custom_params when top_p != 1) with the per-sample `sampling_seed` it sets."""
    sampling_params = dict(temperature=0.0, top_p=0.9, top_k=-1, max_new_tokens=8, stop=None,
                           stop_token_ids=stop_token_ids, skip_special_tokens=False, no_stop_trim=True,
                           spaces_between_special_tokens=False, custom_params={"return_top_p_token_ids": True},
                           sampling_seed=seed)
    return {"sampling_params": sampling_params, "return_logprob": True, "input_ids": prompt_ids}


def test_slime_generate_body_is_accepted_and_no_stop_trim_keeps_the_stop_in_text(server, qwen3_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen3_dir)
    prompt = prompts([7], seed=13)[0]
    free = server.ok("/generate", slime_generate_body(prompt, [], 1))
    stop = free["output_ids"][2]
    first = free["output_ids"].index(stop)
    kept = server.ok("/generate", slime_generate_body(prompt, [stop], 1))
    assert kept["output_ids"] == free["output_ids"][:first + 1]
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert kept["text"] == tokenizer.decode(kept["output_ids"])  # the stop token's text stays
    trimmed = server.ok("/generate", {**slime_generate_body(prompt, [stop], 1),
                                      "sampling_params": {"temperature": 0.0, "max_new_tokens": 8,
                                                          "stop_token_ids": [stop], "skip_special_tokens": False}})
    assert trimmed["text"] == tokenizer.decode(kept["output_ids"][:-1])
    assert trimmed["text"] != kept["text"]


def _long(rid: str, n: int = 1) -> dict:
    return {"rid": rid, "input_ids": [11, 12, 13], "return_logprob": True,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "n": n}}


def test_aborts_are_answered_as_sglang_answers_them(server):
    stats = lambda: server.ok("/get_server_info", method="GET")["engine_stats"]  # noqa: E731
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(server.ok, "/generate", _long("run-", MAX_NUM_SEQS))
        wait_for(lambda: stats()["running"] >= MAX_NUM_SEQS)
        queued = pool.submit(server.ok, "/generate", _long("queued-"))
        wait_for(lambda: stats()["waiting"] == 1)
        time.sleep(0.2)
        assert server.ok("/pause_generation", {"mode": "abort"})["success"] is True
        # Queued in the engine when pause aborted it: SGLang's "Abort before prefill".
        q = queued.result(30)
        assert q["output_ids"] == [] and q["meta_info"]["output_token_logprobs"] == []
        assert q["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort before prefill"}
        assert areal_parse(q) == ([], [], "abort")
        # Mid-decode: the partial output with its logprobs.
        for o in running.result(30):
            meta = o["meta_info"]
            assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < LONG
            assert [t for _, t, _ in meta["output_token_logprobs"]] == o["output_ids"]
        # Held at the gate while paused, then aborted: the same answer.
        held = pool.submit(server.ok, "/generate", _long("held-"))
        wait_for(lambda: server.ok("/get_server_info", method="GET")["waiting_at_gate"] == 1)
        server.ok("/abort_request", {"rid": "held-"})
        h = held.result(30)
        assert h["output_ids"] == [] and h["meta_info"]["output_token_logprobs"] == []
        assert h["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort before prefill"}
        assert server.ok("/continue_generation", {})["success"] is True


@pytest.mark.parametrize(("body", "field"), [
    ({"lora_path": "adapter-1"}, "lora_path"),
    ({"image_data": "http://127.0.0.1/x.png"}, "image_data"),
    ({"token_ids_logprob": [3, 4]}, "token_ids_logprob"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"routed_dp_rank": 1}, "routed_dp_rank"),
    ({"sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
    ({"sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
    ({"sampling_params": {"logit_bias": {"3": 1.5}}}, "sampling_params.logit_bias"),
    ({"sampling_params": {"temperature": "0.7"}}, "temperature"),  # SGLang does not coerce sampling_params
    ({"no_such_field": 1}, "no_such_field"),
])
def test_refused_fields_are_named(server, body, field):
    status, err = server.post("/generate", {"input_ids": [11, 12], **body})
    assert status == 400 and field in err["message"], err


def test_neutral_values_and_numeric_strings_are_accepted(server):
    body = {"input_ids": [11, 12, 13], "return_logprob": "true", "logprob_start_len": "1", "top_logprobs_num": 2.0,
            "stream": 0,
            "lora_path": None, "image_data": [], "session_id": "s-1", "priority": 3, "routed_dp_rank": "0",
            "log_metrics": False, "custom_labels": {"a": "b"}, "return_hidden_states": False,
            "sampling_params": {"max_new_tokens": 2, "min_p": 0.0, "repetition_penalty": 1.0, "json_schema": None,
                                "stream_interval": 4, "spaces_between_special_tokens": True, "logit_bias": {}}}
    meta = server.ok("/generate", body)["meta_info"]
    assert len(meta["input_token_logprobs"]) == 2 and all(len(t) == 2 for t in meta["output_top_logprobs"])


def test_docs_table_lists_every_field():
    """docs/inference.md's "SGLang fields" table names every field this server sorts."""
    doc = (Path(__file__).parents[2] / "docs" / "inference.md").read_text()
    listed = set(re.findall(r"^\| `([a-z0-9_]+)` \|", doc, flags=re.M))
    fields = (sglang_fields.HONOURED_GENERATE | set(sglang_fields.ACCEPTED_GENERATE) | set(sglang_fields.REFUSED_GENERATE)
              | sglang_fields.HONOURED_SAMPLING | set(sglang_fields.ACCEPTED_SAMPLING)
              | set(sglang_fields.REFUSED_SAMPLING))
    assert fields <= listed, sorted(fields - listed)
