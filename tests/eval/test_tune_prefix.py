"""Prefix tuning on tiny random models: the tuned prefix learns, is stored and read back bit for bit, is refused
for another model or task, and is served by the classifier, one record per pass equal to batched (the form
invariant 1 takes for a prefix that has no text to re-encode), through the pool and its disk tier too. The head
``fit --tune prefix`` writes with it by default is ``fit_head`` over the tuned prefix's states, calibrated on the
rows tuning held out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from prefixcache.cache.disk import DiskStore
from prefixcache.cache.config import PoolConfig
from prefixcache.cache.pool import PrefixPool
from prefixcache.engine.head_file import load_head, save_head
from prefixcache.engine.scoring import LabelScorer
from prefixcache.errors import HeadMismatchError, InputError
from prefixcache.eval import tune_refit
from prefixcache.eval.fit_head import fit_head
from prefixcache.eval.tune_config import RefitConfig, TuneConfig
from prefixcache.eval.tune_prefix import start_prefix, tune_prefix, tuned_manifest
from prefixcache.eval.tune_refit import refit_head, refit_manifest
from prefixcache.eval.verify import verify
from prefixcache.scheduler.classify import Classifier
from prefixcache.scheduler.feature_pass import collect_features, own_rows, tuned_prefix
from prefixcache.task.definition import parse_task
from prefixcache.types import DEFAULT_FEATURE, Mode, Record, RunConfig
from tests.support.tasks import LABELS, TASK_YAML

# Each label is carried by a word no other label's rows use, said last, so a prefix (and head) can learn it on a
# random model.
WORDS = {"billing": ["refund"], "technical": ["crash"], "account": ["password"]}
FILLER = ["please", "help", "today", "again", "now", "my", "the", "it"]


def labelled(count: int, seed: int) -> list[Record]:
    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        label = LABELS[i % len(LABELS)]
        words = [str(w) for w in rng.choice(FILLER, size=int(rng.integers(1, 5)))] + [str(rng.choice(WORDS[label]))]
        records.append(Record(f"r{i}", {"text": " ".join(words), "label": label}))
    return records


def tune(loaded, task, records, config=TuneConfig(epochs=20, lr=1e-2, head_lr=1e-2, batch_size=8, patience=20)):
    own = own_rows(loaded, task, records)
    scorer = LabelScorer(loaded.model, own.prompt, "first-token")
    gold = np.array([LABELS.index(r.fields["label"]) for r in records])
    tuned = tune_prefix(loaded, scorer, own.prompt.prefix_ids, own.rows, gold, config)
    tuned.head.manifest.update(tuned_manifest(tuned, loaded, own, config, task.name))
    return tuned


@pytest.fixture(scope="module")
def tuned_llama(tiny_llama, task):
    return tune(tiny_llama, task, labelled(90, seed=0))


def test_tuning_changes_the_prefix_and_learns_what_the_untuned_prompt_does_not(tiny_llama, task, tuned_llama):
    own = own_rows(tiny_llama, task, labelled(3, seed=1))
    start = start_prefix(tiny_llama, own.prompt.prefix_ids, None)
    tuned = tuned_llama.head.prefix
    assert tuned.token_ids == start.token_ids, "a whole-length tuned prefix keeps the prompt's tokens (its positions)"
    assert tuned.checksum() != start.checksum(), "training left the prefix as it was"
    first, last = tuned_llama.epochs[0], tuned_llama.epochs[-1]
    assert last.train_loss < first.train_loss, f"the training loss did not fall: {[e.train_loss for e in tuned_llama.epochs]}"
    assert tuned_llama.heldout_accuracy >= tuned_llama.start_accuracy + 0.2, (
        f"held out: tuned {tuned_llama.heldout_accuracy:.0%}, at the start {tuned_llama.start_accuracy:.0%}")


def test_a_tuned_prefix_classifies_unseen_rows_better_than_the_untuned_prompt(tiny_llama, task, tuned_llama):
    unseen = labelled(60, seed=7)
    gold = [r.fields["label"] for r in unseen]
    config = RunConfig(Mode.BATCHED, 8)
    prompt = [p.label for p in Classifier(tiny_llama, task).classify_all(unseen, config)]
    tuned = [p.label for p in Classifier(tiny_llama, task, head=tuned_llama.head).classify_all(unseen, config)]
    right = lambda labels: np.mean([a == b for a, b in zip(labels, gold)])  # noqa: E731
    assert right(tuned) > right(prompt) + 0.15, f"tuned {right(tuned):.0%}, prompt {right(prompt):.0%}"


def test_the_head_file_stores_the_tuned_prefix_bit_for_bit(tuned_llama, tmp_path):
    path = save_head(tuned_llama.head, tmp_path / "tuned.safetensors")
    loaded = load_head(path)
    assert loaded.tuned and loaded.prefix.checksum() == tuned_llama.head.prefix.checksum()
    assert loaded.digest() == tuned_llama.head.digest()
    assert loaded.manifest["tuned"]["best_epoch"] == tuned_llama.best_epoch
    assert save_head(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes(), "saving is not deterministic"


def test_a_tuned_prefix_for_another_model_or_task_is_refused(tuned_llama, tiny_qwen2, tiny_llama, task):
    with pytest.raises(HeadMismatchError, match="model"):
        Classifier(tiny_qwen2, task, head=tuned_llama.head)
    other = parse_task(TASK_YAML.replace("Classify the customer support ticket.", "Sort the ticket."), "other.yaml")
    with pytest.raises(HeadMismatchError, match="prompt"):
        Classifier(tiny_llama, other, head=tuned_llama.head)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(alphabet="abcdefgh xyz", min_size=0, max_size=40), min_size=1, max_size=9),
       batch=st.sampled_from([2, 7]))
def test_one_record_per_pass_equals_the_batched_path(tiny_llama, task, tuned_llama, texts, batch):
    records = [Record(i, {"text": t}) for i, t in enumerate(texts)]
    classifier = Classifier(tiny_llama, task, head=tuned_llama.head)
    before = tuned_llama.head.prefix.checksum()
    alone = classifier.classify_all(records, RunConfig(Mode.CACHED, 1))
    together = classifier.classify_all(records, RunConfig(Mode.BATCHED, batch))
    assert [p.label for p in alone] == [p.label for p in together]
    for a, b in zip(alone, together):
        assert np.allclose(a.scores.logprobs, b.scores.logprobs, atol=1e-4), (a.id, a.scores.logprobs, b.scores.logprobs)
    assert tuned_llama.head.prefix.checksum() == before, "serving changed the tuned prefix"


def test_the_pool_holds_a_tuned_prefix_under_its_own_key_and_reads_it_back_from_disk(tiny_llama, task, tuned_llama, tmp_path):
    records = labelled(9, seed=3)
    store = DiskStore(tmp_path / "prefixes")
    plain = Classifier(tiny_llama, task, pool=PrefixPool(PoolConfig(), store))
    fitted = Classifier(tiny_llama, task, pool=PrefixPool(PoolConfig(), store), head=tuned_llama.head)
    plain.classify_all(records, RunConfig(Mode.BATCHED, 4))
    first = fitted.classify_all(records, RunConfig(Mode.BATCHED, 4))
    assert fitted.last_lookup.source == "tuned" and fitted.last_lookup.key != plain.last_lookup.key
    reread = Classifier(tiny_llama, task, pool=PrefixPool(PoolConfig(), store), head=tuned_llama.head)
    again = reread.classify_all(records, RunConfig(Mode.BATCHED, 4))
    assert reread.last_lookup.source == "disk"
    assert reread.prefix.checksum() == tuned_llama.head.prefix.checksum(), "the disk tier gave back another prefix"
    assert [p.scores.logprobs for p in again] == [p.scores.logprobs for p in first]


def test_full_re_encoding_is_refused_per_record_under_a_tuned_prefix(tiny_llama, task, tuned_llama):
    (prediction,) = Classifier(tiny_llama, task, head=tuned_llama.head).classify_all(labelled(1, 0), RunConfig(Mode.FULL, 1))
    assert prediction.label is None and "tuned prefix has no text to re-encode" in prediction.error
    assert "'r0'" in prediction.error


def test_a_shorter_tuned_prefix_keeps_the_first_token_and_the_lead_in(tiny_llama, task):
    tuned = tune(tiny_llama, task, labelled(12, 2), TuneConfig(epochs=1, batch_size=4, virtual_tokens=6))
    prompt_ids = own_rows(tiny_llama, task, labelled(1, 0)).prompt.prefix_ids
    assert tuned.head.prefix.token_ids == (prompt_ids[0], *prompt_ids[-5:])
    predictions = Classifier(tiny_llama, task, head=tuned.head).classify_all(labelled(5, 9), RunConfig(Mode.BATCHED, 5))
    assert all(p.error is None and p.label in LABELS for p in predictions)


def test_tuning_settings_and_rows_are_checked(tiny_llama, task):
    with pytest.raises(InputError, match="virtual tokens"):
        TuneConfig(virtual_tokens=1)
    with pytest.raises(InputError, match="holdout"):
        TuneConfig(holdout=1.0)
    with pytest.raises(InputError, match="at least 4"):
        tune(tiny_llama, task, labelled(3, 0), TuneConfig(epochs=1))


def test_tuning_is_deterministic_for_a_seed(tiny_llama, task):
    config = TuneConfig(epochs=1, batch_size=4, seed=3)
    a, b = (tune(tiny_llama, task, labelled(12, 5), config) for _ in range(2))
    assert a.head.digest() == b.head.digest()
    assert torch.equal(a.head.weight, b.head.weight)


def test_suggest_reads_features_through_the_tuned_prefix_from_a_store_of_their_own(tiny_llama, task, tuned_llama, tmp_path):
    from prefixcache.scheduler.feature_pass import collect_features, tuned_prefix
    from prefixcache.scheduler.feature_store import stored_features

    records = labelled(6, seed=4)
    through_head, ran = stored_features(tiny_llama, task, records, tmp_path, feature=tuned_llama.head)
    plain, _ = stored_features(tiny_llama, task, records, tmp_path, feature="last")
    direct = collect_features(tiny_llama, task, records, feature="last", tuned=tuned_prefix(tuned_llama.head))
    assert ran == 6 and len(list(tmp_path.iterdir())) == 2, "the tuned prefix's features need a store of their own"
    assert np.allclose(through_head.features, direct.features, atol=1e-5)
    assert not np.allclose(through_head.features, plain.features, atol=1e-3)


def test_tuning_makes_its_tensors_on_the_models_device_not_torchs_default(tiny_llama, task):
    """With meta as torch's default device, tuning on the CPU model gives what it gives with the CPU as default: every
    tensor it makes follows the model (so a GPU model tunes on its GPU)."""
    config = TuneConfig(epochs=1, batch_size=4, seed=1)
    expected = tune(tiny_llama, task, labelled(12, 6), config).head.digest()
    torch.set_default_device("meta")
    try:
        got = tune(tiny_llama, task, labelled(12, 6), config).head.digest()
    finally:
        torch.set_default_device("cpu")
    assert got == expected


@pytest.fixture(scope="module")
def refitted(tiny_llama, task, tuned_llama):
    """The head ``fit --tune prefix`` writes by default, over ``tuned_llama``'s prefix and rows, with its manifest."""
    records = labelled(90, seed=0)
    gold = [r.fields["label"] for r in records]
    refit = refit_head(tiny_llama, task, records, gold, tuned_llama, RefitConfig(folds=3))
    refit.tuned.head.manifest.update(refit_manifest(refit, tuned_llama.head.manifest))
    return refit


def test_the_refitted_head_is_fit_head_over_the_tuned_prefixs_states(tiny_llama, task, tuned_llama, refitted):
    records = labelled(90, seed=0)
    gold = [r.fields["label"] for r in records]
    head = refitted.tuned.head
    assert head.prefix is tuned_llama.head.prefix, "refitting the head changed or dropped the tuned prefix"
    through_tuned = collect_features(tiny_llama, task, records, feature=DEFAULT_FEATURE,
                                     tuned=tuned_prefix(tuned_llama.head))
    assert torch.equal(head.weight, fit_head(through_tuned, gold, folds=3).head.weight)
    untuned = fit_head(collect_features(tiny_llama, task, records), gold, folds=3).head
    assert not torch.allclose(head.weight, untuned.weight, atol=1e-3), "fitted on the untuned prompt's states"
    assert (head.feature, head.prompt_scale) == (through_tuned.feature, 0.0), "not fit's head (default feature)"
    assert (tuned_llama.head.feature, tuned_llama.head.prompt_scale) == ("last", 1.0)
    assert head.manifest["tuned"]["head"] == "refitted" and tuned_llama.head.manifest["tuned"]["head"] == "joint"


def test_the_refitted_heads_calibration_is_fitted_on_the_held_out_rows_by_a_head_not_fitted_on_them(
        tiny_llama, task, tuned_llama, monkeypatch):
    seen = []
    real = tune_refit.split_log_probs

    def spy(features, y, train, scored, C, **kw):
        seen.append((set(train.tolist()), set(scored.tolist())))
        return real(features, y, train, scored, C, **kw)

    monkeypatch.setattr(tune_refit, "split_log_probs", spy)
    records = labelled(90, seed=0)
    gold = [r.fields["label"] for r in records]
    refit = refit_head(tiny_llama, task, records, gold, tuned_llama, RefitConfig(folds=3))
    ((train, scored),) = seen
    assert scored == set(tuned_llama.heldout.tolist()) and not train & scored and len(train | scored) == 90
    assert len(refit.tuned.correct) == len(tuned_llama.heldout), "calibrated on other rows than the held-out ones"
    manifest = refit_manifest(refit, tuned_llama.head.manifest)
    assert len(manifest["oof"]["correct"]) == len(tuned_llama.heldout) == manifest["cv"]["heldout_rows"]
    assert manifest["cv"]["accuracy"] == pytest.approx(float(np.mean(manifest["oof"]["correct"])))


def test_the_refitted_head_classifies_unseen_rows_better_than_the_untuned_prompt(tiny_llama, task, refitted):
    unseen = labelled(60, seed=7)
    gold = [r.fields["label"] for r in unseen]
    config = RunConfig(Mode.BATCHED, 8)
    prompt = [p.label for p in Classifier(tiny_llama, task).classify_all(unseen, config)]
    refit = [p.label for p in Classifier(tiny_llama, task, head=refitted.tuned.head).classify_all(unseen, config)]
    right = lambda labels: np.mean([a == b for a, b in zip(labels, gold)])  # noqa: E731
    assert right(refit) > right(prompt) + 0.15, f"refitted {right(refit):.0%}, prompt {right(prompt):.0%}"


def test_the_refitted_file_is_refused_elsewhere_and_verifies(tiny_llama, tiny_qwen2, task, refitted, tmp_path):
    head = load_head(save_head(refitted.tuned.head, tmp_path / "refitted.safetensors"))
    assert head.prefix.checksum() == refitted.joint.head.prefix.checksum(), "the file's prefix is not the tuned one"
    with pytest.raises(HeadMismatchError, match="model"):
        Classifier(tiny_qwen2, task, head=head)
    other = parse_task(TASK_YAML.replace("Classify the customer support ticket.", "Sort the ticket."), "other.yaml")
    with pytest.raises(HeadMismatchError, match="prompt"):
        Classifier(tiny_llama, other, head=head)
    checked = verify(Classifier(tiny_llama, task, head=head), labelled(12, seed=8), RunConfig(Mode.BATCHED, 4))
    assert checked.ok and checked.reference == "cached" and checked.stored_prefix_equal is True
