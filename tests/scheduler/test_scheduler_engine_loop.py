"""The engine loop (scheduler/engine_loop.py) and its slot store (cache/slots.py).

Invariant 5: a sequence's result does not depend on its neighbours. A random mix of scoring and generating
sequences (greedy and seeded sampling, with and without a JSON-schema constraint, two prefixes), joining at
random steps under a random step budget, gets exactly what each gets alone. Then the scheduling rules: the
token budget, round-robin by client, chunked prefill, cancellation freeing the slot, and the slot store's
take/give contract.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from prefixcache.cache.kv import KVShape, PrefixKV
from prefixcache.cache.slots import Feed, SlotLayout, SlotStore
from prefixcache.engine.constraint import json_constraint
from prefixcache.engine.forward import score_rows
from prefixcache.engine.generate import GenerationConfig, eos_ids_of, generate_rows
from prefixcache.engine.rows import run_padded
from prefixcache.engine.sampling import Sampling
from prefixcache.engine.scoring import LabelScorer
from prefixcache.engine.slot_pass import forward_slots
from prefixcache.scheduler.engine_loop import EngineLoop, LoopConfig
from prefixcache.scheduler.sequence import Generate, Scores, Sequence, Status
from prefixcache.task.prompt import build_prompt

import pytest

from tests.support.models import tiny_loaded

LOADED = tiny_loaded("llama")
SCHEMA = json_constraint({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
PREFIXES = [PrefixKV.build(LOADED.model, list(range(5, 25))), PrefixKV.build(LOADED.model, list(range(40, 47)))]


class RowScorer:
    """First-token label scores of each sequence's rows, as one ``score_rows`` call per step and prefix."""

    def __init__(self, task):
        self.head = LabelScorer(LOADED.model, build_prompt(task, LOADED.tokenizer), "first-token")
        self.calls: list[int] = []

    def score(self, prefix, seqs):
        self.calls.append(len(seqs))
        return list(score_rows(LOADED.model, prefix, [s.ids for s in seqs], self.head))


def _want(kind: int, budget: int, scorer):
    config = GenerationConfig(budget, ("xy",), eos_ids_of(LOADED.model, LOADED.tokenizer))
    return [Scores(scorer), Generate(config), Generate(config, Sampling(temperature=0.9, seed=7)),
            Generate(config, constraint=SCHEMA)][kind]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.allclose(a, b, atol=1e-5)
    return (a.token_ids, a.text, a.finish) == (b.token_ids, b.text, b.finish)


spec = st.tuples(
    st.integers(0, 3),  # what it wants
    st.integers(0, 1),  # which prefix
    st.lists(st.integers(30, 300), min_size=1, max_size=12),  # its own tokens
    st.integers(1, 8),  # max_new_tokens
    st.integers(0, 6),  # the step it joins at
    st.integers(0, 2),  # its client
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(spec, min_size=1, max_size=7), step_tokens=st.integers(1, 24), max_seqs=st.integers(1, 5))
def test_a_sequence_gets_what_it_gets_alone(task, specs, step_tokens, max_seqs):
    scorer = RowScorer(task)
    def make(s):
        kind, p, ids, budget, _, client = s
        return Sequence(PREFIXES[p], ids, _want(kind, budget, scorer), client=client)
    alone = []
    for s in specs:
        seq = make(s)
        EngineLoop(LOADED.model, LOADED.tokenizer).run_until_done([seq])
        alone.append(seq)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(step_tokens, max_seqs, 2**20))
    mixed = [make(s) for s in specs]
    for step in range(7):
        for seq, s in zip(mixed, specs):
            if s[4] == step:
                loop.add(seq)
        loop.step()
    loop.run_until_done()
    for i, (a, m) in enumerate(zip(alone, mixed)):
        assert a.status == m.status == Status.FINISHED, f"sequence {i}: {a.status} alone, {m.status} mixed"
        assert _same(a.result, m.result), f"sequence {i} ({specs[i]}) got {m.result} mixed, {a.result} alone"
    assert loop.store is None or loop.store.free == loop.store.slots, "every slot is given back"


def test_generation_equals_the_static_decoder(task):
    """The loop's tokens are generate_rows's, greedy, sampled and constrained (the path it replaces)."""
    config = GenerationConfig(9, (), eos_ids_of(LOADED.model, LOADED.tokenizer))
    rows = [[30 + i for i in range(n)] for n in (3, 9, 1, 5)]
    for want in (Generate(config), Generate(config, Sampling(temperature=0.7, seed=2)), Generate(config, constraint=SCHEMA)):
        ref, _ = generate_rows(LOADED.model, LOADED.tokenizer, PREFIXES[0], rows, want)  # a Generate is a Decoding
        seqs = [Sequence(PREFIXES[0], r, want) for r in rows]
        EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(6, 2)).run_until_done(seqs)
        assert [s.result.token_ids for s in seqs] == [g.token_ids for g in ref]


@pytest.mark.parametrize(("step_tokens", "max_seqs"), [(0, 1), (1, 0), (-3, 4)])
def test_a_step_bound_below_one_is_refused(step_tokens, max_seqs):
    with pytest.raises(ValueError, match="^max_step_tokens and max_seqs must be at least 1$"):
        LoopConfig(step_tokens, max_seqs)


def test_the_least_bounds_take_one_token_of_one_sequence_a_step_and_a_new_loop_has_fed_nothing():
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(1, 1))
    assert (loop.last_plan.items, loop.last_plan.tokens) == ([], 0), "a loop that took no step has fed nothing"
    seqs = [Sequence(PREFIXES[0], [30, 31], Generate(GenerationConfig(2)), client=i) for i in range(2)]
    loop.run_until_done(seqs)
    assert loop.stats.steps == loop.stats.tokens_fed == 6, "two prompt tokens and one generated token each"
    assert [s.result.token_ids for s in seqs] == [Sequence_alone(s.ids, GenerationConfig(2)).result.token_ids
                                                  for s in seqs]


def test_the_step_budget_bounds_tokens_and_chunks_a_long_prompt():
    config = GenerationConfig(3)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(max_step_tokens=4, max_seqs=8))
    long = Sequence(PREFIXES[0], list(range(30, 40)), Generate(config), client="a")
    loop.add(long)
    fed = []
    while loop.has_work:
        plan = loop.schedule()
        fed.append(plan.tokens)
        assert plan.tokens <= 4, "a step never feeds more than max_step_tokens"
        loop.postprocess(plan, loop.run(plan))
    assert fed[:3] == [4, 4, 2], "the 10-token prompt is fed in chunks of the budget"
    assert long.result.token_ids == Sequence_alone(long.ids, config).result.token_ids


def test_a_step_counts_every_sequence_it_feeds_against_the_budget(task):
    """Three 4-token scoring sequences under an 8-token budget: a step feeds two (8 tokens, counted whole), the
    third waits for the next step; the counters add up what was fed and generated."""
    scorer = RowScorer(task)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(max_step_tokens=8, max_seqs=8))
    for i in range(3):
        loop.add(Sequence(PREFIXES[0], [30 + i, 31, 32, 33], Scores(scorer), client=i))
    first = loop.step()
    assert loop.last_plan.tokens == 8 and len(first) == 2 and scorer.calls == [2]
    assert len(loop.step()) == 1 and scorer.calls == [2, 1] and loop.stats.steps == loop.stats.passes == 2
    assert loop.stats.tokens_fed == 12
    generating = Sequence(PREFIXES[0], [30, 31], Generate(GenerationConfig(5)))
    loop.run_until_done([generating])
    assert loop.stats.tokens_generated == len(generating.result.token_ids) >= 1
    for i in range(2):  # 5 tokens, then 5 more do not fit the 3 left: a scoring sequence is fed whole or waits
        loop.add(Sequence(PREFIXES[0], [40 + i, 41, 42, 43, 44], Scores(scorer), client=i))
    assert len(loop.step()) == 1 and loop.last_plan.tokens == 5 and len(loop.step()) == 1
    passes, steps, fed = loop.stats.passes, loop.stats.steps, loop.stats.tokens_fed
    loop.add(Sequence(PREFIXES[0], [50, 51], Scores(scorer), client=0))
    loop.add(Sequence(PREFIXES[0], [52], Generate(GenerationConfig(2)), client=1))
    loop.step()
    assert (loop.stats.passes - passes, loop.stats.steps - steps) == (2, 1), "a scorer call and a slot pass: two passes"
    assert loop.stats.tokens_fed - fed == 3


def test_prompts_longer_than_the_budget_are_fed_in_chunks_beside_decoding_rows():
    """Five rows under a 4-token budget, three of them with prompts longer than it: the prompts are fed in chunks
    beside rows that already decode, no step feeds more than the budget or any row zero tokens, a step of four
    rows is reached, and every row still gets what it gets alone."""
    config = GenerationConfig(6)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(max_step_tokens=4, max_seqs=8))
    prompts = [list(range(30 + i, 40 + i)) for i in range(3)] + [[50], [51]]
    seqs = [Sequence(PREFIXES[0], ids, Generate(config), client=i) for i, ids in enumerate(prompts)]
    for seq in seqs:
        loop.add(seq)
    widths = []
    while loop.has_work:
        plan = loop.schedule()
        assert plan.tokens <= 4 and all(count >= 1 for _, count in plan.items), plan.items
        widths.append(len(plan.items))
        loop.postprocess(plan, loop.run(plan))
    assert max(widths) == 4, "rows join while prompts are still being fed"
    for seq in seqs:
        assert seq.result.token_ids == Sequence_alone(seq.ids, config).result.token_ids


def Sequence_alone(ids, config):
    seq = Sequence(PREFIXES[0], ids, Generate(config))
    EngineLoop(LOADED.model, LOADED.tokenizer).run_until_done([seq])
    return seq


def test_waiting_sequences_are_picked_round_robin_by_client(task):
    scorer = RowScorer(task)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(max_step_tokens=1000, max_seqs=2))
    flood = [Sequence(PREFIXES[0], [30, 31], Scores(scorer), client="flood", tag=i) for i in range(6)]
    lone = Sequence(PREFIXES[0], [32], Scores(scorer), client="lone", tag="lone")
    for seq in flood:
        loop.add(seq)
    loop.add(lone)
    first = loop.step()
    assert lone in first, f"the lone client's sequence goes in the first step beside the flood, got {first}"
    assert scorer.calls == [2], "one scorer call per step and prefix, of at most max_seqs sequences"


def test_a_scoring_sequence_longer_than_the_budget_runs_alone(task):
    scorer = RowScorer(task)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(max_step_tokens=3, max_seqs=4))
    seqs = [Sequence(PREFIXES[0], list(range(30, 38)), Scores(scorer)), Sequence(PREFIXES[0], [31], Scores(scorer))]
    loop.run_until_done(seqs)
    assert scorer.calls == [1, 1]


def test_time_to_first_token_counts_from_the_step_that_first_feeds_a_sequence():
    """A sequence that waits for a slot is admitted only when one frees: its admission time (what an extraction's
    time to first token counts from) comes after the sequence ahead of it finished, so its wait is not in it."""
    config = GenerationConfig(4)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(max_seqs=1))
    first, second = (Sequence(PREFIXES[0], [30, 31], Generate(config)) for _ in range(2))
    loop.add(first)
    loop.add(second)
    loop.step()
    assert first.admitted_at is not None and second.admitted_at is None, "one slot: the second waits unadmitted"
    loop.run_until_done()
    finished = [first.first_token_at, second.admitted_at, second.first_token_at]
    assert None not in finished and first.admitted_at <= finished[0] < finished[1] <= finished[2]
    assert len(first.generated) == len(second.generated) == 4


def test_cancelling_frees_the_slot_at_the_next_step():
    config = GenerationConfig(50)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(max_seqs=2))
    seqs = [Sequence(PREFIXES[0], [30, 31, 32], Generate(config)) for _ in range(2)]
    for seq in seqs:
        loop.add(seq)
    loop.step()
    assert loop.store.free == loop.store.slots - 2
    seqs[0].cancel()
    left = loop.step()
    assert seqs[0] in left and seqs[0].status == Status.CANCELLED
    assert loop.store.free == loop.store.slots - 1 and seqs[0].slot is None
    assert seqs[0] not in loop.running
    waiting = Sequence(PREFIXES[0], [30], Generate(config))
    loop.add(waiting)
    waiting.cancel()
    assert waiting in loop.step() and waiting.status == Status.CANCELLED and waiting.generated == []


def test_a_running_sequence_cancelled_while_others_wait_leaves_and_gives_its_slot_to_one_waiting():
    """The step after a running sequence is cancelled, it leaves (told "cancelled") even while other clients'
    sequences wait, and a waiting one takes its slot in that same step."""
    config = GenerationConfig(50)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(max_seqs=2))
    running = [Sequence(PREFIXES[0], [30, 31, 32], Generate(config), client="a") for _ in range(2)]
    for seq in running:
        loop.add(seq)
    loop.step()
    waiting = Sequence(PREFIXES[0], [33], Generate(GenerationConfig(2)), client="b")
    loop.add(waiting)
    loop.step()
    assert waiting.status == Status.WAITING and loop.store.free == 0, "no slot is free for it yet"
    running[0].cancel()
    left = loop.step()
    assert left == [running[0]] and (running[0].status, running[0].error) == (Status.CANCELLED, "cancelled")
    assert waiting.status == Status.RUNNING and running[0] not in loop.running and running[0].slot is None


def test_a_row_whose_constraint_fails_fails_alone(monkeypatch):
    config = GenerationConfig(6)
    bad = Sequence(PREFIXES[0], [30, 31], Generate(config, constraint=SCHEMA))
    good = Sequence(PREFIXES[0], [30, 32], Generate(config))
    from prefixcache.engine import constraint
    def broken(self, logits, live):
        raise constraint.ConstraintError("the grammar matcher failed")
    monkeypatch.setattr(constraint.ConstrainedRows, "mask_", broken)
    EngineLoop(LOADED.model, LOADED.tokenizer).run_until_done([bad, good])
    assert bad.status == Status.FAILED and "grammar" in bad.error
    assert good.status == Status.FINISHED and len(good.result.token_ids) >= 1


def test_a_row_whose_grammar_refuses_its_token_fails_alone_and_leaves(monkeypatch):
    """A ConstraintError as a row takes its token (its grammar refuses to advance) fails that row alone, with the
    error's own message: it is reported finished in that step (once), gives its slot back, leaves the running
    rows and tells its caller; its pass-mate goes on to finish, its tokens reported with itself."""
    from prefixcache.engine import constraint

    config = GenerationConfig(4)
    ended, seen = [], []
    bad = Sequence(PREFIXES[0], [30, 31], Generate(config, constraint=SCHEMA), on_finish=ended.append)
    good = Sequence(PREFIXES[0], [30, 32], Generate(config), on_finish=ended.append,
                    on_token=lambda seq, token: seen.append((seq, token)))

    def refuses(self, row, token):
        raise constraint.ConstraintError("the grammar refused the token")
    monkeypatch.setattr(constraint.ConstrainedRows, "accept", refuses)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer)
    loop.add(bad)
    loop.add(good)
    reported = loop.step()
    assert bad in reported and bad.status == Status.FAILED and bad.error == "the grammar refused the token"
    assert bad.slot is None and bad not in loop.running and ended == [bad] and bad.generated == []
    assert good.status == Status.RUNNING and loop.store.free == loop.store.slots - 1
    while loop.has_work:
        reported += loop.step()
    assert reported.count(bad) == 1 and good in reported and good.status == Status.FINISHED and ended == [bad, good]
    assert [token for _, token in seen] == list(good.result.token_ids) and all(seq is good for seq, _ in seen)
    assert loop.store.free == loop.store.slots


def constraints_allow_nothing(monkeypatch) -> None:
    """Every constrained row's mask forbids every token: a dead end at its first pick."""
    from prefixcache.engine import constraint

    def nothing(self, logits, live):
        logits[:] = float("-inf")
        return logits
    monkeypatch.setattr(constraint.ConstrainedRows, "mask_", nothing)


def test_a_row_whose_constraint_allows_no_token_fails_alone(monkeypatch):
    """A constraint that masks every token of a row (a dead end) fails that row with a ConstraintError's message;
    sampling its all--inf logits would otherwise raise for the whole step."""
    config = GenerationConfig(6)
    stuck = Sequence(PREFIXES[0], [30, 31], Generate(config, Sampling(temperature=0.9, seed=1), constraint=SCHEMA))
    good = Sequence(PREFIXES[0], [30, 32], Generate(config, Sampling(temperature=0.9, seed=2)))
    constraints_allow_nothing(monkeypatch)
    EngineLoop(LOADED.model, LOADED.tokenizer).run_until_done([stuck, good])
    assert stuck.status == Status.FAILED and "allows no next token" in stuck.error
    assert good.status == Status.FINISHED and len(good.result.token_ids) >= 1


def test_slot_store_take_give_and_budget():
    shape = KVShape.of(LOADED.model.config)
    store = SlotStore.within(shape, shape.nbytes(32, 4) * 3 + 5, 32, torch.float32, "cpu", max_slots=10)
    assert store.slots == 3, "the byte budget sets the slot count"
    assert store.nbytes <= shape.nbytes(32, 4) * 3 + 5
    assert [store.take(), store.take()] == [0, 1]
    store.give(0)
    assert store.take() == 0, "the lowest free slot is taken first"
    with pytest.raises(ValueError):
        store.give(2)
    with pytest.raises(ValueError):
        SlotStore.within(shape, 10, 32, torch.float32, "cpu", max_slots=4)


def test_slot_pass_reads_gathered_slots_exactly():
    """Rows in far-apart slots (gathered, not a view) and a row in two chunks compute what a padded pass does."""
    store = SlotStore(KVShape.of(LOADED.model.config), 12, 16, torch.float32, "cpu")
    rows = [[30, 31, 32, 33, 34], [40, 41], [50, 51, 52]]
    ref = run_padded(LOADED.model, PREFIXES[0], rows).last
    first = forward_slots(LOADED.model, PREFIXES[0], store, [Feed(11, 0, (30, 31)), Feed(0, 0, (40, 41)), Feed(5, 0, (50, 51, 52))])
    second = forward_slots(LOADED.model, PREFIXES[0], store, [Feed(11, 2, (32, 33, 34))])
    assert torch.allclose(first[1], ref[1], atol=1e-5) and torch.allclose(first[2], ref[2], atol=1e-5)
    assert torch.allclose(second[0], ref[0], atol=1e-5)
    with pytest.raises(ValueError):
        forward_slots(LOADED.model, PREFIXES[0], store, [Feed(1, 14, (1, 2, 3))])


@pytest.mark.parametrize("contiguous", [True, False])
def test_a_step_of_decoding_rows_and_a_prompt_attends_them_as_two_parts_exactly(contiguous):
    """Rows feeding one token and a row feeding a whole prompt share one pass; their own attention runs as two
    parts (the decoding rows are not padded to the prompt's length), and every row computes what a padded pass
    over its whole text computes."""
    store = SlotStore(KVShape.of(LOADED.model.config), 12, 16, torch.float32, "cpu")
    slots = [0, 1, 2, 3] if contiguous else [0, 4, 9, 11]
    rows = [[30, 31, 32], [40, 41, 42, 43], [50, 51], [60, 61, 62, 63, 64, 65, 66]]
    forward_slots(LOADED.model, PREFIXES[0], store, [Feed(slots[i], 0, tuple(rows[i][:-1])) for i in range(3)])
    feeds = [Feed(slots[i], len(rows[i]) - 1, (rows[i][-1],)) for i in range(3)] + [Feed(slots[3], 0, tuple(rows[3]))]
    layout = SlotLayout(store, PREFIXES[0].length, feeds)
    assert [part.packing.width for part in layout.parts] == [1, 7], "decoding rows padded to the prompt's length"
    got = forward_slots(LOADED.model, PREFIXES[0], store, feeds)
    ref = run_padded(LOADED.model, PREFIXES[0], rows).last
    assert torch.allclose(got, ref, atol=1e-5)


def test_an_extraction_whose_constraint_fails_is_an_error_for_that_record_only(monkeypatch):
    """Through the record loop: one record's grammar fails mid-pass; it gets an error naming it, its window-mates
    get exactly the outputs they get when nothing fails, and static batches (the old path) give those too."""
    from tests.support.tasks import EXTRACT_YAML, TEXTS
    from prefixcache.bench.extract_lanes import static_twin
    from prefixcache.engine import constraint
    from prefixcache.scheduler.classify import records_from_texts
    from prefixcache.scheduler.extract import Extractor
    from prefixcache.task.definition import parse_task
    from prefixcache.types import RunConfig

    extractor = Extractor(LOADED, parse_task(EXTRACT_YAML, "x.yaml", kinds=("extract",)))
    static = static_twin(extractor)  # the path the engine loop replaced
    records = records_from_texts(TEXTS[:5])
    clean = extractor.extract_all(records, RunConfig("batched", 3))
    assert [e.to_json() for e in static.extract_all(records, RunConfig("batched", 3))] == [
        e.to_json() for e in clean]
    original, seen = constraint.ConstrainedRows.mask_, []  # the rows' grammars, in the order they first mask

    def fails_on_the_third_row(self, logits, live):
        if self not in seen:
            seen.append(self)
        if seen.index(self) == 2:
            raise constraint.ConstraintError("the grammar matcher failed")
        return original(self, logits, live)

    monkeypatch.setattr(constraint.ConstrainedRows, "mask_", fails_on_the_third_row)
    broken = extractor.extract_all(records, RunConfig("batched", 3))
    failed = [i for i, e in enumerate(broken) if e.error is not None and "grammar matcher" in e.error]
    assert len(failed) == 1 and repr(records[failed[0]].id) in broken[failed[0]].error
    assert all(broken[i].to_json() == clean[i].to_json() for i in range(5) if i not in failed)


def test_the_loop_makes_its_tensors_on_the_models_device_not_torchs_default(monkeypatch, task):
    """With ``meta`` as torch's default device, a tensor the loop makes without naming its device holds no data
    (tests/engine/test_engine_device_placement.py says why this is the CPU suite's device check). A step that
    mixes a scoring row, greedy and seeded rows and a row whose constraint dead-ends (so the others' logits are
    picked out of the step's) gives exactly what it gives with the CPU as the default."""
    constraints_allow_nothing(monkeypatch)
    scorer, config = RowScorer(task), GenerationConfig(4)

    def run():
        seqs = [Sequence(PREFIXES[0], [30, 31], Generate(config, constraint=SCHEMA)),
                Sequence(PREFIXES[0], [30, 32], Generate(config)),
                Sequence(PREFIXES[1], [33], Generate(config, Sampling(temperature=0.9, seed=3))),
                Sequence(PREFIXES[0], [34, 35, 36], Scores(scorer))]
        EngineLoop(LOADED.model, LOADED.tokenizer).run_until_done(seqs)
        return [(s.status, s.result.token_ids if s.generates and s.result else s.result) for s in seqs]

    expected = run()
    with torch.device("meta"):
        got = run()
    assert expected[0][0] == Status.FAILED and expected[1][0] == expected[2][0] == Status.FINISHED
    assert [status for status, _ in got] == [status for status, _ in expected]
    assert got[1:3] == expected[1:3] and torch.equal(got[3][1], expected[3][1])


@pytest.mark.parametrize("kind", ["generating", "scoring"])
def test_a_sequence_cancelled_while_its_step_is_scheduled_never_takes_that_step(task, kind):
    """The race between noticing a client has gone and admitting its sequence: a waiting sequence cancelled (from
    another thread) after the step has dropped the cancelled ones, but before it is admitted, leaves unfed in that
    step (told "cancelled", in the step's list of those that left), and the others of the step run."""
    want = Generate(GenerationConfig(3)) if kind == "generating" else Scores(RowScorer(task))
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(max_seqs=4))
    late, other = (Sequence(PREFIXES[0], [30, 31], want, client=c) for c in ("gone", "stays"))
    for seq in (late, other):
        loop.add(seq)
    dropped = loop._drop_cancelled

    def then_the_client_leaves():
        left = dropped()
        late.cancel()  # as the event loop's thread does, between the drop and the admission
        return left

    loop._drop_cancelled = then_the_client_leaves
    left = loop.step()
    assert late in left and (late.status, late.error, late.steps, late.fed) == (Status.CANCELLED, "cancelled", 0, 0)
    assert [seq for seq, _ in loop.last_plan.items] == [other] and other.steps == 1
    assert late.slot is None and late not in loop.running and not loop.waiting.get("gone")


def test_a_sequence_no_slot_can_hold_fails_unfed_with_a_typed_error_naming_its_tokens():
    """Without a pool, a sequence longer than ``slot_bytes`` holds fails at admission with SequenceTooLongError
    (kept as its ``failure``, so an edge can answer a 4xx), never fed; the short one beside it runs."""
    from prefixcache.errors import SequenceTooLongError

    one_slot = KVShape.of(LOADED.model.config).nbytes(64, 4)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(max_seqs=2, slot_bytes=one_slot))
    long, short = Sequence(PREFIXES[0], list(range(30, 100)), Generate(GenerationConfig(2))), \
        Sequence(PREFIXES[0], [30], Generate(GenerationConfig(2)))
    loop.run_until_done([long, short])
    assert long.status == Status.FAILED and long.fed == 0 and long.steps == 0
    assert isinstance(long.failure, SequenceTooLongError) and long.error == str(long.failure)
    assert "71 tokens of its own" in long.error and "slot budget" in long.error and "max_new_tokens" in long.error
    assert short.status == Status.FINISHED and short.failure is None



def test_trim_drops_an_idle_long_few_store_and_keeps_a_full_or_busy_one():
    """A store made long and few for one long sequence is dropped by ``trim`` once idle (the next sequence makes one
    at its own length, with every slot); a store of ``max_seqs`` slots, or one a sequence still runs in, is kept."""
    one_long = KVShape.of(LOADED.model.config).nbytes(128, 4)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(max_seqs=2, slot_bytes=one_long))
    long = Sequence(PREFIXES[0], list(range(30, 100)), Generate(GenerationConfig(30)))
    loop.add(long)
    loop.step()
    assert (loop.store.slots, loop.store.slot_tokens) == (1, 128) and not loop.trim(), "a busy store was dropped"
    loop.run_until_done()
    assert loop.trim() and loop.store is None, "the idle long store was kept"
    loop.run_until_done([Sequence(PREFIXES[0], [30], Generate(GenerationConfig(2)))])
    assert loop.store.slots == 2 and not loop.trim() and loop.store is not None, "a full store was dropped"
