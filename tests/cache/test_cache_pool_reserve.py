"""PrefixPool reservations: bytes kept outside the entries (the engine loop's slot store) in the same budget.

``reserve`` counts them in ``reserved_bytes`` and ``used_bytes``, evicts unpinned prefixes (never pinned ones) to
make room, and is refused with PoolReservationError, changing nothing, when even that would not make room; a
prefix's own budget check counts the reservations; ``release`` gives them back. A hypothesis property drives random
budgets, prefixes, pins and reservations and checks the budget after every call.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.cache.config import PoolConfig
from prefixcache.cache.pool import PrefixKey, PrefixPool
from prefixcache.errors import PoolBudgetError, PoolReservationError

from tests.cache.test_cache_pool import ids, pool_for


def test_a_reservation_counts_in_the_budget_and_evicts_the_least_recently_used_prefix(tiny_llama):
    pool = pool_for(tiny_llama, 3)
    size = pool.size_of(tiny_llama, 6)
    for first in (1, 2, 3):
        pool.get(tiny_llama, ids(first))
    assert pool.room("slots") == pool.config.budget_bytes - 3 * size
    pool.reserve("slots", size)
    stats = pool.stats()
    assert PrefixKey.of(tiny_llama, ids(1)) not in pool, "the least recently used prefix made room"
    assert (stats.entries, stats.evictions, stats.reserved_bytes) == (2, 1, size)
    assert stats.used_bytes == stats.bytes_held + size <= stats.budget_bytes
    assert stats.to_json()["used_bytes"] == stats.used_bytes
    pool.get(tiny_llama, ids(4))  # a new prefix makes room beside the reservation too
    assert pool.stats().entries == 2 and pool.stats().used_bytes <= pool.config.budget_bytes


def test_a_reservation_never_evicts_a_pinned_prefix_and_a_refused_one_changes_nothing(tiny_llama):
    pool = pool_for(tiny_llama, 3)
    size = pool.size_of(tiny_llama, 6)
    pool.get(tiny_llama, ids(1), pin=True)
    pool.get(tiny_llama, ids(2), pin=True)
    pool.get(tiny_llama, ids(3))
    with pytest.raises(PoolReservationError, match="pinned prefixes hold") as refused:
        pool.reserve("slots", size + 1)
    assert isinstance(refused.value, PoolBudgetError) and "raise cache_budget" in str(refused.value)
    assert pool.stats().entries == 3 and pool.stats().reserved_bytes == 0 and pool.stats().evictions == 0
    pool.reserve("slots", size)  # fits once the unpinned prefix goes
    assert [PrefixKey.of(tiny_llama, ids(f)) in pool for f in (1, 2, 3)] == [True, True, False]


def test_a_prefix_counts_the_reservations_like_pins(tiny_llama):
    pool = pool_for(tiny_llama, 3)
    size = pool.size_of(tiny_llama, 6)
    pool.reserve("slots", 2 * size)
    assert pool.fits(tiny_llama, 6) and not pool.fits(tiny_llama, 12)
    pool.get(tiny_llama, ids(1), pin=True)
    with pytest.raises(PoolBudgetError, match="slots"):
        pool.get(tiny_llama, ids(2))
    pool.release("slots")
    pool.get(tiny_llama, ids(2))
    assert pool.stats().entries == 2


def test_reserve_replaces_an_owners_reservation_and_release_gives_it_back():
    pool = PrefixPool(PoolConfig(1000))
    pool.reserve("a", 300)
    pool.reserve("b", 200)
    assert pool.room("a") == 800 and pool.room("b") == 700 and pool.bytes_reserved == 500
    pool.reserve("a", 600)  # in place of its 300: a store made again or grown
    assert pool.bytes_reserved == 800
    with pytest.raises(PoolReservationError, match="other reservations"):
        pool.reserve("a", 801)
    assert pool.bytes_reserved == 800, "a refused reservation keeps the one it would have replaced"
    pool.release("a")
    pool.release("a")  # nothing left to give back: a no-op
    pool.release("nobody")
    assert pool.bytes_reserved == 200 and pool.stats().reserved_bytes == 200
    pool.reserve("b", 0)
    assert pool.bytes_reserved == 0 and pool.room("b") == 1000
    with pytest.raises(ValueError):
        pool.reserve("b", -1)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    budget_entries=st.floats(min_value=0.5, max_value=5.0),
    ops=st.lists(st.tuples(st.sampled_from(["get", "reserve", "release"]), st.integers(1, 6), st.integers(1, 18),
                           st.booleans()), min_size=1, max_size=14),
)
def test_prefixes_and_reservations_never_pass_the_budget(tiny_llama, budget_entries, ops):
    """Random gets (with pins), reservations of two owners and releases: used bytes never pass the budget, pinned
    prefixes are never evicted, and a reservation is refused exactly when the pins and the other owner's leave no room."""
    unit = PrefixPool().size_of(tiny_llama, 6)
    budget = int(unit * budget_entries)
    pool = PrefixPool(PoolConfig(budget, min_shared_tokens=10**6))
    pinned: set[PrefixKey] = set()
    reserved = {"one": 0, "two": 0}
    for op, first, length, flag in ops:
        owner = "one" if flag else "two"
        if op == "get":
            try:
                pool.get(tiny_llama, ids(first, length), pin=flag)
                if flag:
                    pinned.add(PrefixKey.of(tiny_llama, ids(first, length)))
            except PoolBudgetError:
                pass
        elif op == "reserve":
            nbytes = unit * length // 6
            others = sum(reserved.values()) - reserved[owner]
            pinned_bytes = sum(pool.size_of(tiny_llama, k.length) for k in pinned)
            try:
                pool.reserve(owner, nbytes)
                reserved[owner] = nbytes
                assert pinned_bytes + others + nbytes <= budget, "a reservation that cannot fit was accepted"
            except PoolReservationError:
                assert pinned_bytes + others + nbytes > budget, f"{nbytes} refused with {pinned_bytes} pinned"
        else:
            pool.release(owner)
            reserved[owner] = 0
        stats = pool.stats()
        assert stats.reserved_bytes == sum(reserved.values())
        assert stats.used_bytes <= budget, f"used {stats.used_bytes} > budget {budget}"
        assert all(k in pool for k in pinned), "a pinned prefix was evicted"
