"""Partitioning for DP load balancing: properties, known cases, optimality against brute force."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.data.balance import (
    ffd_pack,
    greedy_partition,
    imbalance,
    karmarkar_karp,
    part_loads,
    sequence_cost,
)

PROPS = settings(max_examples=150, deadline=None)
sizes = st.lists(st.integers(0, 10_000), min_size=1, max_size=80)
floats = st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=60)


def assert_partition(parts: list[list[int]], n: int) -> None:
    """Every index exactly once, each part ascending."""
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert all(p == sorted(p) for p in parts)


def brute_force_opt(values: list[int], k: int) -> float:
    """Smallest max load over all k**n assignments (n <= 10)."""
    n = len(values)
    digits = (np.arange(k**n)[:, None] // (k ** np.arange(n))) % k
    loads = np.stack([(digits == p) @ np.asarray(values, dtype=float) for p in range(k)], axis=1)
    return float(loads.max(axis=1).min())


# --- properties ------------------------------------------------------------------------------


@PROPS
@given(sizes, st.integers(1, 12), st.sampled_from([karmarkar_karp, greedy_partition]))
def test_every_index_once_and_no_empty_part(values, k, fn):
    k = min(k, len(values))
    parts = fn(values, k)
    assert len(parts) == k
    assert_partition(parts, len(values))
    assert all(parts)
    loads = part_loads(values, parts)
    assert loads == sorted(loads, reverse=True)  # documented order: descending load


@PROPS
@given(floats, st.integers(1, 8), st.sampled_from([karmarkar_karp, greedy_partition]))
def test_equal_size_gives_n_over_k_items(values, k, fn):
    k = min(k, len(values))
    values = values[: len(values) // k * k]
    parts = fn(values, k, equal_size=True)
    assert_partition(parts, len(values))
    assert [len(p) for p in parts] == [len(values) // k] * k


@PROPS
@given(floats, st.integers(1, 10), st.booleans())
def test_kk_within_largest_item_of_greedy(values, k, equal_size):
    # LDM's final spread is at most the largest initial spread (<= largest item), and greedy's max
    # load is at least the mean, so KK's max load <= greedy's + largest item.
    k = min(k, len(values))
    values = values[: len(values) // k * k] if equal_size else values
    kk = max(part_loads(values, karmarkar_karp(values, k, equal_size)))
    lpt = max(part_loads(values, greedy_partition(values, k, equal_size)))
    assert kk <= lpt + max(values) + 1e-6 * (1 + sum(values))


@PROPS
@given(sizes, st.integers(1, 10), st.booleans(), st.randoms(use_true_random=False))
def test_deterministic_and_permutation_safe(values, k, equal_size, rnd):
    k = min(k, len(values))
    values = values[: len(values) // k * k] if equal_size else values
    assert karmarkar_karp(values, k, equal_size) == karmarkar_karp(list(values), k, equal_size)
    assert greedy_partition(values, k, equal_size) == greedy_partition(values, k, equal_size)
    shuffled = list(values)
    rnd.shuffle(shuffled)
    for fn in (karmarkar_karp, greedy_partition):
        assert_partition(fn(shuffled, k, equal_size), len(values))
    # Same multiset of values gives the same max load whatever the order? Not promised (ties are
    # broken by index), but the loads must stay within the largest item of each other.
    a = max(part_loads(values, karmarkar_karp(values, k, equal_size)))
    b = max(part_loads(shuffled, karmarkar_karp(shuffled, k, equal_size)))
    assert abs(a - b) <= max(values)


@PROPS
@given(
    st.lists(st.integers(0, 100), min_size=1, max_size=60),
    st.integers(100, 400),
    st.integers(1, 6),
    st.integers(1, 4),
)
def test_ffd_fits_capacity_and_bin_counts(values, capacity, min_bins, bin_multiple):
    try:
        bins = ffd_pack(values, capacity, min_bins=min_bins, bin_multiple=bin_multiple)
    except ValueError as err:  # only when more bins are required than there are items
        assert "pad the batch" in str(err)
        needed = max(min_bins, len(ffd_pack(values, capacity)))
        assert len(values) < -(-needed // bin_multiple) * bin_multiple
        return
    assert_partition(bins, len(values))
    assert all(bins)
    assert max(part_loads(values, bins)) <= capacity
    assert len(bins) >= min_bins
    assert len(bins) % bin_multiple == 0
    assert bins == ffd_pack(list(values), capacity, min_bins=min_bins, bin_multiple=bin_multiple)


# --- optimality ------------------------------------------------------------------------------


def test_kk_matches_brute_force_optimum_in_most_cases():
    rng = random.Random(20240611)
    hits = total = 0
    for _ in range(300):
        k = rng.choice([2, 3])
        values = [rng.randint(1, 100) for _ in range(rng.randint(k, 10))]
        best = brute_force_opt(values, k)
        got = max(part_loads(values, karmarkar_karp(values, k)))
        assert got >= best
        hits += got == best
        total += 1
    fraction = hits / total
    print(f"\nKK optimal on {hits}/{total} = {fraction:.3f} of random inputs (n <= 10, k in 2..3)")
    assert fraction >= 0.75  # measured 0.78 (234/300) with this seed


# --- known cases -----------------------------------------------------------------------------


def test_ldm_classic_example_is_not_optimal():
    # LDM: 8-7 -> 1, 6-5 -> 1, then {4, 1, 1} -> 4-1 -> 3, 3-1 -> 2: loads 16 / 14 (optimum 15 / 15:
    # {4, 5, 6} vs {7, 8}). KK is a heuristic, and this is what it is documented to give.
    values = [4, 5, 6, 7, 8]
    parts = karmarkar_karp(values, 2)
    assert part_loads(values, parts) == [16.0, 14.0]
    assert parts == [[0, 1, 3], [2, 4]]
    assert brute_force_opt(values, 2) == 15.0


def test_equal_loads_split_evenly():
    parts = karmarkar_karp([5] * 12, 4)
    assert [len(p) for p in parts] == [3, 3, 3, 3]
    assert imbalance([5] * 12, parts) == 1.0


def test_k_one_and_n_equal_k():
    assert karmarkar_karp([3, 1, 2], 1) == [[0, 1, 2]]
    assert greedy_partition([3, 1, 2], 1, equal_size=True) == [[0, 1, 2]]
    assert karmarkar_karp([3, 1, 2], 3) == [[0], [2], [1]]  # descending load
    assert karmarkar_karp([3, 1, 2], 3, equal_size=True) == [[0], [2], [1]]


def test_all_zeros_still_fill_every_part():
    for fn in (karmarkar_karp, greedy_partition):
        parts = fn([0] * 7, 3)
        assert_partition(parts, 7)
        assert all(parts)
        assert imbalance([0] * 7, parts) == 1.0


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: karmarkar_karp([1, 2, 3], 2, equal_size=True), "equal_size"),
        (lambda: greedy_partition([1, 2, 3], 2, equal_size=True), "equal_size"),
        (lambda: karmarkar_karp([1, 2], 3), "some rank would get no items"),
        (lambda: karmarkar_karp([1, 2], 0), "k must be >= 1"),
        (lambda: karmarkar_karp([1, -2], 1), "values[1]"),
        (lambda: greedy_partition([float("nan"), 2], 1), "values[0]"),
        (lambda: ffd_pack([1, 9, 2], 5), "values[1] = 9.0 exceeds capacity=5"),
        (lambda: ffd_pack([1, 2], 0), "capacity"),
        (lambda: ffd_pack([1, 2], 5, min_bins=3), "min_bins"),
        (lambda: ffd_pack([1, 2], 5, bin_multiple=0), "bin_multiple"),
        (lambda: sequence_cost([1], "bytes"), "'tokens', 'flops'"),
        (lambda: sequence_cost([1], "flops"), "hidden_size"),
        (lambda: sequence_cost([1], "flops", hidden_size=8, num_layers=0), "num_layers"),
    ],
)
def test_errors_name_the_argument(call, fragment):
    with pytest.raises(ValueError) as info:
        call()
    assert fragment in str(info.value), str(info.value)


def test_ffd_known_cases():
    assert ffd_pack([], 10) == []
    assert ffd_pack([3, 3, 3, 3, 1], 6) == [[0, 1], [2, 3], [4]]
    # Four bins wanted, FFD made three: KK over four bins fits the capacity and is balanced.
    assert ffd_pack([3, 3, 3, 3, 1], 6, min_bins=4) == [[0, 4], [1], [2], [3]]
    # FFD's one full bin, rounded up to a multiple of two.
    assert ffd_pack([1, 1, 1, 1], 4, bin_multiple=2) == [[0, 3], [1, 2]]
    # An item equal to the capacity fits.
    assert ffd_pack([8] + [1] * 7, 8, min_bins=2) == [[0], [1, 2, 3, 4, 5, 6, 7]]


def test_ffd_splits_bins_when_kk_would_overflow(monkeypatch):
    # KK into more bins than FFD needed has not overflowed on any input tried, so force the
    # fallback: a "KK" that piles everything but one item per extra part into the first part.
    from tandem.data import balance

    real = balance.karmarkar_karp

    def lopsided(values, k, equal_size=False):
        if k == 2:  # the fallback's own two-way splits stay real
            return real(values, k, equal_size)
        n = len(values)
        return [list(range(n - k + 1)), *[[i] for i in range(n - k + 1, n)]]

    monkeypatch.setattr(balance, "karmarkar_karp", lopsided)
    values = [6, 5, 4, 3, 2, 1]
    bins = balance.ffd_pack(values, 7, min_bins=5)
    assert_partition(bins, 6)
    assert len(bins) == 5
    assert max(part_loads(values, bins)) <= 7


def test_sequence_cost():
    assert sequence_cost([1, 10]) == [1.0, 10.0]
    assert sequence_cost([10], "flops", hidden_size=2) == [12 * 2 * 10 + 100.0]
    # With num_layers the result is absolute forward FLOPs: 2·h·layers·(12h·L + L²).
    assert sequence_cost([10], "flops", hidden_size=2, num_layers=3) == [2 * 2 * 3 * (240 + 100.0)]


def test_imbalance_and_loads():
    assert part_loads([1, 2, 3], [[0, 2], [1]]) == [4.0, 2.0]
    assert imbalance([1, 2, 3], [[0, 2], [1]]) == pytest.approx(4 / 3)


def test_equal_size_falls_back_to_lpt_on_long_tails():
    # One item of every sorted k-chunk per part: the part with the largest length cannot shed
    # enough, so the chunked LDM alone is ~12% over the mean here and the LPT result is returned.
    from tandem.data.balance import _ldm

    rng = random.Random(0)
    values = [int(min(32768, max(16, rng.lognormvariate(6.0, 1.0)))) for _ in range(4096)]
    assert imbalance(values, _ldm([float(v) for v in values], 64, True)) > 1.1
    parts = karmarkar_karp(values, 64, equal_size=True)
    assert parts == greedy_partition(values, 64, equal_size=True)
    assert imbalance(values, parts) < 1.01
    assert [len(p) for p in parts] == [64] * 64
