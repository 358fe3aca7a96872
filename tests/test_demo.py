"""The demo end to end on a tiny model: 600 bundled tickets, a float32 side-by-side table, a results folder."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from conftest import save_tiny_model, tiny_loaded
from prefixcache.cli import app
from prefixcache.demo import float32_twin
from prefixcache.runner import Classifier
from prefixcache.task import load_task


def test_demo_classifies_the_bundled_tickets_and_proves_agreement(tmp_path_factory, tmp_path):
    folder = save_tiny_model(tmp_path_factory, "llama")
    result = CliRunner().invoke(
        app, ["demo", "--model", folder, "--dtype", "float32", "--subset", "6", "--batch-size", "4", "--out-dir", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert "accuracy on 600 bundled tickets" in result.output
    assert "labels equal to full re-encoding: 6/6 in every mode" in result.output
    (results,) = tmp_path.glob("demo-*")
    lines = (results / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 600 and {"id", "label", "scores", "margin"} <= set(json.loads(lines[0]))
    summary = json.loads((results / "summary.json").read_text())
    assert [t["mode"] for t in summary["timing"]] == ["full", "cached", "batched"]
    assert all(t["label_agreement"] == 1.0 for t in summary["timing"])


def test_float32_twin_copies_a_bfloat16_model_and_keeps_a_float32_one():
    task = load_task("support-tickets")
    fast = Classifier(tiny_loaded("qwen2", dtype=torch.bfloat16), task)
    twin = float32_twin(fast)
    assert twin is not fast and twin.loaded.dtype == torch.float32 and fast.loaded.dtype == torch.bfloat16
    assert next(twin.loaded.model.parameters()).dtype == torch.float32
    assert twin.prompt.prefix_ids == fast.prompt.prefix_ids and twin.method == fast.method
    exact = Classifier(tiny_loaded("qwen2"), task)
    assert float32_twin(exact) is exact
