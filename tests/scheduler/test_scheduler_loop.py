"""The record loop's bookkeeping (scheduler/loop.py, scheduler/classify.py) on a tiny random Llama: the progress
callback, the pass counters, and the stored prefix built only by a mode that
feeds records after it. What each record's scores are is guarded by test_scheduler_invariants.py.
"""

from __future__ import annotations

import itertools
import types

import pytest

from prefixcache.cache.kv import PrefixKV
from prefixcache.scheduler import loop
from prefixcache.scheduler.classify import Classifier, Record, RunConfig, RunStats, records_from_texts, warmup
from prefixcache.types import Mode

from tests.support.models import tiny_loaded

TEXTS = ["refund please", "my card was charged twice for one order", "hi", "the app crashes on login", "ok"]


def test_progress_counts_every_record_once_including_a_failed_one(tiny_llama, task):
    ticks: list[int] = []
    records = [*records_from_texts(TEXTS), Record("bad", {"body": "no text field"})]
    predictions = Classifier(tiny_llama, task).classify_all(records, RunConfig("batched", 2), progress=ticks.append)
    assert len(predictions) == 6 and predictions[-1].error
    assert sum(ticks) == 6 and all(n >= 1 for n in ticks)


@pytest.mark.parametrize("mode, batch, per_batch", [("batched", 2, [2, 2, 1]), ("cached", 4, [1] * 5), ("batched", 8, [5])])
def test_each_forward_pass_is_counted_once_with_its_records(tiny_llama, task, mode, batch, per_batch):
    stats = RunStats()
    Classifier(tiny_llama, task).classify_all(records_from_texts(TEXTS), RunConfig(mode, batch), stats=stats)
    assert stats.forward_passes == len(per_batch) and stats.per_batch == per_batch
    assert stats.records == 5 and stats.errors == 0
    assert stats.seconds > 0, "the run's time is added up, not taken away"


@pytest.fixture
def builds(monkeypatch) -> list[int]:
    """The token count of every prefix the decoder builds (``PrefixKV.build``)."""
    calls: list[int] = []
    real = PrefixKV.build.__func__

    def spy(cls, model, token_ids):
        calls.append(len(token_ids))
        return real(cls, model, token_ids)

    monkeypatch.setattr(PrefixKV, "build", classmethod(spy))
    return calls


@pytest.mark.parametrize("mode", ["full", "batched"])
def test_the_stored_prefix_is_built_only_by_a_mode_that_feeds_after_it(tiny_llama, task, builds, mode):
    """``full`` re-encodes every prompt: building the stored prefix (or looking it up in a pool) would cost a
    prefix's pass for nothing. ``batched`` builds it once, however many windows it runs."""
    classifier = Classifier(tiny_llama, task)
    results = classifier.classify_all(records_from_texts(TEXTS[:3]), RunConfig(mode, window=1))
    assert [r.label is not None for r in results] == [True, True, True]
    assert builds == ([] if mode == "full" else [len(classifier.prompt.prefix_ids)])


LONG = Record("long", {"text": "refund " * 600})  # past the tiny models' 512-token context


def test_errors_and_context_overflows_add_up_over_windows(tiny_llama, task):
    """Counters add across windows (the failures are all in the first of three), and each failed record
    keeps its own id and says why."""
    stats = RunStats()
    records = [Record("bad", {"body": "x"}), LONG, *records_from_texts(TEXTS[:4])]
    predictions = Classifier(tiny_llama, task).classify_all(records, RunConfig("batched", 2, window=2), stats=stats)
    assert [p.id for p in predictions] == ["bad", "long", 0, 1, 2, 3]
    assert "'text'" in predictions[0].error and "too long" in predictions[1].error
    assert (stats.records, stats.errors, stats.context_overflows) == (6, 2, 1)


def test_a_record_cut_to_fit_is_scored_and_marked_truncated(tiny_llama, task):
    stats = RunStats()
    config = RunConfig("batched", 2, overflow="truncate")
    cut, whole = Classifier(tiny_llama, task).classify_all([LONG, *records_from_texts(TEXTS[:1])], config, stats=stats)
    assert cut.error is None and cut.label is not None and cut.truncated and cut.warning
    assert whole.label is not None and not whole.truncated
    assert (stats.errors, stats.context_overflows) == (0, 0)


def test_full_scoring_keeps_room_in_the_context_for_the_longest_labels_tokens(tiny_llama, task):
    """Under ``full`` the label tokens but the first follow the record (3 more for 'account' here), so a record
    that only just fits for first-token scoring must not fit for ``full``: it is refused before any pass."""
    first, full = Classifier(tiny_llama, task, "first-token"), Classifier(tiny_llama, task, "full")
    config = RunConfig("batched")

    def refused(classifier, words):
        (item,) = classifier.prepare([Record("r", {"text": "refund " * words})], config)
        return item.overflowed

    words = next(n for n in range(1, 1000) if refused(first, n + 1))  # the most that first-token takes
    (item,) = first.prepare([Record("r", {"text": "refund " * words})], config)
    assert len(item.rows) + len(first.prompt.prefix_ids) >= 512 - 2, "one word more must be at most 3 tokens"
    assert refused(full, words)
    assert not refused(full, words - 4)  # 4 words are at least 4 tokens: room for the 3


def test_a_model_whose_config_turns_the_cache_off_still_scores_cached_as_full(task):
    """Some checkpoints ship ``use_cache: false`` in their config. The passes that continue a fork (the
    record's tokens, then its label tokens under ``full``) must append to it anyway, or the label tokens
    would see the prefix without the record."""
    loaded = tiny_loaded("llama", seed=3)
    loaded.model.config.use_cache = False
    classifier = Classifier(loaded, task, "full")
    records = records_from_texts(TEXTS)
    cached = classifier.classify_all(records, RunConfig("batched", 4))
    full = classifier.classify_all(records, RunConfig("full", 1))
    for c, f in zip(cached, full):
        assert not c.boundary_fallback
        assert c.scores.labels == f.scores.labels
        assert max(abs(a - b) for a, b in zip(c.scores.logprobs, f.scores.logprobs)) < 1e-4, (c.scores, f.scores)


@pytest.mark.parametrize("mode", ["full", "cached"])
def test_the_prefix_build_time_is_reported_by_the_modes_that_use_the_prefix(tiny_llama, task, mode):
    stats = RunStats()
    classifier = Classifier(tiny_llama, task)
    assert classifier.last_lookup is None  # no pool: Ray's summary reads None as "built here"
    classifier.classify_all(records_from_texts(TEXTS[:2]), RunConfig(mode), stats=stats)
    assert classifier.last_lookup is None
    if mode == "full":
        assert stats.prefix_seconds == 0.0 and classifier.prefix_seconds == 0.0
    else:
        assert stats.prefix_seconds == classifier.prefix_seconds > 0


def test_records_are_read_one_window_at_a_time(tiny_llama, task):
    """The input is pulled a window at a time, so a million-row file is never held whole."""
    pulled: list[int] = []

    def source():
        for i, record in enumerate(records_from_texts(TEXTS)):
            pulled.append(i)
            yield record

    predictions = Classifier(tiny_llama, task).classify(source(), RunConfig("batched", 2, window=2))
    next(predictions)
    assert pulled == [0, 1]
    assert len(list(predictions)) == 4 and pulled == [0, 1, 2, 3, 4]


def test_the_run_time_adds_every_windows_time(tiny_llama, task, monkeypatch):
    """On a clock that ticks once per reading, each window spans one tick: three windows, three ticks."""
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=itertools.count().__next__))
    stats = RunStats()
    Classifier(tiny_llama, task).classify_all(records_from_texts(TEXTS), RunConfig("batched", 2, window=2), stats=stats)
    assert stats.seconds == 3


def test_batches_of_two_or_more_are_planned_shortest_first(tiny_llama, task):
    """Sorting by length cuts the padding of each padded pass: the rows of each batch are of like length."""
    classifier = Classifier(tiny_llama, task)
    texts = ["a b c d e f g h i j k l", "hi", "a b c d e f", "ok", "a b c"]
    items = classifier.prepare(records_from_texts(texts), RunConfig("batched"))
    lengths = [[len(it.rows) for it in batch] for _, batch in classifier.plan(items, 2, classifier.prefix)]
    flat = [n for batch in lengths for n in batch]
    assert flat == sorted(flat) and [len(b) for b in lengths] == [2, 2, 1]


def test_a_row_the_reader_marked_bad_is_answered_with_its_error_and_the_rows_after_it_still_run(tiny_llama, task):
    broken = Record("line 2", {}, error="line 2: not valid JSON")
    records = [Record("line 1", {"text": TEXTS[0]}), broken, *(Record(f"line {i}", {"text": TEXTS[i]}) for i in (3, 4))]
    predictions = Classifier(tiny_llama, task).classify_all(records, RunConfig("batched", 2))
    assert [p.id for p in predictions] == ["line 1", "line 2", "line 3", "line 4"]
    assert predictions[1].error == "line 2: not valid JSON" and predictions[1].label is None
    assert all(p.error is None and p.label is not None for p in (predictions[0], *predictions[2:]))


def test_warmup_runs_one_batched_record_with_every_field_of_the_task_to_the_end(tiny_llama, task):
    """``warmup`` (what the bench and the evaluator run before timing) builds the prefix and scores one record
    that fills each of the task's fields, in the batched mode the timed runs use, and reads its result."""
    classifier = Classifier(tiny_llama, task)
    calls, answered = [], []
    real = classifier.classify

    def spy(records, config=RunConfig(), **kw):
        records = list(records)
        calls.append((records, config))
        for prediction in real(records, config, **kw):
            answered.append(prediction)
            yield prediction

    classifier.classify = spy
    warmup(classifier)
    [(records, config)] = calls
    assert [set(r.fields) for r in records] == [set(task.fields)]
    assert all(isinstance(v, str) and v for v in records[0].fields.values()), records[0].fields
    assert config.mode is Mode.BATCHED
    assert len(answered) == 1 and answered[0].error is None, "the warm-up result was not read to the end"
