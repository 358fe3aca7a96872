"""Invariants 1 and 2 on tiny random models: cached == full, and the stored prefix never changes."""

from __future__ import annotations

import threading

import pytest

from prefixcache.runner import Classifier, Record, RunConfig, records_from_texts
from prefixcache.verify import compare

TOL = 1e-4


def _run(classifier, texts, mode, batch):
    return classifier.classify_all(records_from_texts(texts), RunConfig(mode, batch))


@pytest.mark.parametrize("method", ["first-token", "full"])
@pytest.mark.parametrize("batch", [1, 2, 7])
def test_cached_equals_full(tiny, task, texts, method, batch):
    classifier = Classifier(tiny, task, method)
    reference = _run(classifier, texts, "full", 1)
    mode = "cached" if batch == 1 else "batched"
    candidate = _run(classifier, texts, mode, batch)
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
    _run(classifier, texts, "batched", 3)
    _run(classifier, texts, "cached", 1)
    assert classifier.prefix.checksum() == before, "a batch changed the stored prefix"
    for a, b in zip(keys_before, classifier.prefix.keys):
        assert (a == b).all()


def test_no_cross_talk_between_rows(tiny_llama, task, texts):
    """A record's scores do not depend on which other records share its batch."""
    classifier = Classifier(tiny_llama, task, "full")
    alone = {p.id: p.scores.logprobs for p in _run(classifier, texts, "cached", 1)}
    crowd = [Record(i, {"text": t}) for i, t in enumerate(texts)] + [Record(f"noise{j}", {"text": "x " * (j * 7)}) for j in range(6)]
    mixed = classifier.classify_all(crowd, RunConfig("batched", 5))
    for prediction in mixed:
        if prediction.id in alone:
            diff = max(abs(a - b) for a, b in zip(alone[prediction.id], prediction.scores.logprobs))
            assert diff < TOL, f"record {prediction.id} changed by {diff:.2e} when batched with others"


def test_concurrent_batches_do_not_share_state(tiny_llama, task, texts):
    classifier = Classifier(tiny_llama, task, "full")
    expected = [p.scores.logprobs for p in _run(classifier, texts, "batched", 4)]
    failures: list[str] = []

    def worker(seed: int):
        order = texts[seed:] + texts[:seed]
        got = _run(classifier, order, "batched", 3)
        for i, prediction in enumerate(got):
            want = expected[(i + seed) % len(texts)]
            if max(abs(a - b) for a, b in zip(want, prediction.scores.logprobs)) > TOL:
                failures.append(f"thread {seed} record {i}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, f"concurrent runs diverged: {failures}"


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
