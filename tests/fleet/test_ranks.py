"""Transfer-group ranks for fleets whose servers span several devices (`tandem.fleet.ranks`): the
trainer is rank 0, then every device of every server in member order; the world counts them all.
The adapters' join calls, a fleet's topology and an elastic membership all place servers through
the one function, checked here against ranks counted out by hand and against each server kind's
own rule for its workers (SGLang's ModelRunner and Tandem's vLLM worker extension both join as
`rank_offset` + the worker's rank in the server)."""

from __future__ import annotations

import itertools
import random

import pytest

from tandem.fleet import ops
from tandem.fleet.adapters import UnsupportedOperation, adapter_for
from tandem.fleet.http import HttpFleet
from tandem.fleet.interface import Topology
from tandem.fleet.ranks import group_ranks
from tandem.fleet.view import FleetView
from tandem.rollout.membership import Membership, MembershipConfig

A, B, C, D = (f"http://127.0.0.1:{port}" for port in (9001, 9002, 9003, 9004))


def counted(devices: list[int]) -> list[list[int]]:
    """The group ranks of each server's devices, counted out one device at a time."""
    out, next_rank = [], 1  # rank 0 is the trainer's
    for n in devices:
        out.append(list(range(next_rank, next_rank + n)))
        next_rank += n
    return out


def test_a_mixed_fleet_of_one_two_and_four_devices():
    ranks = group_ranks([1, 2, 4])
    assert ranks.world_size == 8  # the trainer + 1 + 2 + 4
    assert ranks.offsets == (1, 2, 4)
    assert [list(ranks.ranks_of(i)) for i in range(3)] == [[1], [2, 3], [4, 5, 6, 7]]
    other_order = group_ranks([4, 1, 2])
    assert other_order.offsets == (1, 5, 6) and other_order.world_size == 8


def test_every_device_gets_one_rank_and_the_world_counts_them_all():
    rng = random.Random(0)
    for _ in range(200):
        devices = [rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(0, 6))]
        ranks = group_ranks(devices)
        assert [list(ranks.ranks_of(i)) for i in range(len(devices))] == counted(devices)
        every = [0, *itertools.chain.from_iterable(ranks.ranks_of(i) for i in range(len(devices)))]
        assert every == list(range(ranks.world_size))  # no rank twice, none missing


@pytest.mark.parametrize("devices", [[0], [2, -1], [1, True]])
def test_a_server_occupies_at_least_one_rank(devices):
    with pytest.raises(ValueError, match="at least one rank"):
        group_ranks(devices)


@pytest.mark.parametrize(("kind", "extension"), [("sglang", False), ("vllm", True)])
def test_each_workers_rank_by_the_servers_own_rule(kind, extension):
    """Each adapter's join call for servers of 1, 2 and 4 devices; the servers' workers then join
    at rank_offset + their rank in the server (SGLang: `rank_offset + self.tp_rank`; Tandem's vLLM
    extension: `rank_offset + self.rank`), which covers 1 .. world - 1 once each."""
    adapter = adapter_for(kind, vllm_extension=extension)
    join = ops.JoinGroup("127.0.0.1", 29501, "g", "gloo", (1, 2, 4), 30.0)
    joined = []
    for index, devices in enumerate(join.devices):
        body = adapter.request(ops.JOIN_GROUP, join, index).body
        args = body["kwargs"] if kind == "vllm" else body
        assert args["world_size"] == 8
        if kind == "vllm":
            assert args["devices"] == devices  # each worker checks its server has as many
        joined += [args["rank_offset"] + local for local in range(devices)]
    assert sorted(joined) == list(range(1, 8))


def test_a_join_sent_to_more_servers_than_it_counts_is_refused():
    join = ops.JoinGroup("127.0.0.1", 29501, "g", "gloo", (2, 2), 30.0)
    with pytest.raises(ValueError, match="devices of 2 server"):
        adapter_for("sglang").request(ops.JOIN_GROUP, join, 2)


def test_tandem_serve_takes_one_rank():
    join = ops.JoinGroup("127.0.0.1", 29501, "g", "gloo", (1, 2), 30.0)
    assert adapter_for("tandem").request(ops.JOIN_GROUP, join, 0).body["rank_offset"] == 1
    with pytest.raises(UnsupportedOperation, match="one device"):
        adapter_for("tandem").request(ops.JOIN_GROUP, join, 1)


def test_a_fixed_fleet_and_its_views_count_every_device():
    with HttpFleet([A, B, C], devices={B: 2, C: 4}) as fleet:
        topology = fleet.topology()
        assert topology.ranks(topology.members).offsets == (1, 2, 4)
        assert fleet.world_size == 7  # the ranks the servers occupy
        view = FleetView(fleet, [C, A], devices=topology.devices)
        assert view.world_size == 5 and view.topology().ranks([C, A]).offsets == (1, 5)
        view.drop(C, "failed")
        assert view.world_size == 1 and view.topology().devices == {}
    with HttpFleet([A, B], devices=2) as fleet:
        assert fleet.world_size == 4 and fleet.topology().ranks([A, B]).offsets == (1, 3)


def test_topology_travels_with_its_devices():
    from tandem.fleet.wire import from_json, to_json

    topology = Topology(3, (A, B), (C,), elastic=True, devices={B: 2, C: 4})
    assert from_json(Topology, to_json(topology)) == topology
    assert from_json(Topology, {"generation": 0, "members": [A]}).devices_of(A) == 1  # older controllers


def test_an_elastic_fleet_of_mixed_sizes_renumbers_as_servers_come_and_go():
    """Listed servers of 2 devices (the allocation's), joiners of 4 and 1; an eviction moves the
    later servers down, a re-join after an eviction may bring another size."""
    now = [0.0]
    m = Membership([A, B], MembershipConfig(failure_threshold=1, topology_cooldown_s=0.0), clock=lambda: now[0],
                   devices=2)
    m.register(C, devices=4)
    m.register(D)
    for address in (C, D):
        m.probe_ok(address, None)  # joining -> warming
    topology = m.topology()
    assert topology.members == (A, B) and topology.warming == (C, D)
    assert topology.ranks([*topology.members, *topology.warming]).offsets == (1, 3, 5, 9)
    m.admit([C, D], 0)
    topology = m.topology()
    assert topology.ranks(topology.members).world_size == 1 + 2 + 2 + 4 + 1
    m.evict(B, "gone")
    topology = m.topology()
    assert topology.members == (A, C, D) and topology.ranks(topology.members).offsets == (1, 3, 7)
    m.register(B, devices=1)  # back as a server of one device
    m.probe_ok(B, None)
    assert m.topology().devices_of(B) == 1 and B in m.topology().warming
    with pytest.raises(ValueError, match="at least one device"):
        m.register("http://127.0.0.1:9005", devices=0)


def test_the_allocation_gives_each_starting_server_its_devices():
    from tandem.errors import ConfigError
    from tandem.rl.config import check_weight_sync
    from tandem.rollout import RolloutConfig

    assert RolloutConfig(backend="sglang:d4t2", servers=["h:1"]).devices_per_server == 2
    assert RolloutConfig(backend="vllm:d1t2").devices_per_server == 2
    assert RolloutConfig(backend="tandem:d3").devices_per_server == 1
    check_weight_sync("distributed", RolloutConfig(backend="sglang:d2t2", servers=["h:1"]), "")
    # SGLang places its workers by TP rank alone: pipeline stages would share ranks
    with pytest.raises(ConfigError, match=r"train.weight_sync='distributed'.*pipeline stages.*weight_sync=disk"):
        check_weight_sync("distributed", RolloutConfig(backend="sglang:d1t2p2", servers=["h:1"]), "")
    check_weight_sync("disk", RolloutConfig(backend="sglang:d1t2p2", servers=["h:1"]), "")
    with pytest.raises(ConfigError, match=r"rollout.backend='vllm:d1p2'.*tensor-parallel only.*vllm:d1t2"):
        RolloutConfig(backend="vllm:d1p2").check()
