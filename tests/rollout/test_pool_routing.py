"""`ServerPool.choose` picks from a heap (O(log N) a call, issue 49): under a random sequence of
everything that moves a server's load, health or routability, every choice equals the one the
plain scan over all servers makes (the rule: the healthy routable server outside `exclude` with
the least (outstanding, served, address); the fallbacks when there is none)."""

from __future__ import annotations

import random
from contextlib import ExitStack

from tandem.rollout.pool import ServerPool


def scan_choice(pool: ServerPool, exclude: set[str]) -> str:
    """The rule as a scan over a snapshot: the oracle."""
    routable = [s for s in pool.snapshot() if s.routable]
    candidates = [s for s in routable if s.address not in exclude] or routable
    healthy = [s for s in candidates if s.healthy] or candidates
    return min(healthy, key=lambda s: (s.outstanding, s.served, s.address)).address


def test_heap_choices_equal_the_scans_under_random_churn():
    rng = random.Random(49)
    addresses = [f"http://10.0.0.{i}:8000" for i in range(40)]
    pool = ServerPool(addresses[:30])
    leases: list[ExitStack] = []
    checked = 0
    for step in range(6000):
        op = rng.random()
        if op < 0.35:  # a request starts on the chosen server (a fresh rid: no affinity)
            exclude = set(rng.sample(pool.addresses, k=min(len(pool.addresses), rng.choice([0, 0, 0, 1, 3]))))
            want = scan_choice(pool, exclude)
            assert pool.choose(f"r{step}", exclude) == want, step
            pool.forget(f"r{step}")
            checked += 1
            stack = ExitStack()
            stack.enter_context(pool.lease(want))
            leases.append(stack)
        elif op < 0.65 and leases:  # one ends
            leases.pop(rng.randrange(len(leases))).close()
        elif op < 0.75:
            pool.mark_error(rng.choice(addresses), connection_failed=rng.random() < 0.5)
        elif op < 0.85:
            pool.mark_success(rng.choice(addresses), tokens=rng.randint(0, 9))
        elif op < 0.93:  # the membership moves: some leave routing, some come (back)
            pool.set_routable(rng.sample(addresses, k=rng.randint(1, len(addresses))))
        elif op < 0.97:
            pool.add(rng.choice(addresses))
        else:
            pool.remove(rng.choice(pool.addresses))
            if not pool.addresses:
                pool.set_routable(addresses[:5])
    assert checked > 1500

