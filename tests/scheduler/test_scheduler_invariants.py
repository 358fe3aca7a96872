"""Invariants 1 and 2 on tiny random models: cached == full, and the stored prefix never changes."""

from __future__ import annotations

import threading

import pytest
import torch

from prefixcache.engine import forward as engine
from prefixcache.scheduler.classify import Classifier, Record, RunConfig, RunStats, records_from_texts
from prefixcache.eval.verify import compare

from tests.support.checks import assert_cached_path_ran

TOL = 1e-4


def _run(classifier, texts, mode, batch, stats=None):
    return classifier.classify_all(records_from_texts(texts), RunConfig(mode, batch), stats=stats)


def _run_checked(classifier, texts, mode, batch):
    """A cached or batched run that must have fed every record after the stored prefix (none of ``texts``
    crosses the boundary), computing exactly the records' suffix tokens."""
    stats = RunStats()
    predictions = _run(classifier, texts, mode, batch, stats)
    assert not any(p.boundary_fallback for p in predictions), f"{mode} b={batch}: a record fell back to full"
    assert stats.boundary_fallbacks == 0, f"{mode} b={batch}: stats count {stats.boundary_fallbacks} boundary fallbacks"
    assert_cached_path_ran(classifier, records_from_texts(texts), predictions, stats)
    return predictions


@pytest.fixture
def packed_passes(monkeypatch) -> list[int]:
    """Records the number of rows of every packed forward pass (``engine.last_hidden_packed``)."""
    calls: list[int] = []
    real = engine.last_hidden_packed

    def spy(model, prefix, rows):
        calls.append(len(rows))
        return real(model, prefix, rows)

    monkeypatch.setattr(engine, "last_hidden_packed", spy)
    return calls


def _assert_path(method, packed_passes):
    """First-token scoring of rows of unequal length must take the packed path; ``full`` never does."""
    if method == "first-token":
        assert any(n > 1 for n in packed_passes), f"no packed pass of several rows ran (passes: {packed_passes})"
    else:
        assert not packed_passes, f"method full should run padded rows, but packed passes ran: {packed_passes}"


@pytest.mark.parametrize("method", ["first-token", "full"])
@pytest.mark.parametrize("batch", [1, 2, 7])
def test_cached_equals_full(tiny, task, texts, method, batch):
    classifier = Classifier(tiny, task, method)
    reference = _run(classifier, texts, "full", 1)
    mode = "cached" if batch == 1 else "batched"
    candidate = _run_checked(classifier, texts, mode, batch)
    agreement = compare(reference, candidate)
    assert agreement.ok, f"{mode} b={batch} disagrees with full re-encoding on ids {agreement.disagreeing_ids}"
    assert agreement.max_abs_logprob_diff < TOL, f"log-probs drift by {agreement.max_abs_logprob_diff:.2e} (> {TOL})"


def test_suffixes_really_have_unequal_lengths(tiny, task, texts):
    classifier = Classifier(tiny, task)
    encoded = classifier.prompt.encode(tiny.tokenizer, [classifier.prompt.suffix_text({"text": t}) for t in texts])
    lengths = {len(e.suffix_ids) for e in encoded}
    assert len(lengths) >= 5, f"the test texts should exercise padding, got suffix lengths {sorted(lengths)}"


def test_scores_are_normalized_over_labels(tiny, task, texts):
    classifier = Classifier(tiny, task, "full")
    for prediction in _run(classifier, texts, "batched", 4):
        total = sum(prediction.scores.probabilities.values())
        assert abs(total - 1.0) < 1e-6, f"probabilities of record {prediction.id} sum to {total}"
        assert prediction.scores.margin >= 0


@pytest.mark.parametrize("method", ["first-token", "full"])
def test_prefix_is_never_mutated(tiny, task, texts, method):
    classifier = Classifier(tiny, task, method)
    before = classifier.prefix.checksum()
    keys_before = [k.clone() for k in classifier.prefix.keys]
    values_before = [v.clone() for v in classifier.prefix.values]
    _run_checked(classifier, texts, "batched", 3)
    _run_checked(classifier, texts, "cached", 1)
    assert classifier.prefix.checksum() == before, "a batch changed the stored prefix"
    for layer, (a, b) in enumerate(zip(keys_before, classifier.prefix.keys)):
        assert torch.equal(a, b), f"a batch changed the stored prefix keys of layer {layer}"
    for layer, (a, b) in enumerate(zip(values_before, classifier.prefix.values)):
        assert torch.equal(a, b), f"a batch changed the stored prefix values of layer {layer}"


@pytest.mark.parametrize("method", ["first-token", "full"])
def test_no_cross_talk_between_rows(tiny_llama, task, texts, method, packed_passes):
    """A record's scores do not depend on which other records share its batch: padded rows (``full``)
    or rows packed end to end (``first-token``, rows of unequal length)."""
    classifier = Classifier(tiny_llama, task, method)
    alone = {p.id: p.scores.logprobs for p in _run(classifier, texts, "cached", 1)}
    assert not packed_passes, f"single records should not be packed: {packed_passes}"
    noise = [Record(f"noise{j}", {"text": "x " * (j * 7)}) for j in range(6)]
    crowd = [Record(i, {"text": t}) for i, t in enumerate(texts)] + noise
    mixed = classifier.classify_all(crowd, RunConfig("batched", 5))
    _assert_path(method, packed_passes)
    assert {p.id for p in mixed} >= set(alone), "a record is missing from the mixed batch's output"
    for prediction in mixed:
        if prediction.id in alone:
            diff = max(abs(a - b) for a, b in zip(alone[prediction.id], prediction.scores.logprobs))
            assert diff < TOL, f"record {prediction.id} changed by {diff:.2e} when batched with others ({method})"


@pytest.mark.parametrize("method", ["first-token", "full"])
def test_concurrent_batches_do_not_share_state(tiny_llama, task, texts, method, packed_passes):
    classifier = Classifier(tiny_llama, task, method)
    expected = [p.scores.logprobs for p in _run(classifier, texts, "cached", 1)]
    assert not packed_passes, f"single records should not be packed: {packed_passes}"
    failures: list[str] = []

    finished: list[int] = []

    def worker(seed: int):
        order = texts[seed:] + texts[:seed]
        try:
            got = _run(classifier, order, "batched", 3)
        except Exception as exc:  # reported below: a thread's exception would otherwise vanish
            failures.append(f"thread {seed} raised {exc!r}")
            raise
        for i, prediction in enumerate(got):
            want = expected[(i + seed) % len(texts)]
            if max(abs(a - b) for a, b in zip(want, prediction.scores.logprobs)) > TOL:
                failures.append(f"thread {seed} record {i}")
        finished.append(seed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, f"concurrent runs diverged: {failures}"
    assert sorted(finished) == [0, 1, 2, 3], f"only threads {sorted(finished)} finished"
    _assert_path(method, packed_passes)


def test_output_keeps_input_order_and_ids(tiny_llama, task, texts):
    classifier = Classifier(tiny_llama, task)
    records = [Record(f"r{i}", {"text": t}) for i, t in enumerate(texts)]
    predictions = classifier.classify_all(records, RunConfig("batched", 4, window=4))
    assert [p.id for p in predictions] == [r.id for r in records]


def test_bad_record_gets_an_error_line_and_nothing_is_lost(tiny_llama, task):
    classifier = Classifier(tiny_llama, task)
    records = [Record("ok", {"text": "refund"}), Record("missing", {"body": "x"}), Record("num", {"text": ["a"]})]
    predictions = classifier.classify_all(records, RunConfig("batched", 8))
    assert [p.id for p in predictions] == ["ok", "missing", "num"]
    assert predictions[0].label is not None
    assert "missing" in predictions[1].error and "'text'" in predictions[1].error
    assert "'num'" in predictions[2].error and "'text'" in predictions[2].error
