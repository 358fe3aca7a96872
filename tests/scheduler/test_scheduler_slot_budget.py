"""The engine loop's slot store in the prefix pool's budget (scheduler/slot_budget.py, PrefixPool.reserve).

A loop given the pool sizes its store from what the budget leaves beside the held prefixes (at most max_seqs
slots, at least one), reserves its bytes there (the pool's stats report them), evicts an unpinned prefix for its
one slot but never a pinned one (the sequence then fails alone with the pool's error), grows and is made again
through the same reservation, and gives the bytes back when the store is dropped (close, garbage collection, the
record loop's run ending). A hypothesis property drives random budgets, prefixes, pins and sequence lengths
through a loop and checks the budget after every step. Without a pool, ``slot_bytes`` bounds the store as before.
"""

from __future__ import annotations

import gc

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from prefixcache.cache.config import PoolConfig
from prefixcache.cache.kv import KVShape
from prefixcache.cache.pool import PrefixKey, PrefixPool
from prefixcache.engine.generate import GenerationConfig
from prefixcache.errors import PoolBudgetError
from prefixcache.scheduler.classify import RunConfig, records_from_texts
from prefixcache.scheduler.engine_loop import EngineLoop, LoopConfig
from prefixcache.scheduler.extract import Extractor
from prefixcache.scheduler.sequence import Generate, Sequence, Status
from prefixcache.task.definition import parse_task

from tests.support.tasks import EXTRACT_YAML, TEXTS

PREFIX = list(range(5, 65))  # 60 tokens


def per_slot(loaded, tokens: int = 64) -> int:
    """Bytes of one slot of ``tokens`` tokens (float32 keys and values, every layer)."""
    return KVShape.of(loaded.model.config).nbytes(tokens, 4)


def prefix_bytes(loaded, tokens: int = len(PREFIX)) -> int:
    return PrefixPool().size_of(loaded, tokens)


def generating(prefix, ids, new_tokens: int = 3) -> Sequence:
    return Sequence(prefix, ids, Generate(GenerationConfig(new_tokens)))


def tokens_alone(loaded, prefix, ids, new_tokens: int = 3) -> tuple[int, ...]:
    """What the sequence generates in a loop of its own, without a pool."""
    seq = generating(prefix, ids, new_tokens)
    EngineLoop(loaded.model, loaded.tokenizer).run_until_done([seq])
    return seq.result.token_ids


def test_the_store_takes_what_the_budget_leaves_and_the_pool_counts_it(tiny_llama):
    pool = PrefixPool(PoolConfig(prefix_bytes(tiny_llama) + 3 * per_slot(tiny_llama) + per_slot(tiny_llama) // 2))
    prefix = pool.get(tiny_llama, PREFIX).prefix
    loop = EngineLoop(tiny_llama.model, tiny_llama.tokenizer, LoopConfig(max_seqs=8), pool)
    seqs = [generating(prefix, [30 + i, 31]) for i in range(5)]
    for seq in seqs:
        loop.add(seq)
    loop.step()
    stats = pool.stats()
    assert loop.store.slots == 3, "three slots are what the budget leaves beside the prefix"
    assert stats.reserved_bytes == loop.store.nbytes == 3 * per_slot(tiny_llama)
    assert stats.used_bytes == stats.bytes_held + loop.store.nbytes <= stats.budget_bytes
    assert (stats.entries, stats.evictions) == (1, 0), "slots sized from what is left evict nothing"
    loop.run_until_done()
    assert [s.result.token_ids for s in seqs] == [tokens_alone(tiny_llama, prefix, s.ids) for s in seqs]
    loop.close()
    assert loop.store is None and pool.stats().reserved_bytes == 0, "closing gives the slots back"


def test_max_seqs_caps_the_slots_of_a_roomy_budget(tiny_llama):
    pool = PrefixPool()
    loop = EngineLoop(tiny_llama.model, tiny_llama.tokenizer, LoopConfig(max_seqs=2), pool)
    loop.run_until_done([generating(pool.get(tiny_llama, PREFIX).prefix, [30, 31])])
    assert loop.store.slots == 2 and pool.stats().reserved_bytes == 2 * per_slot(tiny_llama)


@pytest.mark.parametrize("pin", [False, True], ids=["unpinned", "pinned"])
def test_one_slot_evicts_an_unpinned_prefix_and_never_a_pinned_one(tiny_llama, pin):
    """A budget of the prefix and half a slot: the one slot evicts the prefix (the running sequence still holds it),
    or, when the prefix is pinned, cannot fit: the sequence fails alone with the pool's error."""
    pool = PrefixPool(PoolConfig(prefix_bytes(tiny_llama) + per_slot(tiny_llama) // 2))
    lookup = pool.get(tiny_llama, PREFIX, pin=pin)
    seq, other = generating(lookup.prefix, [30, 31]), generating(lookup.prefix, [32])
    loop = EngineLoop(tiny_llama.model, tiny_llama.tokenizer, LoopConfig(max_seqs=4), pool)
    loop.run_until_done([seq, other])
    stats = pool.stats()
    assert stats.used_bytes <= stats.budget_bytes
    if pin:
        assert seq.status == other.status == Status.FAILED
        assert "pinned prefixes hold" in seq.error and "cache_budget" in seq.error, seq.error
        assert lookup.key in pool and stats.evictions == 0 and stats.reserved_bytes == 0 and loop.store is None
        return
    assert seq.status == other.status == Status.FINISHED
    assert seq.result.token_ids == tokens_alone(tiny_llama, lookup.prefix, seq.ids)
    assert lookup.key not in pool and stats.evictions == 1, "the unpinned prefix made room for the slot"
    assert loop.store.slots == 1 and stats.reserved_bytes == per_slot(tiny_llama)


def test_a_store_grows_through_its_reservation_when_the_budget_leaves_room(tiny_llama):
    pool = PrefixPool(PoolConfig(prefix_bytes(tiny_llama) + 2 * per_slot(tiny_llama, 128)))
    prefix = pool.get(tiny_llama, PREFIX).prefix
    loop = EngineLoop(tiny_llama.model, tiny_llama.tokenizer, LoopConfig(max_seqs=2), pool)
    running = generating(prefix, [30, 31], new_tokens=40)  # 41 tokens of its own: a 64-token slot
    loop.add(running)
    loop.step()
    assert (loop.store.slots, loop.store.slot_tokens) == (2, 64)
    long = generating(prefix, list(range(30, 130)), new_tokens=2)  # 101 tokens: 128-token slots
    loop.add(long)
    loop.step()
    assert (loop.store.slots, loop.store.slot_tokens) == (2, 128), "grown in place beside the running sequence"
    assert pool.stats().reserved_bytes == loop.store.nbytes == 2 * per_slot(tiny_llama, 128)
    loop.run_until_done()
    assert long.result.token_ids == tokens_alone(tiny_llama, prefix, long.ids, 2)
    assert pool.stats().evictions == 0


def test_a_store_that_cannot_grow_is_made_again_with_fewer_longer_slots(tiny_llama):
    pool = PrefixPool(PoolConfig(prefix_bytes(tiny_llama) + 3 * per_slot(tiny_llama)))
    prefix = pool.get(tiny_llama, PREFIX).prefix
    loop = EngineLoop(tiny_llama.model, tiny_llama.tokenizer, LoopConfig(max_seqs=2), pool)
    running = generating(prefix, [30, 31], new_tokens=6)
    loop.add(running)
    loop.step()
    long = generating(prefix, list(range(30, 130)), new_tokens=2)
    loop.add(long)
    loop.step()
    assert (loop.store.slots, loop.store.slot_tokens) == (2, 64) and long.status == Status.WAITING
    loop.run_until_done()
    assert running.status == long.status == Status.FINISHED
    assert (loop.store.slots, loop.store.slot_tokens) == (1, 128), "one 128-token slot is what the budget leaves"
    assert pool.stats().reserved_bytes == loop.store.nbytes and pool.stats().evictions == 0


def test_long_few_slots_take_a_short_sequence_while_busy_and_are_made_again_at_its_length_when_idle(tiny_llama):
    """After a long request the store's slots are long and few. A short sequence beside a running one takes a free long
    slot at once (it does not wait for the store to empty); once the store is idle and its slots are more than twice
    what a sequence needs, that sequence makes it again at its own length, with the slot count the budget allows."""
    pool = PrefixPool(PoolConfig(prefix_bytes(tiny_llama) + 2 * per_slot(tiny_llama, 192)))
    prefix = pool.get(tiny_llama, PREFIX).prefix
    loop = EngineLoop(tiny_llama.model, tiny_llama.tokenizer, LoopConfig(max_seqs=8), pool)
    long = generating(prefix, list(range(30, 180)), new_tokens=4)  # 153 tokens of its own: 192-token slots
    loop.add(long)
    loop.step()
    assert (loop.store.slots, loop.store.slot_tokens) == (2, 192)
    short = generating(prefix, [30, 31])  # 4 tokens of its own: a 64-token slot would do
    loop.add(short)
    loop.step()
    assert short.status == Status.RUNNING and long.status == Status.RUNNING, "the short one took the free long slot"
    assert (loop.store.slots, loop.store.slot_tokens) == (2, 192)
    loop.run_until_done()
    later = generating(prefix, [32, 33])
    loop.run_until_done([later])
    assert (loop.store.slots, loop.store.slot_tokens) == (6, 64), "made again: 64-token slots, as many as fit"
    assert pool.stats().reserved_bytes == loop.store.nbytes == 6 * per_slot(tiny_llama)
    assert [s.result.token_ids for s in (long, short, later)] == [
        tokens_alone(tiny_llama, prefix, s.ids, n) for s, n in ((long, 4), (short, 3), (later, 3))]


def test_a_loop_dropped_without_closing_gives_its_slots_back(tiny_llama):
    pool = PrefixPool()
    loop = EngineLoop(tiny_llama.model, tiny_llama.tokenizer, LoopConfig(max_seqs=2), pool)
    loop.run_until_done([generating(pool.get(tiny_llama, PREFIX).prefix, [30, 31])])
    assert pool.stats().reserved_bytes > 0
    del loop
    gc.collect()
    assert pool.stats().reserved_bytes == 0


def test_the_record_loop_reserves_its_slots_while_it_runs_and_gives_them_back(tiny_llama, monkeypatch):
    task = parse_task(EXTRACT_YAML, "tiny-fields.yaml", kinds=("extract",))
    pool = PrefixPool()
    seen: list[tuple[int, int]] = []
    close = EngineLoop.close

    def spy(self):
        seen.append((pool.stats().reserved_bytes, self.store.nbytes if self.store is not None else 0))
        close(self)
    monkeypatch.setattr(EngineLoop, "close", spy)
    records = records_from_texts(TEXTS[:3])
    got = Extractor(tiny_llama, task, pool=pool).extract_all(records, RunConfig("batched", 2))
    monkeypatch.undo()
    want = Extractor(tiny_llama, task).extract_all(records, RunConfig("batched", 2))
    assert [(r.raw, r.token_ids) for r in got] == [(r.raw, r.token_ids) for r in want]
    assert seen and all(reserved == nbytes > 0 for reserved, nbytes in seen), seen
    assert pool.stats().reserved_bytes == 0 and pool.stats().entries == 1


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    budget_slots=st.floats(min_value=0.5, max_value=8.0),
    prefixes=st.lists(st.tuples(st.integers(4, 90), st.booleans()), min_size=1, max_size=3),
    lengths=st.lists(st.tuples(st.integers(1, 140), st.integers(1, 3)), min_size=1, max_size=6),
    max_seqs=st.integers(1, 4),
)
def test_prefixes_and_slots_never_pass_the_budget(tiny_llama, budget_slots, prefixes, lengths, max_seqs):
    """Random budgets, prefixes (some pinned) and sequence lengths: after every step the prefixes and the store fit
    in the budget, the pool counts exactly the store, pinned prefixes stay, and a sequence fails only with the
    pool's budget error; closing the loop gives every slot back."""
    budget = int(per_slot(tiny_llama) * budget_slots)
    pool = PrefixPool(PoolConfig(budget, min_shared_tokens=10**6))
    held, pinned = [], set()
    for i, (length, pin) in enumerate(prefixes):
        ids = [5 + 100 * i + k for k in range(length)]
        try:
            held.append(pool.get(tiny_llama, ids, pin=pin).prefix)
        except PoolBudgetError:
            continue
        if pin:
            pinned.add(PrefixKey.of(tiny_llama, ids))
    if not held:
        return
    loop = EngineLoop(tiny_llama.model, tiny_llama.tokenizer, LoopConfig(max_step_tokens=64, max_seqs=max_seqs), pool)
    seqs = [generating(held[i % len(held)], [30 + (k % 300) for k in range(n)], new) for i, (n, new) in enumerate(lengths)]
    for seq in seqs:
        loop.add(seq)
    while loop.has_work:
        loop.step()
        stats = pool.stats()
        assert stats.used_bytes <= budget, f"prefixes {stats.bytes_held} + slots {stats.reserved_bytes} > {budget}"
        assert stats.reserved_bytes == (loop.store.nbytes if loop.store is not None else 0)
        assert all(key in pool for key in pinned), "a pinned prefix was evicted for slots"
    for seq in seqs:
        assert seq.status == Status.FINISHED or "cache_budget" in seq.error, seq.error
    loop.close()
    assert pool.stats().reserved_bytes == 0
