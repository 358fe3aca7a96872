"""`fit --tune prefix` through the CLI on a tiny model saved to a folder: by default the file carries the tuned prefix
with a head refitted on its states (calibrated on the held-out rows), `--no-refit-head` keeps the head trained with
the prefix, `verify --head` passes on the default file, and another task's prompt is refused with exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.engine.head_file import load_head

from tests.support.models import save_tiny_model
from tests.support.separable import separable_rows
from tests.support.tasks import TASK_YAML

runner = CliRunner()
ROWS = 60


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fit-prefix")
    task_file = folder / "task.yaml"
    task_file.write_text(TASK_YAML)
    records, gold = separable_rows(ROWS, seed=1)
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps({"id": r.id, "text": r.fields["text"], "label": g}) + "\n"
                             for r, g in zip(records, gold)))
    model = save_tiny_model(tmp_path_factory, "llama")
    common = ["--task", task_file, "--model", model, "--dtype", "float32", "--id-field", "id"]
    return {"folder": folder, "train": train, "common": common, "task": task_file}


def _fit(setup, name: str, *extra):
    out = setup["folder"] / f"{name}.safetensors"
    result = _invoke("fit", setup["train"], *setup["common"], "--tune", "prefix", "--epochs", "1", "--folds", "3",
                     "--json", "--out", out, *extra)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1]), load_head(out), out


@pytest.fixture(scope="module")
def refitted(setup):
    return _fit(setup, "refitted")


@pytest.fixture(scope="module")
def joint(setup):
    return _fit(setup, "joint", "--no-refit-head")


def test_the_default_file_carries_the_tuned_prefix_and_a_head_refitted_on_its_states(refitted):
    printed, head, _ = refitted
    assert head.tuned and head.prefix.length == printed["tuned"]["prefix_tokens"]
    assert head.manifest["tuned"]["head"] == "refitted" and head.prompt_scale == 0.0
    assert head.feature != "last" and head.feature == head.manifest["refit"]["feature"], "not fit's head"
    assert printed["refit"]["folds"] == 3 and printed["refit"]["C"] == head.manifest["refit"]["C"]
    held_out = round(0.2 * ROWS)
    assert len(head.manifest["oof"]["correct"]) == held_out == head.manifest["cv"]["heldout_rows"], (
        "the confidence is not calibrated on the held-out rows")
    assert head.manifest["training"]["rows"] == ROWS


def test_no_refit_head_keeps_the_head_trained_with_the_prefix(refitted, joint):
    printed, head, _ = joint
    assert printed["refit"] is None and "refit" not in head.manifest
    assert head.manifest["tuned"]["head"] == "joint" and (head.feature, head.prompt_scale) == ("last", 1.0)
    other = refitted[1]
    assert head.prefix.checksum() == other.prefix.checksum(), "the same tuning gave another prefix"
    assert head.weight.shape != other.weight.shape or not torch.equal(head.weight, other.weight)


def test_verify_passes_on_the_default_file(setup, refitted, tmp_path):
    held = tmp_path / "held.jsonl"
    records, _ = separable_rows(9, seed=2)
    held.write_text("".join(json.dumps({"id": r.id, "text": r.fields["text"]}) + "\n" for r in records))
    result = _invoke("verify", held, *setup["common"], "--head", refitted[2], "--json", "--batch-size", "4")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout.strip().splitlines()[-1])
    assert document["reference"] == "cached" and document["stored_prefix_equal"] is True
    assert document["agree"] == document["records"] == 9


def test_the_default_file_is_refused_for_another_task(setup, refitted, tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text(TASK_YAML.replace("Classify the customer support ticket.", "Sort the ticket."))
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"id": "a", "text": "my refund please"}) + "\n")
    args = ("classify", held, "--task", other, *setup["common"][2:], "--head", refitted[2])
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    assert "prompt" in result.output


def test_a_bad_feature_is_refused_before_tuning(setup):
    result = runner.invoke(app, [str(a) for a in ("fit", setup["train"], *setup["common"], "--tune", "prefix",
                                                  "--feature", "first", "--out", setup["folder"] / "x.safetensors")])
    assert result.exit_code == 2 and "is not one of last, mean" in " ".join(result.output.split()), result.output
