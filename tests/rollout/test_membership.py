"""The membership state machine (`tandem.rollout.membership`) with an injected clock: every
transition of the table in its docstring, generations, the cooldown of additions, watchers."""

from __future__ import annotations

import itertools
import threading

import pytest

from tandem.rollout.membership import Membership, MembershipConfig, MemberState

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def make(clock, *addresses, threshold=3, cooldown=30.0) -> Membership:
    return Membership(addresses or (A, B), MembershipConfig(threshold, cooldown), clock=clock)


def state(m: Membership, address: str) -> MemberState:
    return m.record(address).state


def test_listed_servers_start_healthy_members_and_routable(clock):
    m = make(clock, "127.0.0.1:1", B)  # addresses are normalized
    assert m.routable() == [A, B]
    topo = m.topology()
    assert topo.members == (A, B) and topo.warming == () and topo.generation == 0 and topo.elastic


def test_failed_probes_make_suspect_then_evicted(clock):
    m = make(clock)
    m.probe_failed(A, "no answer")
    assert state(m, A) is MemberState.SUSPECT and m.routable() == [B]
    assert m.topology().members == (A, B)  # a suspect is still updated
    assert m.generation == 0
    m.probe_failed(A, "no answer")
    assert state(m, A) is MemberState.SUSPECT
    m.probe_failed(A, "no answer again")
    assert state(m, A) is MemberState.EVICTED and m.evicted_total == 1
    assert "3 probes failed in a row" in m.record(A).last_error and "no answer again" in m.record(A).last_error
    assert m.topology().members == (B,) and m.generation == 1


def test_a_success_resets_the_count_and_a_suspect_recovers_at_the_current_version(clock):
    m = make(clock)
    m.probe_failed(A, "x")
    m.probe_failed(A, "x")
    m.probe_ok(A, 0)
    assert state(m, A) is MemberState.HEALTHY and m.record(A).failures == 0
    m.probe_failed(A, "x")
    m.probe_ok(A, None)  # a server that does not say its version: trusted
    assert state(m, A) is MemberState.HEALTHY


def test_a_suspect_answering_with_other_weights_is_evicted(clock):
    m = make(clock)
    m.set_version(4)
    m.probe_failed(A, "x")
    m.probe_ok(A, 3)
    assert state(m, A) is MemberState.EVICTED
    assert "answered again at version 3 while the fleet is at 4" in m.record(A).last_error


def test_a_revived_listed_server_rejoins_through_warming_never_straight_to_healthy(clock):
    m = make(clock, threshold=1)
    m.probe_failed(A, "x")
    assert state(m, A) is MemberState.EVICTED and A in m.probe_targets()  # listed: still probed
    m.probe_ok(A, 0)
    assert state(m, A) is MemberState.JOINING
    m.probe_ok(A, 0)
    assert state(m, A) is MemberState.WARMING and A not in m.routable() and A not in m.topology().members


def test_an_answer_to_a_probe_sent_before_the_eviction_revives_no_one(clock):
    """The answer to a probe sent while the server was up, read after the launcher evicted it (its
    process exited; seen as `tandem fleet` listing a killed server as joining with a second suite
    beside it), says nothing of the server since the eviction."""
    m = make(clock)
    sent = m.now()
    clock.now += 0.5
    m.evict(A, "the process exited (killed by SIGKILL)")
    m.probe_ok(A, 0, sent_at=sent)
    assert state(m, A) is MemberState.EVICTED and m.record(A).last_error == "the process exited (killed by SIGKILL)"
    clock.now += 0.5
    m.probe_ok(A, 0, sent_at=m.now())  # a probe sent after it: the listed server is back
    assert state(m, A) is MemberState.JOINING


def test_a_joined_server_that_is_evicted_is_not_probed_again(clock):
    m = make(clock)
    m.register(C, pid=77)
    assert state(m, C) is MemberState.JOINING and m.record(C).pid == 77
    m.probe_failed(C, "loading")  # joining servers may still be loading: no eviction
    m.probe_failed(C, "loading")
    m.probe_failed(C, "loading")
    assert state(m, C) is MemberState.JOINING
    m.probe_ok(C, 0)
    assert state(m, C) is MemberState.WARMING
    for _ in range(3):
        m.probe_failed(C, "gone")
    assert state(m, C) is MemberState.EVICTED and C not in m.probe_targets()
    assert m.register(C).state is MemberState.JOINING  # it comes back only by joining again


def test_register_is_idempotent_for_a_live_server(clock):
    m = make(clock)
    assert m.register(A, pid=5).state is MemberState.HEALTHY and m.record(A).pid == 5


def test_additions_wait_the_cooldown_so_a_burst_costs_one_rebuild(clock):
    m = make(clock, cooldown=30.0)
    for i, address in enumerate(("http://127.0.0.1:11", "http://127.0.0.1:12", "http://127.0.0.1:13")):
        clock.now += 5 * i
        m.register(address)
        m.probe_ok(address, 0)
    assert m.topology().warming == ()
    clock.now = 1000.0 + 29.9
    assert m.topology().warming == ()
    clock.now = 1000.0 + 30.0
    warming = m.topology().warming
    assert len(warming) == 3
    generation = m.generation
    assert m.admit(warming, version=0) == list(warming)
    assert m.generation == generation + 1 and m.joined_total == 3
    assert all(a in m.routable() for a in warming)


def test_a_server_flapping_faster_than_the_cooldown_is_never_readmitted(clock):
    m = make(clock, A, B, threshold=1, cooldown=30.0)
    changes = []
    for _ in range(50):  # dies and comes back every 4 s for 200 s
        generation = m.generation
        m.probe_failed(A, "flap")
        clock.now += 2
        m.probe_ok(A, None)
        m.probe_ok(A, None)
        if m.topology().warming:
            m.admit(m.topology().warming, 0)
        if m.generation != generation:
            changes.append(clock.now)
        clock.now += 2
    assert len(changes) == 1  # its first removal; it never stayed up long enough to come back


def test_a_server_that_dies_after_each_admission_waits_longer_each_time(clock):
    """Up ~31 s, down 1 s, for 20 minutes: additions come at least a cooldown apart and thin out
    (1, 2, 4, 8 cooldowns after each eviction), so membership changes stay well under one per
    cooldown window over the run."""
    m = make(clock, A, B, threshold=1, cooldown=30.0)
    admissions, changes = [], []  # times of admissions; times of every change of the members
    end = clock.now + 1200
    while clock.now < end:
        generation = m.generation
        m.probe_failed(A, "crash")
        if m.generation != generation:
            changes.append(clock.now)
        clock.now += 1
        m.probe_ok(A, None)
        m.probe_ok(A, None)
        for _ in range(31):  # up: probed every second, admitted when due
            clock.now += 1
            m.probe_ok(A, None)
            if m.topology().warming:
                m.admit(m.topology().warming, 0)
                admissions.append(clock.now)
                changes.append(clock.now)
    gaps = [b - a for a, b in itertools.pairwise(admissions)]
    assert admissions and all(g >= 30.0 for g in gaps), admissions
    assert gaps == sorted(gaps)  # the waits grow
    # An addition comes a cooldown after any change; a removal cannot wait (the server is dead), so
    # one admission followed at once by a crash is the most a window can hold: two changes.
    per_window = max(sum(t <= c < t + 30.0 for c in changes) for t in changes)
    print(f"\n{len(changes)} membership changes in 1200 s, at most {per_window} in a 30 s window")
    assert per_window <= 2 and len(changes) <= 1200 / 30 / 2, changes


def test_admit_moves_only_warming_servers(clock):
    m = make(clock)
    m.register(C)
    assert m.admit([C, A], 3) == []  # C is joining (not warmed), A is healthy already
    assert m.joined_total == 0


def test_watchers_hear_the_routable_set_when_it_changes(clock):
    m = make(clock, threshold=1)
    heard = []
    m.watch(heard.append)
    m.probe_ok(A, 0)  # no change: not called
    m.probe_failed(A, "x")
    m.register(C)
    m.probe_ok(C, 0)
    clock.now += 60
    m.admit(m.topology().warming, 0)
    assert heard == [[A, B], [B], [B, C]]


def test_a_probe_that_changes_no_state_does_not_scan_the_fleet(clock, monkeypatch):
    """Each probe's report rebuilt the healthy list (a scan of every record): O(N) per probe,
    O(N^2) per health round, 1 s a round at 1,000 servers' worth of profile. Only a change in or
    out of HEALTHY may cost a scan; watchers still hear every change of the list."""
    addresses = [f"http://10.0.0.{i}:8000" for i in range(1, 201)]
    m = Membership(addresses, MembershipConfig(3, 30.0), clock=clock)
    heard = []
    m.watch(heard.append)
    scans = []
    real = m._healthy
    monkeypatch.setattr(m, "_healthy", lambda: scans.append(1) or real())
    for _ in range(3):  # three health rounds, every server well
        for a in addresses:
            m.probe_ok(a, 0)
    assert scans == [] and len(heard) == 1
    m.probe_failed(addresses[5], "x")  # healthy -> suspect: the list changes
    assert len(scans) == 1 and heard[-1] == addresses[:5] + addresses[6:]
    m.probe_failed(addresses[5], "x")  # still suspect: no scan
    assert len(scans) == 1
    m.probe_ok(addresses[5], 0)  # back to healthy
    assert len(scans) == 2 and heard[-1] == addresses and len(heard) == 3


def test_eviction_watchers_hear_each_eviction_once_after_the_routable_set(clock):
    """The pool gives up the calls in flight to an evicted server from this hook: it must fire for
    a suspect evicted by its probes (the routable set does not change then), for `evict`, and for
    a suspect answering with stale weights, once each, after the routable watchers."""
    m = make(clock, A, B, C, threshold=2)
    heard: list = []
    m.watch(lambda routable: heard.append(("routable", routable)))
    m.watch_evictions(lambda address: heard.append(("evicted", address)))
    heard.clear()
    m.probe_failed(A, "x")  # suspect: out of routing, not evicted
    m.probe_failed(A, "x")  # evicted: the routable set stays [B, C]
    m.evict(B, "commit failed")
    m.evict(B, "again")  # out already: no second call
    m.probe_failed(C, "x")
    m.probe_ok(C, 7)  # a suspect answering at another version is evicted
    assert heard == [("routable", [B, C]), ("evicted", A), ("routable", [C]), ("evicted", B),
                     ("routable", []), ("evicted", C)]


def test_evict_and_set_version(clock):
    m = make(clock)
    m.set_version(2)
    assert [r.version for r in m.snapshot()] == [2, 2] and m.current_version == 2
    assert m.evict(A, "commit failed") and not m.evict(A, "again") and not m.evict(C, "unknown")
    assert m.evicted_total == 1 and m.record(A).last_error == "commit failed"


def test_concurrent_reports_keep_the_invariants(clock):
    m = make(clock, A, B, C, threshold=2)
    seen: list[list[str]] = []
    m.watch(seen.append)

    def hammer(address: str) -> None:
        for i in range(2000):
            if i % 3 == 0:
                m.probe_failed(address, "x")
            else:
                m.probe_ok(address, None)

    threads = [threading.Thread(target=hammer, args=(a,)) for a in (A, B, C)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = m.snapshot()
    assert len(records) == 3
    members = set(m.topology().members)
    assert members == {r.address for r in records if r.state in (MemberState.HEALTHY, MemberState.SUSPECT)}
    assert set(m.routable()) == {r.address for r in records if r.state is MemberState.HEALTHY}
    assert m.evicted_total >= 0 and all(set(s) <= {A, B, C} for s in seen)


def test_a_server_registered_as_listed_is_probed_while_evicted(clock):
    """A replacement the run launched (`register(..., listed=True)`) comes back like the servers it
    started with; joining again as an outside server does not unlist a listed one."""
    m = make(clock, threshold=1)
    m.register(C, pid=7, listed=True)
    m.probe_ok(C, 0)
    m.probe_failed(C, "no answer")
    assert state(m, C) is MemberState.EVICTED and C in m.probe_targets()
    m.probe_ok(C, 0)
    assert state(m, C) is MemberState.JOINING
    m.register(A)
    m.probe_failed(A, "no answer")
    assert state(m, A) is MemberState.EVICTED and A in m.probe_targets()
