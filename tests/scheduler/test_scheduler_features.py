"""Feature collection (issue 15): a record's features are the same whether it ran in a batch over the cached
prefix or was re-encoded in full; records crossing the boundary fall back; failed records are kept."""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.engine.features import FeatureSpec
from prefixcache.errors import InputError
from prefixcache.scheduler.classify import Classifier, Record, RunConfig, records_from_texts
from prefixcache.scheduler.feature_pass import collect_features
from prefixcache.task.definition import parse_task

from tests.support.tasks import TASK_YAML

TOL = 1e-4


@pytest.mark.parametrize("feature", ["last", "mean", "last@1", "mean@0+last"])
@pytest.mark.parametrize("batch", [1, 2, 7])
def test_batched_features_equal_full_reencoding(tiny, task, texts, feature, batch):
    records = records_from_texts(texts)
    reference = collect_features(tiny, task, records, feature=feature, config=RunConfig("full", 1))
    candidate = collect_features(tiny, task, records, feature=feature, config=RunConfig(batch_size=batch))
    assert candidate.ids == reference.ids == list(range(len(texts)))
    hidden = tiny.model.config.hidden_size
    assert candidate.features.shape == (len(texts), FeatureSpec.parse(feature).width(hidden))
    assert candidate.features.dtype == np.float32
    drift = np.abs(candidate.features - reference.features).max()
    assert drift < TOL, f"{feature} b={batch}: features drift from full re-encoding by {drift:.2e}"
    lp_drift = np.abs(candidate.prompt_logprobs - reference.prompt_logprobs).max()
    assert lp_drift < TOL, f"prompt log-probs drift by {lp_drift:.2e}"


def test_features_differ_between_pools_and_layers(tiny_llama, task, texts):
    """The parts really read different states (a spec that silently mapped to one state would pass the test above)."""
    records = records_from_texts(texts)
    got = {f: collect_features(tiny_llama, task, records, feature=f).features for f in ("last", "mean", "last@1", "last@2")}
    assert np.abs(got["last"] - got["mean"]).max() > 1e-3
    assert np.abs(got["last"] - got["last@1"]).max() > 1e-3
    assert np.abs(got["last"] - got["last@2"]).max() < TOL, "last@N (N = layers) is the final, normed state"
    both = collect_features(tiny_llama, task, records, feature="last+mean").features
    assert np.array_equal(both, np.concatenate([got["last"], got["mean"]], axis=1))


def test_prompt_logprobs_equal_the_classifiers_scores(tiny, task, texts):
    records = records_from_texts(texts)
    features = collect_features(tiny, task, records, config=RunConfig(batch_size=4))
    predictions = Classifier(tiny, task, "first-token").classify_all(records, RunConfig("batched", 4))
    expected = np.array([p.scores.logprobs for p in predictions], dtype=np.float32)
    assert features.labels == tuple(task.labels)
    assert np.abs(features.prompt_logprobs - expected).max() < TOL
    assert np.allclose(np.exp(features.prompt_logprobs).sum(axis=1), 1.0, atol=1e-5)


def test_labels_sharing_a_first_token_are_tied_not_refused(tiny_llama):
    task = parse_task("name: c\ninstruction: x\nlabels: {refund_request: a, refund_status: b, other: c}\n", "c.yaml")
    features = collect_features(tiny_llama, task, records_from_texts(["refund please", "app crash"]))
    lp = features.prompt_logprobs
    assert np.array_equal(lp[:, 0], lp[:, 1]), "labels with one first token must score alike"


def test_crossing_records_fall_back_to_full_and_match_it(tiny_llama):
    task = parse_task(TASK_YAML.replace('"Ticket: {text}"', '"Ticket: pass{text}"'), "t.yaml")
    records = [Record("cross", {"text": "word reset mail never arrives"}), Record("plain", {"text": " reset mail"})]
    prompt = Classifier(tiny_llama, task).prompt
    encoded = prompt.encode(tiny_llama.tokenizer, [prompt.suffix_text(r.fields) for r in records])
    assert [e.suffix_ids is None for e in encoded] == [True, False], "the fixture must have one crossing record"
    for feature in ("last", "mean", "last@1"):
        reference = collect_features(tiny_llama, task, records, feature=feature, config=RunConfig("full"))
        candidate = collect_features(tiny_llama, task, records, feature=feature, config=RunConfig(batch_size=2))
        assert np.abs(candidate.features - reference.features).max() < TOL, feature


def test_failed_records_are_kept_in_errors(tiny_llama, task):
    records = [Record("ok", {"text": "refund"}), Record("bad", {"other": "x"}), Record("broken", {}, error="line 3: bad JSON")]
    features = collect_features(tiny_llama, task, records)
    assert features.ids == ["ok"]
    assert set(features.errors) == {"bad", "broken"}
    assert "text" in features.errors["bad"] and "bad JSON" in features.errors["broken"]
    assert features.features.shape[0] == 1
    with pytest.raises(InputError, match=r"2 training row\(s\) cannot be run: 'bad': .*text.*'broken': .*bad JSON"):
        features.require_complete("training row")
    ok = collect_features(tiny_llama, task, records[:1])
    assert ok.require_complete() is ok


def test_too_long_records_are_errors_named_by_id(tiny_llama, task):
    long = Record("long", {"text": "refund " * 400})
    features = collect_features(tiny_llama, task, [long, Record("short", {"text": "hi"})])
    assert features.ids == ["short"] and "long" in features.errors and "context" in features.errors["long"]


def test_identity_and_prefix_hash_are_recorded(tiny_llama, task):
    features = collect_features(tiny_llama, task, records_from_texts(["hi"]))
    other = parse_task(TASK_YAML.replace("Classify the customer support ticket.", "Sort the ticket."), "o.yaml")
    assert features.model_identity == tiny_llama.identity
    assert features.prefix_hash != collect_features(tiny_llama, other, records_from_texts(["hi"])).prefix_hash
    assert len(features.prefix_hash) == 64


@pytest.mark.parametrize("bad", ["", "first", "last@", "mean@x", "last+last", "last@99", "mean@3/0", "mean@5/4", "last@1+last@1/2"])
def test_bad_feature_specs_are_refused(tiny_llama, task, bad):
    with pytest.raises(InputError, match="feature"):
        collect_features(tiny_llama, task, records_from_texts(["hi"]), feature=bad)


@pytest.mark.parametrize(("text", "layers", "resolved"), [
    ("mean@3/4", 30, "mean@22"), ("last+mean@3/4", 2, "last+mean@1"), ("mean@1/2", 2, "mean@1"),
    ("last@0/4", 30, "last@0"), ("mean@4/4", 30, "mean@30"), ("last+mean@15", 30, "last+mean@15"),
])
def test_depth_fractions_resolve_to_absolute_layers(text, layers, resolved):
    """``@P/Q`` is layer floor(N * P / Q) of an N-layer model, so one spec (the default) fits every model."""

    class Config:
        num_hidden_layers = layers

        def get_text_config(self, decoder=True):
            return self

    class Model:
        config = Config()

    spec = FeatureSpec.parse(text)
    assert str(spec) == text, "the unresolved spec keeps its own spelling"
    assert str(spec.resolve(Model())) == resolved


def test_collected_features_name_the_resolved_layers(tiny_llama, task, texts):
    """A depth fraction reads the layer it resolves to, and the feature set (hence a head's manifest) names it."""
    records = records_from_texts(texts)
    relative = collect_features(tiny_llama, task, records, feature="last+mean@1/2")
    absolute = collect_features(tiny_llama, task, records, feature="last+mean@1")
    assert relative.feature == "last+mean@1"
    assert np.array_equal(relative.features, absolute.features)
    with pytest.raises(ValueError, match="resolve"):
        FeatureSpec.parse("mean@1/2").layers
