"""A Classifier scoring through a fitted head (issue 15): the cached path equals full re-encoding through the
same head, labels that share first tokens need no continuation pass, and a head for another task is refused."""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.engine import forward
from prefixcache.engine.head import FittedHead
from prefixcache.engine.head_file import head_calibration
from prefixcache.errors import HeadMismatchError, PromptError
from prefixcache.eval.fit_head import fit_head
from prefixcache.eval.verify import compare, verify
from prefixcache.scheduler.classify import Classifier, RunConfig, records_from_texts
from prefixcache.scheduler.feature_pass import collect_features
from prefixcache.task.definition import parse_task

from tests.support.tasks import TASK_YAML
from tests.support.separable import FEATURE, separable_rows

TOL = 1e-4


@pytest.fixture(scope="module")
def head(tiny_llama, task) -> FittedHead:
    records, gold = separable_rows(60, seed=1)
    return fit_head(collect_features(tiny_llama, task, records, feature=FEATURE), gold, folds=3, on_prompt=True).head


@pytest.mark.parametrize("batch", [1, 2, 7])
def test_cached_through_a_head_equals_full_through_it(tiny_llama, task, texts, head, batch):
    classifier = Classifier(tiny_llama, task, head=head)
    reference = classifier.classify_all(records_from_texts(texts), RunConfig("full", 1))
    candidate = classifier.classify_all(records_from_texts(texts), RunConfig("cached" if batch == 1 else "batched", batch))
    agreement = compare(reference, candidate)
    assert agreement.ok, f"b={batch}: labels differ on {agreement.disagreeing_ids}"
    assert agreement.max_abs_logprob_diff < TOL, f"b={batch}: log-probs drift by {agreement.max_abs_logprob_diff:.2e}"


def test_verify_through_a_head(tiny_llama, task, texts, head):
    result = verify(Classifier(tiny_llama, task, head=head), records_from_texts(texts), RunConfig("batched", 4))
    assert result.agreement.ok and result.agreement.max_abs_logprob_diff < TOL


def test_scores_are_the_heads_probabilities(tiny_llama, task, head):
    records, _ = separable_rows(12, seed=5)
    predictions = Classifier(tiny_llama, task, head=head).classify_all(records, RunConfig("batched", 5))
    features = collect_features(tiny_llama, task, records, feature=FEATURE)
    expected = head_calibration(head).apply(head.log_probs(features.features, features.prompt_logprobs).numpy())
    got = np.array([p.scores.logprobs for p in predictions])
    assert np.abs(got - expected).max() < TOL
    assert [p.label for p in predictions] == head.predict(features.features, features.prompt_logprobs)


def test_a_head_runs_no_label_pass_even_when_labels_share_first_tokens(tiny_llama, monkeypatch):
    task = parse_task("name: c\ninstruction: x\nlabels: {refund_request: a, refund_status: b, other: c}\n", "c.yaml")
    records = records_from_texts(["refund please", "where is my refund", "app crash", "hi"])
    features = collect_features(tiny_llama, task, records)
    gold = ["refund_request", "refund_status", "other", "other"]
    fitted = fit_head(features, gold, folds=2).head
    calls = []
    monkeypatch.setattr(forward, "score_whole_labels", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(forward, "score_per_label", lambda *a, **k: calls.append(1))
    monkeypatch.setattr("prefixcache.scheduler.classify.score_rows", lambda *a, **k: calls.append(1))
    predictions = Classifier(tiny_llama, task, head=fitted).classify_all(records, RunConfig("batched", 4))
    assert not calls, "a fitted head must not run the prompt's label scoring"
    assert all(p.scores is not None for p in predictions)


def test_a_head_for_another_prompt_or_labels_is_refused(tiny_llama, head):
    other = parse_task(TASK_YAML.replace("Classify the customer support ticket.", "Route it."), "o.yaml")
    with pytest.raises(HeadMismatchError, match="another prompt"):
        Classifier(tiny_llama, other, head=head)


def test_a_method_beside_a_head_is_refused(tiny_llama, task, head):
    with pytest.raises(PromptError) as refused:
        Classifier(tiny_llama, task, "full", head=head)
    assert str(refused.value) == ('method="full" scores with the prompt\'s label tokens; a fitted head scores instead: '
                                  'drop method, or drop the head')


@pytest.mark.parametrize("label_pass", ["trie", "per-label"])
def test_the_classifier_keeps_the_label_pass_asked_for(tiny_llama, task, label_pass):
    assert Classifier(tiny_llama, task, "full", label_pass=label_pass).head.label_pass == label_pass


def test_a_head_with_a_wrong_width_is_refused_before_running(tiny_llama, task, head):
    narrow = FittedHead(head.weight[:, :3], head.bias, head.prompt_scale, head.labels, head.feature, head.manifest)
    with pytest.raises(HeadMismatchError, match="reads 3 features"):
        Classifier(tiny_llama, task, head=narrow)
