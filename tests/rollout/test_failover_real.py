"""The inference client's retries, failover and deadlines against real `tandem serve` processes
killed (SIGKILL) or stopped (SIGSTOP) in the middle of a request (issue 27, item 9).

tests/rollout/test_client.py shows the same behaviours against the fake server, which stays the
place for exact resubmission chains and injected faults; here the failures are real: a process
that dies while it decodes (its connection breaks mid-response), and one that stops answering
while its socket stays open. Every request is greedy, so what the client returns can be compared
token for token with an uninterrupted run on the server that survived.

"Mid-request" is observed, not slept into: the server's `/get_server_info` reports the request
running and its generated-token count growing before the signal is sent. One surviving server is
shared by the module; each test starts its own victim, and every victim is continued (SIGCONT),
killed and reaped at teardown, whatever the test left it in.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from tandem.rollout import (
    ClientConfig,
    GenerationDeadlineError,
    GenerationParams,
    InferenceClient,
    ModelRequest,
    ModelResponse,
    RolloutConfig,
    RolloutController,
)
from tandem.rollout.health import HealthConfig
from tandem.rollout.membership import MemberState
from tests.background import in_thread
from tests.inference.conftest import make_model_dir
from tests.inference.server_utils import ServerProcess, wait_for
from tests.rollout.conftest import run
from tests.rollout.test_client import generate

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

PROMPT = [11, 12, 13, 14, 15]  # under one KV block (16): no prefix-cache hit makes runs differ
LOGPROB_TOL = 1e-4  # a decode step vs a prefill of the same prefix, in other batches: ~1e-6 measured


def greedy(n: int) -> GenerationParams:
    return GenerationParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny qwen3 without its tokenizer: the tests speak token ids, and a server with no
    tokenizer to load never imports transformers (about 2 s of CPU less for each of 4 starts)."""
    model = make_model_dir(tmp_path_factory.mktemp("models"), "qwen3", seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    return model


@pytest.fixture(scope="module")
def _survivor_starting(model_dir, tmp_path_factory):
    """The shared survivor, started but not waited for, so that the first test's victim starts beside it."""
    server = ServerProcess(model_dir, tmp_path_factory.mktemp("survivor"), wait=False)
    yield server
    code = server.stop()
    assert code == 0 or not server.url, server.log.read_text()  # a server that never came up failed a test already


@pytest.fixture
def survivor(_survivor_starting) -> ServerProcess:
    return _survivor_starting if _survivor_starting.url else _survivor_starting.wait_ready(timeout=90)


@pytest.fixture
def victim(model_dir, tmp_path) -> ServerProcess:
    """A server of this test's own, to be killed or stopped; reaped whatever state it was left in."""
    server = ServerProcess(model_dir, tmp_path)
    yield server
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)  # a stopped victim runs again before it is killed
        server.proc.kill()
        server.proc.wait(10)
    server.stop()  # closes the log file


def engine_stats(server: ServerProcess) -> dict:
    info = server.ok("/get_server_info", method="GET", timeout=10)
    return {**info["engine_stats"], "waiting_at_gate": info["waiting_at_gate"]}


def decoding(server: ServerProcess, running: int, past: int, timeout: float = 30) -> dict:
    """Wait until `running` requests are in the engine and it has generated more than `past`
    tokens in all (a count that only grows): the requests are mid-decode."""
    return wait_for(lambda: (s := engine_stats(server))["running"] >= running and s["generated_tokens"] > past and s,
                    timeout=timeout, interval=0.02)


def in_background(client: InferenceClient, req: ModelRequest, timeout: float = 90) -> Future[ModelResponse]:
    """`client.agenerate(req)` on its own event loop in a thread (the test's thread sends signals)."""
    return in_thread(run, generate(client, req), timeout)


def reference(server: ServerProcess, n: int) -> ModelResponse:
    """The uninterrupted greedy run of PROMPT on `server` alone."""
    return run(generate(InferenceClient([server.url]), ModelRequest(PROMPT, greedy(n))), 60)


def assert_same_greedy_run(got: ModelResponse, want: ModelResponse) -> None:
    assert got.finish_reason == want.finish_reason == "length"
    assert got.output_ids == want.output_ids
    assert got.output_versions == want.output_versions
    gap = max(abs(a - b) for a, b in zip(got.output_logprobs, want.output_logprobs, strict=True))
    assert gap < LOGPROB_TOL, gap


def test_sigkill_mid_decode_resubmits_the_partial_to_the_other_server(victim, survivor):
    """The server decoding a request is SIGKILLed (its connection breaks mid-response); the
    request finishes on the other server, continued from its last complete chunk (what a pause's
    abort returned before), and the whole sequence is the greedy run an uninterrupted server gives.

    Catches: a broken connection from a dying server not retried (the request fails), the retry
    sent back to the dead server (its affinity kept), the partial output dropped from the
    resubmission (the survivor starts over: the sequence repeats its start) or sent twice, and
    logprobs or versions out of step with the ids across the seam."""
    n = 400
    client = InferenceClient([victim.url, survivor.url], ClientConfig(backoff_initial_s=0.01, deadline_s=60))
    req = ModelRequest(PROMPT, greedy(n), rid="killed-mid-decode")
    assert client.pool.choose(req.rid, exclude=[survivor.url]) == victim.url  # the rid's affinity: the victim
    survivor_before = engine_stats(survivor)["generated_tokens"]

    fut = in_background(client, req)
    decoding(victim, running=1, past=8)
    victim.ok("/pause_generation", {})  # answers the request `abort` with its partial output ...
    wait_for(lambda: engine_stats(victim)["waiting_at_gate"] == 1)  # ... which comes back, held
    partial_done = engine_stats(victim)["generated_tokens"]
    victim.ok("/continue_generation", {})
    decoding(victim, running=1, past=partial_done + 8)  # the resubmission is mid-decode
    victim.proc.kill()
    killed = time.monotonic()
    resp = fut.result(timeout=90)
    took = time.monotonic() - killed

    assert victim.proc.wait(10) == -signal.SIGKILL
    assert took < 30, took  # the deadline is 60 s: nothing waits, the survivor generates under n tokens
    assert resp.servers == [victim.url, survivor.url]  # the abort's partial, then the rest elsewhere
    assert resp.num_aborts == 1 and resp.num_retries >= 1 and client.resubmitted_total == resp.num_retries
    assert not client.pool.is_healthy(victim.url)
    # The survivor generated only what the partial left: more than 0, fewer than n.
    generated_by_survivor = engine_stats(survivor)["generated_tokens"] - survivor_before
    assert 0 < generated_by_survivor <= n - 8, generated_by_survivor
    assert_same_greedy_run(resp, reference(survivor, n))


def test_sigstop_mid_request_the_call_is_given_up_or_the_deadline_fires(victim, survivor):
    """Three requests decode on a server that is then SIGSTOPped (its connections stay open and
    nothing answers). Each of the client's ways out, in the order they fire:

    - through a `RolloutController` (no call timeout, a 60 s deadline): the health monitor evicts
      the server, the client gives up the call at once and the request finishes on the other
      server, long before its deadline;
    - a bare client with `call_timeout_s` and a second server: the call times out and the request
      finishes there;
    - a bare client with only the stopped server: `GenerationDeadlineError` naming the rid and the
      server, at its deadline, not later.
    The two that moved return the uninterrupted greedy output.

    Catches: a call to an evicted server kept waiting (the request hangs until its deadline and is
    lost although another server is healthy: it did, before `ServerPool.abandon`), a call to a
    silent server never abandoned at `call_timeout_s`, a timed-out server not taken out of routing
    (the retry returns to the stopped server through its rid's affinity and hangs again), a deadline
    error that does not say which server did not answer, or one raised early while time was left."""
    call_timeout, deadline = 4.0, 6.0
    stuck_client = InferenceClient([victim.url])
    stuck = ModelRequest(PROMPT, greedy(2000), rid="stuck-on-stopped", deadline_s=deadline)
    timing_out_client = InferenceClient([victim.url, survivor.url],
                                        ClientConfig(call_timeout_s=call_timeout, backoff_initial_s=0.01, deadline_s=60))
    timing_out = ModelRequest(PROMPT, greedy(200), rid="times-out-on-stopped")
    assert timing_out_client.pool.choose(timing_out.rid, exclude=[survivor.url]) == victim.url
    health = HealthConfig(interval_s=0.5, timeout_s=1.0, failure_threshold=2)
    config = RolloutConfig(servers=[victim.url, survivor.url], request_deadline_s=60, health=health)
    with RolloutController(config) as ctl:
        evicted = ModelRequest(PROMPT, greedy(200), rid="evicted-while-stopped")
        assert ctl.pool.choose(evicted.rid, exclude=[survivor.url]) == victim.url

        started = time.monotonic()
        stuck_fut, timing_out_fut, evicted_fut = (in_background(stuck_client, stuck),
                                                  in_background(timing_out_client, timing_out),
                                                  in_background(ctl.client, evicted))
        decoding(victim, running=3, past=8)
        victim.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert not any(f.done() for f in (stuck_fut, timing_out_fut, evicted_fut))
        assert stopped - started < deadline, "the victim was too slow to reach the requests before the deadline"

        moved_by_eviction = evicted_fut.result(timeout=90)
        took = time.monotonic() - stopped
        assert ctl.fleet.membership.record(victim.url).state is MemberState.EVICTED
    assert took < 30, took  # eviction (about interval x threshold + timeout) and 200 tokens; the deadline is 60
    assert moved_by_eviction.servers == [survivor.url] and moved_by_eviction.num_retries == 1

    moved_by_timeout = timing_out_fut.result(timeout=90)
    assert time.monotonic() - stopped < call_timeout + 30
    assert moved_by_timeout.servers == [survivor.url] and moved_by_timeout.num_retries >= 1
    assert not timing_out_client.pool.is_healthy(victim.url)

    with pytest.raises(GenerationDeadlineError) as info:
        stuck_fut.result(timeout=90)
    failed = time.monotonic() - started
    assert deadline <= failed < deadline + 10, failed
    err = info.value
    assert err.rid == stuck.rid and err.servers == [victim.url] and "TimeoutError" in err.last_error
    assert stuck.rid in str(err) and victim.url in str(err) and f"{deadline:g}s deadline" in str(err)
    assert isinstance(err, TimeoutError)

    assert victim.proc.poll() is None  # only stopped: it comes back at SIGCONT (teardown kills it)
    want = reference(survivor, 200)
    assert_same_greedy_run(moved_by_eviction, want)
    assert_same_greedy_run(moved_by_timeout, want)


def test_only_server_sigkilled_mid_decode_misses_the_deadline_naming_it(victim):
    """The controller's only server is SIGKILLed mid-decode: the health monitor evicts it, the
    request waits for a server inside its deadline (`rollout.request_deadline_s`) and then raises
    `GenerationDeadlineError` naming the rid and the dead server, at the deadline, without hanging.

    Catches: a request that hangs once no server is left (no deadline on the wait for a routable
    server or on the retries against a refused connection), one that gives up before its deadline
    (a dead server's refusals treated as final), and an error that does not name the server."""
    deadline = 6.0
    config = RolloutConfig(servers=[victim.url], request_deadline_s=deadline,
                           health=HealthConfig(interval_s=0.5, timeout_s=0.5, failure_threshold=2))
    with RolloutController(config) as ctl:
        req = ModelRequest(PROMPT, greedy(2000), rid="only-server-killed")
        started = time.monotonic()
        fut = in_background(ctl.client, req)
        decoding(victim, running=1, past=8)
        victim.proc.kill()
        assert victim.proc.wait(10) == -signal.SIGKILL
        assert not fut.done()
        with pytest.raises(GenerationDeadlineError) as info:
            fut.result(timeout=90)
        failed = time.monotonic() - started
        assert ctl.fleet.membership.record(victim.url).state is MemberState.EVICTED
    assert deadline <= failed < deadline + 10, failed
    err = info.value
    assert err.rid == req.rid and err.servers == [victim.url] and err.last_error
    assert req.rid in str(err) and victim.url in str(err) and f"{deadline:g}s deadline" in str(err)
