"""One AReaL run's request sequence, replayed against a real `tandem serve` (issue 22): AReaL's
rollout clients generating while its trainer pauses them (running requests aborted mid-decode, a
queued one answered "Abort before prefill"), a disk update, the weight-update group formed, two
partial buckets over it, and prefill-only scoring (compute_logp) on the final weights.

Written from AReaL's code (`tests/inference/areal_client.py` names the files), not from our
server's: the client loop is `RemoteSGLangEngine.agenerate`'s (wait while the executor is paused;
resend the same body after "Abort before prefill"; after any other abort append the partial output
to `input_ids` and lower `max_new_tokens`; stop at stop/length or the token budget); the trainer's
update is `/pause_generation {}`, then `/update_weights_from_disk` with `model_path` and
`abort_all_requests`, or the group's init request followed by one `/update_weights_from_distributed`
per bucket, then `/continue_generation {}`. Scoring is a prefill-only request (`max_new_tokens` 0,
`logprob_start_len` 0, the response's tail of `input_token_logprobs`), as SGLang clients score a
sequence. Every logprob is checked against the trainer's recompute with the weights that produced it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch

from tandem.models import load_model
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.weights.verify import tensor_checksum
from tests.inference.areal_client import areal_generate_body, areal_group_update
from tests.inference.conftest import make_model_dir, prompts
from tests.inference.server_utils import ServerProcess, wait_for
from tests.inference.test_parity import teacher_forced_logprobs

MAX_NUM_SEQS = 2
BUDGET = 1500  # tokens per request: long enough to be running when the trainer pauses
TEMPERATURE = 0.8


@dataclass
class Trace:
    """What one AReaL client call accumulated, and how its server calls went."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # tokens each answered call added
    before_prefill: int = 0  # calls answered "Abort before prefill"
    stop_reason: str = ""


def areal_agenerate(server: ServerProcess, input_ids: list[int], paused: threading.Event) -> Trace:
    """`RemoteSGLangEngine.agenerate`'s loop (n_samples 1, one server), synchronously."""
    body = areal_generate_body(input_ids, BUDGET, TEMPERATURE, ignore_eos=True)
    trace, stop_reason = Trace(), None
    while stop_reason not in ("stop", "length") and len(trace.tokens) < BUDGET:
        deadline = time.monotonic() + 120
        while paused.is_set():  # AReaL: the workflow executor's pause, polled every 0.5 s
            assert time.monotonic() < deadline, "the trainer never resumed"
            time.sleep(0.05)
        meta = server.ok("/generate", body, timeout=120)["meta_info"]
        finish = meta["finish_reason"]
        stop_reason = finish["type"]
        if stop_reason == "abort" and finish.get("message", "").startswith("Abort before prefill"):
            trace.before_prefill += 1
            continue
        out = [x[1] for x in meta["output_token_logprobs"]]
        trace.tokens += out
        trace.logprobs += [x[0] for x in meta["output_token_logprobs"]]
        trace.chunks.append(len(out))
        body["input_ids"] += out
        body["sampling_params"]["max_new_tokens"] -= len(out)
    trace.stop_reason = "length" if stop_reason == "abort" else stop_reason
    return trace


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    weights = tmp_path_factory.mktemp("areal-weights")
    srv = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("serve"), "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--kv-cache-tokens", "8192", "--block-size", "8", "--weight-sync-timeout", "30",
                        "--weights-dir", str(weights))
    srv.weights = weights
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def worst_error(model, prompt: list[int], tokens: list[int], logprobs: list[float], segment: slice) -> float:
    want = teacher_forced_logprobs(model, prompt, tokens, TEMPERATURE)[segment]
    return (torch.tensor(logprobs[segment]) - want).abs().max().item()


def test_areal_run_replayed(server, qwen3_dir):
    stats = lambda: server.ok("/get_server_info", method="GET")["engine_stats"]  # noqa: E731
    disk_model = make_model_dir(server.weights, "qwen3", seed=3)
    group_model = make_model_dir(server.weights / "group", "qwen3", seed=4)
    asked = prompts([7, 9, 11], seed=21)
    paused = threading.Event()

    # -- rollouts, paused by a disk update: two running, one queued -----------------------------
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(areal_agenerate, server, p, paused) for p in asked[:MAX_NUM_SEQS]]
        wait_for(lambda: stats()["running"] == MAX_NUM_SEQS)
        queued = pool.submit(areal_agenerate, server, asked[2], paused)
        wait_for(lambda: stats()["waiting"] == 1)
        paused.set()  # AReaL pauses its executor, then each server
        assert server.ok("/pause_generation", {})["success"] is True
        update = server.ok("/update_weights_from_disk", {"model_path": str(disk_model), "abort_all_requests": True})
        assert update["success"] is True, update
        assert server.ok("/continue_generation", {})["success"] is True
        paused.clear()
        traces = [f.result(300) for f in running] + [queued.result(300)]

    old, new = load_model(qwen3_dir), load_model(disk_model)
    assert all(len(t.tokens) == BUDGET and t.stop_reason == "length" for t in traces)
    for prompt, trace in zip(asked[:MAX_NUM_SEQS], traces[:MAX_NUM_SEQS], strict=True):  # aborted mid-decode, then resumed
        first = trace.chunks[0]
        assert 0 < first < BUDGET and trace.before_prefill == 0, trace.chunks
        errors = (worst_error(old, prompt, trace.tokens, trace.logprobs, slice(0, first)),
                  worst_error(new, prompt, trace.tokens, trace.logprobs, slice(first, BUDGET)))
        print(f"running: {first} tokens on the old weights, {BUDGET - first} on the new; errors {errors}")
        assert max(errors) <= 1e-5
    q = traces[2]
    assert q.before_prefill >= 1 and q.chunks == [BUDGET], (q.before_prefill, q.chunks)
    assert worst_error(new, asked[2], q.tokens, q.logprobs, slice(0, BUDGET)) <= 1e-5

    # -- the weight-update group, two partial buckets --------------------------------------------
    tensors = list(iter_hf_tensors(group_model))
    halves = (tensors[: len(tensors) // 2], tensors[len(tensors) // 2:])
    with areal_group_update(server) as send:
        for bucket in halves:
            send(bucket)
    served = server.ok("/get_weights_checksum", {})["checksums"]
    assert served == {n: tensor_checksum(t.contiguous()) for n, t in tensors}

    # -- compute_logp: prefill-only scoring on the final weights -----------------------------------
    final = load_model(group_model)
    sequence = asked[0] + traces[0].tokens[:64]
    meta = server.ok("/generate", {"input_ids": sequence, "return_logprob": True, "logprob_start_len": 0,
                                   "sampling_params": {"max_new_tokens": 0, "temperature": TEMPERATURE}})["meta_info"]
    scored = meta["input_token_logprobs"][-64:]
    assert [t for _, t, *_ in scored] == traces[0].tokens[:64]
    want = teacher_forced_logprobs(final, asked[0], traces[0].tokens[:64], TEMPERATURE)
    error = (torch.tensor([lp for lp, *_ in scored]) - want).abs().max().item()
    print(f"compute_logp on the group's weights: max error {error:.2e}")
    assert error <= 1e-5
