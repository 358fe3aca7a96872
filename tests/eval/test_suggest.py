"""``suggest`` (issue 38): rows to label chosen by uncertainty and spread; pool features stored once and read back."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prefixcache.model.lean.decoder import LeanModel
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.eval.suggest import choose_rows, margins

from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML, TEXTS

runner = CliRunner()


def pool_with_copies(seed: int = 0):
    """10 copies of one maximally confused row, then 30 distinct rows, less confused the further down."""
    rng = np.random.default_rng(seed)
    copy = rng.normal(size=8)
    features = np.vstack([np.tile(copy, (10, 1)), rng.normal(size=(30, 8))])
    gaps = np.r_[np.zeros(10), np.linspace(0.1, 3.0, 30)]
    logprobs = np.log(np.c_[np.full(40, 0.5), np.full(40, 0.5)])
    logprobs[:, 0] += gaps  # margin = gap (up to the normalization the margin does not need)
    return features, logprobs


def test_margins_are_top_two_gaps():
    assert np.allclose(margins(np.log([[0.7, 0.2, 0.1], [0.4, 0.4, 0.2]])), [np.log(3.5), 0.0])


def test_uncertain_rows_are_spread_so_copies_are_not_picked_together():
    features, logprobs = pool_with_copies()
    by_margin = choose_rows(features, 5, logprobs, strategy="margin")
    assert set(by_margin) <= set(range(10)), "the five least sure rows are copies of one row"
    spread = choose_rows(features, 5, logprobs, strategy="uncertain")
    assert sum(i < 10 for i in spread) <= 1, f"spreading picked copies of one row: {spread}"
    assert max(spread) < 10 + 3 * 5, "the picks stay among the least sure rows"


def test_excluded_rows_are_never_chosen_and_every_strategy_gives_n_distinct_rows():
    features, logprobs = pool_with_copies()
    exclude = np.zeros(40, bool)
    exclude[::2] = True
    for strategy in ("uncertain", "diverse", "margin", "random"):
        chosen = choose_rows(features, 7, logprobs, strategy=strategy, exclude=exclude, seed=3)
        assert len(set(chosen)) == 7 and not exclude[chosen].any(), strategy
    with pytest.raises(ValueError):
        choose_rows(features, 3, None, strategy="uncertain")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, "qwen2")


def test_a_second_round_reads_the_pools_features_from_disk(model_dir, tmp_path, monkeypatch):
    (tmp_path / "task.yaml").write_text(TASK_YAML)
    rows = [{"id": f"p{i}", "text": f"{TEXTS[i % len(TEXTS)]} number {i}"} for i in range(24)]
    (tmp_path / "pool.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = []
    forward = LeanModel.forward  # the tiny Qwen2 runs on the lean decoder
    monkeypatch.setattr(LeanModel, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))

    def run(out):
        args = ["suggest", str(tmp_path / "pool.jsonl"), "--task", str(tmp_path / "task.yaml"), "--model", model_dir,
                "--dtype", "float32", "--id-field", "id", "--n", "5", "--out", str(out), "--feature", "mean@0+last",
                "--feature-cache", str(tmp_path / "features"), "--batch-size", "8"]
        result = runner.invoke(app, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return [json.loads(line) for line in out.read_text().splitlines()]

    first = run(tmp_path / "first.jsonl")
    first_passes = len(calls)
    assert first_passes >= 3, "the first round encodes the pool (prefix and 24 rows in batches of 8)"
    second = run(tmp_path / "second.jsonl")
    assert len(calls) == first_passes, f"the second round ran {len(calls) - first_passes} forward passes"
    assert [r["prefixcache"]["id"] for r in second] == [r["prefixcache"]["id"] for r in first]
    assert len(first) == 5 and all(r["text"] for r in first), "whole input rows"


def test_with_a_head_the_rows_it_was_fitted_on_are_never_suggested(model_dir, tmp_path):
    from prefixcache.engine.head_file import save_head
    from prefixcache.eval.fit_head import fit_head
    from prefixcache.model.load import load_model
    from prefixcache.scheduler.feature_pass import collect_features
    from prefixcache.task.definition import parse_task

    from tests.support.separable import FEATURE, separable_rows

    (tmp_path / "task.yaml").write_text(TASK_YAML)
    fitted, gold = separable_rows(30, seed=1)
    pool, _ = separable_rows(12, seed=9)
    loaded = load_model(model_dir, "float32")
    result = fit_head(collect_features(loaded, parse_task(TASK_YAML, "t.yaml"), fitted, feature=FEATURE), gold, folds=3)
    result.head.manifest["task"] = "tiny-tickets"
    head = save_head(result.head, tmp_path / "h.safetensors")
    rows = [{"id": r.id, "text": r.fields["text"]} for r in [*fitted, *pool]]
    (tmp_path / "pool.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["suggest", str(tmp_path / "pool.jsonl"), "--task", str(tmp_path / "task.yaml"), "--model", model_dir,
            "--dtype", "float32", "--id-field", "id", "--n", "8", "--head", str(head), "--out", str(tmp_path / "s.jsonl"),
            "--feature-cache", str(tmp_path / "features")]
    outcome = runner.invoke(app, args, catch_exceptions=False)
    assert outcome.exit_code == 0, outcome.output
    chosen = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    fitted_texts = {r.fields["text"] for r in fitted}
    assert len(chosen) == 8 and not any(c["text"] in fitted_texts for c in chosen)
    assert all(c["prefixcache"]["best_guess"] in ("billing", "technical", "account") and c["prefixcache"]["margin"] >= 0
               for c in chosen)
