"""The `rollout.*` keys of the controller, its inference client, its executor and its fleet, each
loaded through the run config and shown changing what a `RolloutController` does against fake
servers over real HTTP on 127.0.0.1: how many episodes may start, how long a request, a call, a
control call or a health probe may take, where the controller listens, what a request carries.
Where the effect itself is tested on the component (test_executor.py, test_membership.py,
test_elastic_rollout.py), the wiring test here shows the key reaches that component."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator

import pytest

from tandem.fleet import ops
from tandem.fleet.interface import call
from tandem.fleet.results import FleetError
from tandem.rl.config import load_run_config
from tandem.rollout import GenerationDeadlineError, GenerationParams, ModelRequest, RolloutController
from tandem.rollout.config import RolloutConfig
from tandem.rollout.errors import RolloutError, ServerRequestError

pytestmark = pytest.mark.timeout(90)


def rollout_config(servers: list[str], *overrides: str) -> RolloutConfig:
    """The `rollout` section as `tandem train` loads it, with `servers` listed."""
    listed = ", ".join(f"'{s}'" for s in servers)
    return load_run_config(None, [f"rollout.servers=[{listed}]", *overrides]).rollout


@pytest.fixture
def controller() -> Iterator:
    made: list[RolloutController] = []

    def make(config: RolloutConfig, start: bool = True) -> RolloutController:
        ctl = RolloutController(config, start=start)
        made.append(ctl)
        return ctl

    yield make
    for ctl in made:
        ctl.shutdown()


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """An address that accepts connections and never answers (a hung server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def generate(ctl: RolloutController, *rids: str):
    """Generate one request per rid at once through the controller's client."""
    async def main():
        try:
            reqs = [ModelRequest([11, 12, 13], GenerationParams(max_new_tokens=3), rid=rid) for rid in rids]
            return await asyncio.gather(*(ctl.client.agenerate(r) for r in reqs), return_exceptions=True)
        finally:
            await ctl.client.aclose()

    return asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize(("override", "capacity"), [
    pytest.param(None, 16, id="defaults"),  # min(64 running, (1 + 0 + 1) * 8 accepted)
    pytest.param("rollout.max_concurrent_rollouts=5", 5, id="rollout.max_concurrent_rollouts"),
    pytest.param("rollout.consumer_batch_size=3", 6, id="rollout.consumer_batch_size"),
    pytest.param("rollout.max_head_offpolicyness=0", 8, id="rollout.max_head_offpolicyness"),
])
def test_staleness_keys_bound_the_episodes_that_may_start(make_server, controller, override, capacity):
    """Catches `rollout.max_concurrent_rollouts`, `consumer_batch_size` or `max_head_offpolicyness`
    not reaching the executor's staleness manager: at version 0 the number of episodes the
    controller may start follows the formula of each (tests/rollout/test_staleness.py)."""
    ctl = controller(rollout_config([make_server().address], *([override] if override else [])), start=False)
    assert ctl.executor.staleness.capacity(0) == capacity


@pytest.mark.parametrize(("override", "where", "value"), [
    pytest.param("rollout.order=completion", lambda c: c.executor.config.order, "completion", id="rollout.order"),
    pytest.param("rollout.dump_dir={tmp}/dumps", lambda c: c.executor.config.dump_dir, "{tmp}/dumps",
                 id="rollout.dump_dir"),
    pytest.param("rollout.max_consecutive_failures=5", lambda c: c.executor.config.max_consecutive_failures, 5,
                 id="rollout.max_consecutive_failures"),
    pytest.param("rollout.min_servers_grace_s=7.5", lambda c: c.fleet.min_servers_grace_s, 7.5,
                 id="rollout.min_servers_grace_s"),
    pytest.param("rollout.topology_cooldown_s=4.0", lambda c: c.fleet.membership.config.topology_cooldown_s, 4.0,
                 id="rollout.topology_cooldown_s"),
    pytest.param("rollout.health.failure_threshold=9", lambda c: c.fleet.membership.config.failure_threshold, 9,
                 id="rollout.health.failure_threshold"),
])
def test_keys_reach_the_executor_and_the_fleet(make_server, controller, override, where, value, tmp_path):
    """Catches a key the controller stops handing to the component that acts on it; what the
    component then does is tested there: the hand-out order (test_executor.py::test_hand_out_order),
    trajectory dumps (test_rollout_batch_and_dumps), error storms (test_error_storm_ends_rollouts_with_the_first_error),
    the too-small fleet's grace (test_elastic_rollout.py), the cooldown and the eviction threshold
    (test_membership.py)."""
    if isinstance(value, str):
        override, value = override.format(tmp=tmp_path), value.format(tmp=tmp_path)
    default = where(controller(rollout_config([make_server().address]), start=False))
    configured = where(controller(rollout_config([make_server().address], override), start=False))
    assert configured == value != default


def test_request_deadline_s_ends_a_hung_request(make_server, controller):
    """Catches `rollout.request_deadline_s` not reaching the inference client: a request to a
    server that never answers fails when the deadline passes, not after the default 600 s."""
    ctl = controller(rollout_config([make_server(hang=True).address], "rollout.request_deadline_s=0.5"), start=False)
    start = time.monotonic()
    (result,) = generate(ctl, "hung")
    assert isinstance(result, GenerationDeadlineError) and result.deadline_s == 0.5
    assert time.monotonic() - start < 5


def test_call_timeout_s_moves_a_hung_call_to_another_server(make_server, controller):
    """Catches `rollout.call_timeout_s` not reaching the client: with it, a call hung on one server
    times out and the request moves to the other server; without it, the call holds the request
    until the deadline."""
    servers = [make_server(hang=True).address, make_server().address]
    with_timeout = controller(rollout_config(servers, "rollout.call_timeout_s=0.3", "rollout.request_deadline_s=20"),
                              start=False)
    assert all(isinstance(r, object) and not isinstance(r, BaseException) for r in generate(with_timeout, "a", "b"))
    without = controller(rollout_config(servers, "rollout.request_deadline_s=1.5"), start=False)
    results = generate(without, "c", "d")
    assert sum(isinstance(r, GenerationDeadlineError) for r in results) == 1, results


def test_api_key_is_sent_with_every_request(make_server, controller):
    """Catches `rollout.api_key` not being sent: a server that requires the key answers 401
    without it."""
    server = make_server(api_key="run-key")
    (ok,) = generate(controller(rollout_config([server.address], "rollout.api_key=run-key"), start=False), "ok")
    assert not isinstance(ok, BaseException) and len(ok.output_ids) == 3
    (refused,) = generate(controller(rollout_config([server.address]), start=False), "no-key")
    assert isinstance(refused, ServerRequestError) and refused.status == 401


def test_model_names_the_served_model_to_vllm(make_server, controller):
    """Catches `rollout.model` not reaching vLLM requests: a vLLM server serving another model
    name refuses the request (404), the right name is served."""
    server = make_server(served_model_name="policy")
    vllm = ["rollout.backend=vllm:d1"]
    (ok,) = generate(controller(rollout_config([server.address], *vllm, "rollout.model=policy"), start=False), "a")
    assert not isinstance(ok, BaseException), ok
    (refused,) = generate(controller(rollout_config([server.address], *vllm, "rollout.model=other"), start=False), "b")
    assert isinstance(refused, ServerRequestError) and refused.status == 404


def test_worker_extension_decides_how_vllm_servers_take_updates(make_server, controller):
    """Catches `rollout.vllm.worker_extension` not reaching the vLLM adapter: with the extension
    updates are staged and committed as a whole, without it each is applied on arrival."""
    def staged(*overrides: str) -> bool:
        ctl = controller(rollout_config([make_server().address], "rollout.backend=vllm:d1", *overrides), start=False)
        return ctl.adapter.capabilities.staged_commit

    assert staged() is True
    assert staged("rollout.vllm.worker_extension=false", "train.weight_sync=disk") is False


def test_callback_host_and_port_are_where_the_controller_listens(make_server, controller):
    """Catches `rollout.callback_host` or `rollout.callback_port` not reaching the callback server."""
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    ctl = controller(rollout_config([make_server().address], "rollout.callback_host=127.0.0.2",
                                    f"rollout.callback_port={port}"))
    assert ctl.callback_address() == f"http://127.0.0.2:{port}"
    with socket.create_connection(("127.0.0.2", port), timeout=5):
        pass
    assert controller(rollout_config([make_server().address])).callback_address().startswith("http://127.0.0.1:")


def test_control_timeout_s_bounds_a_fleet_call(controller):
    """Catches `rollout.control_timeout_s` not reaching the fleet: pausing a server that never
    answers fails after the configured seconds (not the default 30), and trainer ranks get it
    (plus their margin) in their callback."""
    with silent_server() as address:
        ctl = controller(rollout_config([address], "rollout.control_timeout_s=0.5"))
        assert ctl.callback().control_timeout_s == 30.5
        start = time.monotonic()
        with pytest.raises(FleetError) as info:
            call(ctl, ops.PAUSE, ops.PauseGeneration())
        took = time.monotonic() - start
    print(f"\npause of a hung server failed after {took:.2f}s: {info.value}")
    assert 0.4 < took < 5


def test_worker_start_timeout_s_bounds_the_workers_start(make_server):
    """Catches `rollout.worker_start_timeout_s` not reaching the worker pool: rollout workers that
    cannot start within the configured seconds fail the controller's start, naming the limit."""
    config = rollout_config([make_server().address], "rollout.workers=1", "rollout.worker_start_timeout_s=0.01")
    with pytest.raises(RolloutError, match=r"rollout worker 0 \(pid \d+\) .* within 0.01s"):
        RolloutController(config)


def test_health_interval_s_sets_how_often_servers_are_probed(make_server, controller):
    """Catches `rollout.health.interval_s` not reaching the health monitor: over one second a
    server is probed about every 0.05 s, or once at a 30 s interval."""
    fast, slow = make_server(), make_server()
    controller(rollout_config([fast.address], "rollout.health.interval_s=0.05"))
    controller(rollout_config([slow.address], "rollout.health.interval_s=30"))
    time.sleep(1.0)
    print(f"\nprobes in 1 s: interval 0.05 s -> {fast.health_probes}, 30 s -> {slow.health_probes}")
    assert fast.health_probes >= 5 and slow.health_probes == 1


def test_health_timeout_s_and_failure_threshold_evict_a_hung_server(make_server, controller):
    """Catches `rollout.health.timeout_s` or `failure_threshold` not reaching the monitor: a server
    that never answers fails each probe after the configured timeout and is evicted after the
    configured number of failures in a row (the error says both)."""
    with silent_server() as address:
        ctl = controller(rollout_config([make_server().address, address], "rollout.health.interval_s=0.1",
                                        "rollout.health.timeout_s=0.2", "rollout.health.failure_threshold=2"))
        deadline = time.monotonic() + 20
        while ctl.fleet.membership.record(address).state.name != "EVICTED":
            assert time.monotonic() < deadline, ctl.fleet.membership.record(address)
            time.sleep(0.05)
    error = ctl.fleet.membership.record(address).last_error
    assert "2 probes failed in a row" in error and "no answer within 0.2s" in error, error


def test_min_servers_holds_rollouts_back_until_enough_are_healthy(make_server, controller):
    """Catches `rollout.min_servers` not reaching the fleet: with one of two servers gone the fleet
    stays ready at min_servers=1 and holds rollouts back at min_servers=2."""
    for min_servers in (1, 2):
        gone = make_server()
        ctl = controller(rollout_config([make_server().address, gone.address], f"rollout.min_servers={min_servers}",
                                        "rollout.health.interval_s=0.05", "rollout.health.timeout_s=0.5",
                                        "rollout.health.failure_threshold=1"))
        assert ctl.fleet.ready
        gone.stop()
        deadline = time.monotonic() + 20
        while ctl.fleet.membership.record(gone.address).state.name != "EVICTED" or (min_servers == 2 and ctl.fleet.ready):
            assert time.monotonic() < deadline, (min_servers, ctl.fleet.membership.record(gone.address), ctl.fleet.ready)
            time.sleep(0.05)
        time.sleep(0.3)  # a few more health rounds
        assert ctl.fleet.ready is (min_servers == 1), min_servers
