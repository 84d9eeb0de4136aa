"""StalenessManager: the capacity formula's acceptance cases and thread safety."""

from __future__ import annotations

import threading

import pytest

from tandem.rollout import StalenessManager

pytestmark = pytest.mark.timeout(30)


def test_fresh_v0_capped_by_concurrency():
    assert StalenessManager(10, 4, 2).capacity(0) == 10


def test_fresh_v0_capped_by_staleness():
    assert StalenessManager(100, 4, 2).capacity(0) == 12  # (2 + 0 + 1) * 4


def test_later_version_grows_budget():
    assert StalenessManager(1000, 4, 2).capacity(5) == 32  # (2 + 5 + 1) * 4


def test_accepted_consume_budget():
    m = StalenessManager(20, 4, 2)
    for _ in range(5):
        m.on_submit()
        m.on_accept()
    assert m.capacity(0) == 7  # 12 - 5


def test_zero_staleness():
    assert StalenessManager(100, 8, 0).capacity(5) == 48  # (0 + 5 + 1) * 8


def test_rejected_free_their_slot():
    m = StalenessManager(10, 4, 2)
    for _ in range(10):
        m.on_submit()
    for _ in range(10):
        m.on_reject()
    assert m.capacity(0) == 10
    assert m.stats().rejected == 10 and m.stats().running == 0


def test_overcommitted_is_negative():
    m = StalenessManager(3, 2, 1)
    for _ in range(10):
        m.on_submit()
    assert m.capacity(0) < 0  # min(3 - 10, 4 - 10) = -7
    assert m.capacity(0) == -7


def test_version_recovered():
    m = StalenessManager(100, 4, 1)
    m.on_version_recovered(3)
    assert m.stats().accepted == 12 and m.capacity(3) == 8  # (1 + 3 + 1) * 4 - 12


def test_degenerate_sizes_count_as_one():
    assert StalenessManager(0, 0, 0).capacity(0) == 1


def test_concurrent_counters_stay_consistent():
    m = StalenessManager(10**6, 4, 2)
    n_threads, n_ops = 8, 2000

    def hammer(i: int) -> None:
        for k in range(n_ops):
            m.on_submit()
            m.capacity(k)
            (m.on_accept if (i + k) % 3 else m.on_reject)()

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = m.stats()
    assert s.running == 0 and s.submitted == n_threads * n_ops
    assert s.accepted + s.rejected == s.submitted
    expected_rejected = sum(1 for i in range(n_threads) for k in range(n_ops) if (i + k) % 3 == 0)
    assert s.rejected == expected_rejected
