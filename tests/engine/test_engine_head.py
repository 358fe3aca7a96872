"""Fitted label heads (issue 15): fitting on separable rows, the head file, and refusing a head fitted for
something else. Tiny in-process models only."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from prefixcache.engine.head import FittedHead, fold_standardization
from prefixcache.engine.head_file import check, load_head, save_head, text_hash
from prefixcache.errors import HeadMismatchError, InputError
from prefixcache.eval.fit_curve import fit_curve, parse_shots
from prefixcache.eval.fit_head import fit_head
from prefixcache.scheduler.classify import Record, RunConfig
from prefixcache.scheduler.feature_pass import collect_features
from prefixcache.task.prompt import build_prompt
from prefixcache.task.definition import parse_task

from tests.support.models import tiny_loaded
from tests.support.separable import FEATURE, separable_rows
from tests.support.tasks import TASK_YAML


@pytest.fixture(scope="module")
def separable(tiny_llama, task):
    records, gold = separable_rows(90, seed=1)
    features = collect_features(tiny_llama, task, records, feature=FEATURE, config=RunConfig(batch_size=16))
    assert not features.errors
    return features, gold


@pytest.mark.parametrize("on_prompt", [False, True])
def test_a_head_on_separable_rows_is_right_on_every_held_out_row(tiny_llama, task, separable, on_prompt):
    features, gold = separable
    result = fit_head(features, gold, folds=5, on_prompt=on_prompt)
    assert result.cv_metrics is not None and result.cv_metrics.accuracy == 1.0, result.accuracy_by_C
    held_records, held_gold = separable_rows(30, seed=2)
    held = collect_features(tiny_llama, task, held_records, feature=FEATURE, config=RunConfig(batch_size=16))
    predicted = result.head.predict(held.features, held.prompt_logprobs)
    assert predicted == held_gold, f"held-out accuracy {np.mean(np.array(predicted) == held_gold):.2f}"
    assert (result.head.prompt_scale != 0) == on_prompt
    assert result.cv_metrics.records == len(gold) and result.folds == 5


def test_the_prompt_alone_is_not_already_perfect_on_these_rows(separable):
    """Else the test above would prove nothing about the fit."""
    features, gold = separable
    result = fit_head(features, gold, folds=2)
    assert result.prompt_metrics.accuracy < 0.9


def test_folded_standardization_equals_the_scikit_learn_pipeline(separable):
    features, gold = separable
    x = features.features.astype(np.float64)
    pipeline = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=500)).fit(x, gold)
    scaler, model = pipeline.steps[0][1], pipeline.steps[1][1]
    weight, bias = fold_standardization(model.coef_, model.intercept_, scaler.mean_, scaler.scale_)
    head = FittedHead(weight, bias, 0.0, tuple(model.classes_), FEATURE)
    expected = pipeline.predict_log_proba(x)
    assert np.abs(head.log_probs(features.features).numpy() - expected).max() < 1e-3


def test_an_on_prompt_head_without_correction_is_the_prompt(separable):
    features, _ = separable
    labels, width = features.labels, features.features.shape[1]
    head = FittedHead(torch.zeros(len(labels), width), torch.zeros(len(labels)), 1.0, labels, FEATURE)
    out = head.log_probs(features.features, features.prompt_logprobs).numpy()
    assert np.abs(out - features.prompt_logprobs).max() < 1e-5
    assert head.predict(features.features, features.prompt_logprobs) == [
        labels[j] for j in features.prompt_logprobs.argmax(axis=1)
    ]
    with pytest.raises(ValueError, match="prompt"):
        head.log_probs(features.features)


def test_save_load_save_is_byte_identical(tmp_path, separable):
    features, gold = separable
    head = fit_head(features, gold, folds=3, on_prompt=True).head
    first = save_head(head, tmp_path / "a.safetensors")
    loaded = load_head(first)
    second = save_head(loaded, tmp_path / "b.safetensors")
    assert first.read_bytes() == second.read_bytes()
    assert torch.equal(loaded.weight, head.weight) and torch.equal(loaded.bias, head.bias)
    assert loaded.prompt_scale == head.prompt_scale and loaded.labels == head.labels and loaded.feature == FEATURE
    manifest = loaded.manifest
    assert manifest["training"]["rows"] == len(gold)
    assert set(manifest["training"]["text_sha256"]) == set(features.text_hashes)
    assert manifest["cv"]["folds"] == 3 and manifest["cv"]["accuracy"] == 1.0
    assert set(manifest["versions"]) == {"prefixcache", "torch", "transformers", "scikit-learn"}
    assert np.array_equal(loaded.log_probs(features.features, features.prompt_logprobs).numpy(),
                          head.log_probs(features.features, features.prompt_logprobs).numpy())


def test_text_hash_normalizes_case_space_and_punctuation():
    assert text_hash({"text": "Refund  my MONEY!"}, ["text"]) == text_hash({"text": "refund my money"}, ["text"])
    assert text_hash({"text": "refund my money"}, ["text"]) != text_hash({"text": "refund my card"}, ["text"])


@pytest.fixture
def head_manifest(separable):
    features, gold = separable
    return fit_head(features, gold, folds=2).head.manifest


def test_the_head_passes_its_own_check(tiny_llama, task, head_manifest):
    check(head_manifest, tiny_llama, build_prompt(task, tiny_llama.tokenizer), list(task.labels), FEATURE)


def test_another_model_is_refused_by_name(tiny_llama, task, head_manifest):
    other = tiny_loaded("llama", seed=1)
    with pytest.raises(HeadMismatchError, match=r"another model \(model: the head expects 'tiny-llama-seed0', found 'tiny-llama-seed1'"):
        check(head_manifest, other, build_prompt(task, other.tokenizer), list(task.labels))


def test_another_prompt_is_refused_by_name(tiny_llama, head_manifest):
    task = parse_task(TASK_YAML.replace("Classify the customer support ticket.", "Route the ticket."), "t.yaml")
    with pytest.raises(HeadMismatchError, match=r"another prompt \(prompt: the head expects prefix sha256"):
        check(head_manifest, tiny_llama, build_prompt(task, tiny_llama.tokenizer), list(task.labels))


def test_another_label_set_is_refused_by_name(tiny_llama, task, head_manifest):
    prompt = build_prompt(task, tiny_llama.tokenizer)
    with pytest.raises(HeadMismatchError, match=r"another labels .*not in the task: \['account'\]; not in the head: \['access'\]"):
        check(head_manifest, tiny_llama, prompt, ["billing", "technical", "access"])
    with pytest.raises(HeadMismatchError, match="another order"):
        check(head_manifest, tiny_llama, prompt, ["technical", "billing", "account"])


def test_another_feature_is_refused_by_name(tiny_llama, task, head_manifest):
    with pytest.raises(HeadMismatchError, match=r"another feature \(feature: the head expects 'mean@0\+last', found 'last'\)"):
        check(head_manifest, tiny_llama, build_prompt(task, tiny_llama.tokenizer), list(task.labels), "last")


def test_several_differences_are_all_named(task, head_manifest):
    other = tiny_loaded("qwen2")
    with pytest.raises(HeadMismatchError, match="another model and labels"):
        check(head_manifest, other, build_prompt(task, other.tokenizer), ["a", "b", "c"])


def test_a_file_that_is_not_a_head_is_refused(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_head(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InputError, match="cannot be read"):
        load_head(tmp_path / "junk.safetensors")


def test_unknown_and_missing_labels_name_the_record(separable):
    features, gold = separable
    wrong = list(gold)
    wrong[4] = "shipping"
    with pytest.raises(InputError, match=r"record 'r1-4': label 'shipping' is not one of"):
        fit_head(features, wrong)
    only_two = ["billing" if g == "account" else g for g in gold]
    with pytest.raises(InputError, match=r"no training rows carry label\(s\) \['account'\]"):
        fit_head(features, only_two)
    with pytest.raises(InputError, match="record 'r1-0': no gold label"):
        fit_head(features, {})


def test_folds_are_capped_at_the_smallest_label(separable):
    features, gold = separable
    keep = [i for i, g in enumerate(gold) if g != "account"] + [i for i, g in enumerate(gold) if g == "account"][:3]
    from prefixcache.eval.fit_curve import subset

    result = fit_head(subset(features, keep), [gold[i] for i in keep], folds=5)
    assert result.folds == 3 and "capped at 3" in result.note


def test_curve_scores_three_scorers_on_held_out_rows(separable):
    features, gold = separable
    points = fit_curve(features, gold, parse_shots("1,2,all"), seed=0)
    assert [p.shots for p in points] == [1, 2, None]
    assert [p.rows for p in points[:2]] == [3, 6] and points[2].rows == 45
    assert len({p.prompt for p in points}) == 1, "the prompt alone does not depend on the rows fitted"
    assert points[-1].scratch == 1.0 and points[-1].on_prompt == 1.0
    assert all(0.0 <= v <= 1.0 for p in points for v in (p.prompt, p.scratch, p.on_prompt))


def test_curve_steps_are_parsed_or_refused():
    assert parse_shots("1, 2,5,10,ALL") == [1, 2, 5, 10, None]
    with pytest.raises(InputError, match="curve takes rows per label"):
        parse_shots("1,0")


def test_a_task_file_names_its_head_relative_to_itself(tmp_path):
    from prefixcache.task.definition import load_task

    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "t.yaml").write_text(TASK_YAML + "head: heads/t.head.safetensors\n")
    assert load_task(folder / "t.yaml").head == str(folder / "heads" / "t.head.safetensors")
    absolute = tmp_path / "elsewhere.safetensors"
    (folder / "a.yaml").write_text(TASK_YAML + f"head: {absolute}\n")
    assert load_task(folder / "a.yaml").head == str(absolute)
    (folder / "n.yaml").write_text(TASK_YAML)
    assert load_task(folder / "n.yaml").head is None


def test_fit_and_score_never_scores_a_fitted_text(tiny_llama, task):
    from prefixcache.eval.holdout import FitPlan, fit_and_score

    records, gold = separable_rows(90, seed=4)
    twins = [Record(f"twin-{r.id}", {"text": r.fields["text"] + " !"}) for r in records[:18]]  # same normalized text
    result = fit_and_score(tiny_llama, task, records + twins, gold + gold[:18], FitPlan(feature=FEATURE, folds=3, seed=0))
    assert result.fitted_rows == 54 and result.scored_rows + result.dropped == 54
    assert result.dropped > 0, "some twins fall on the other side of the split and must not be scored"
    assert result.head.records == result.scored_rows and result.prompt.records == result.scored_rows
    assert result.head.accuracy >= 0.9 and result.head.accuracy > result.prompt.accuracy + 0.3


def test_fit_then_score_scores_the_head_it_fits_on_the_other_part_only(separable):
    """The held-out figures of two parts made by the caller (as studies/accuracy_study.py makes them): the head
    is fitted on the first part alone, and its figures are its own predictions on the second part."""
    from prefixcache.eval.fit_curve import subset
    from prefixcache.eval.holdout import fit_then_score

    features, gold = separable
    fit_idx, scored_idx = list(range(0, 90, 2)), list(range(1, 90, 2))
    fit_rows, scored_rows = subset(features, fit_idx), subset(features, scored_idx)
    fit_gold, scored_gold = [gold[i] for i in fit_idx], [gold[i] for i in scored_idx]
    metrics, result = fit_then_score(fit_rows, fit_gold, scored_rows, scored_gold, folds=3, seed=0)
    predicted = result.head.predict(scored_rows.features, scored_rows.prompt_logprobs)
    assert metrics.records == len(scored_idx)
    assert metrics.accuracy == pytest.approx(np.mean([p == g for p, g in zip(predicted, scored_gold)]))
    assert metrics.accuracy > 0.9, "separable rows: the held-out part is told apart by the fitted head"
    labels = sorted(set(gold))
    rotated = [labels[(labels.index(g) + 1) % len(labels)] for g in scored_gold]
    again, _ = fit_then_score(fit_rows, fit_gold, scored_rows, rotated, folds=3, seed=0)
    assert again.accuracy == pytest.approx(np.mean([p == g for p, g in zip(predicted, rotated)])), \
        "the figures are against the gold labels given for the scored part"
    assert again.accuracy < metrics.accuracy
