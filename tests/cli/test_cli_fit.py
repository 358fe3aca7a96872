"""A fitted head through the CLI (issue 15): `fit` writes it, and classify, verify and eval use it; a head
for another prompt is refused, and eval refuses rows the head was fitted on. A tiny model saved to a folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.engine.head_file import head_calibration, load_head
from prefixcache.model.load import load_model
from prefixcache.scheduler.feature_pass import collect_features
from prefixcache.task.definition import parse_task

from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML
from tests.support.separable import FEATURE, separable_rows

runner = CliRunner()


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def _write_jsonl(path, records, gold=None):
    lines = []
    for i, record in enumerate(records):
        row = {"id": record.id, "text": record.fields["text"]}
        if gold is not None:
            row["label"] = gold[i]
        lines.append(json.dumps(row) + "\n")
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, model_dir):
    """A task file, its training rows, held-out rows, and a head fitted by `prefixcache fit`."""
    folder = tmp_path_factory.mktemp("fit")
    task_file = folder / "task.yaml"
    task_file.write_text(TASK_YAML)
    train = _write_jsonl(folder / "train.jsonl", *separable_rows(90, seed=1))
    held = _write_jsonl(folder / "held.jsonl", *separable_rows(30, seed=2))
    head = folder / "tiny.head.safetensors"
    result = _invoke("fit", train, "--task", task_file, "--model", model_dir, "--dtype", "float32", "--id-field", "id",
                     "--feature", FEATURE, "--folds", "3", "--out", head,  # 3: a non-default count the manifest must keep
                     "--plot", folder / "fit.png")
    assert result.exit_code == 0, result.output
    return {"task": task_file, "train": train, "held": held, "head": head, "fit_output": result.output, "folder": folder}


def test_fit_prints_the_cross_validated_report_and_writes_the_head(fitted):
    output = fitted["fit_output"]
    for piece in ("per label", "confusion", "head (CV)", "prompt (first-token)", "C tried", "coverage at 90% accuracy",
                  "calibration error"):
        assert piece in output, f"{piece!r} missing from fit's report:\n{output}"
    head = load_head(fitted["head"])
    assert head.labels == ("billing", "technical", "account") and head.feature == FEATURE
    assert head.manifest["training"]["rows"] == 90 and head.manifest["cv"]["folds"] == 3
    assert head.manifest["cv"]["accuracy"] >= 0.95 > head.manifest["cv"]["prompt_accuracy"]
    assert len(head.manifest["oof"]["correct"]) == 90 and "calibration" in head.manifest
    assert (fitted["folder"] / "fit.trust.png").stat().st_size > 1000, "the out-of-fold reliability diagram"
    assert head.manifest["task"] == "tiny-tickets"


def test_classify_with_the_head_gives_the_heads_probabilities(fitted, model_dir):
    result = _invoke("classify", fitted["held"], "--task", fitted["task"], "--model", model_dir, "--dtype", "float32",
                     "--id-field", "id", "--head", fitted["head"], "--batch-size", "4")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    records, gold = separable_rows(30, seed=2)
    assert [r["id"] for r in rows] == [r.id for r in records]
    assert set(rows[0]) == {"id", "label", "confidence", "scores", "margin"}
    loaded = load_model(model_dir, "float32")
    features = collect_features(loaded, parse_task(TASK_YAML, "t.yaml"), records, feature=FEATURE)
    head = load_head(fitted["head"])  # the scores are the head's probabilities, calibrated by its stored temperature
    expected = np.exp(head_calibration(head).apply(head.log_probs(features.features, features.prompt_logprobs).numpy()))
    got = np.array([[r["scores"][label] for label in ("billing", "technical", "account")] for r in rows])
    assert np.abs(got - expected).max() < 1e-4
    assert [r["label"] for r in rows] == [("billing", "technical", "account")[j] for j in expected.argmax(axis=1)]
    assert np.mean([r["label"] == g for r, g in zip(rows, gold)]) >= 0.9, "the head should sort these rows"


def test_a_task_file_naming_its_head_uses_it(fitted, model_dir, tmp_path):
    task_file = tmp_path / "task.yaml"
    task_file.write_text(TASK_YAML + f"head: {fitted['head']}\n")
    result = _invoke("classify", fitted["held"], "--task", task_file, "--model", model_dir, "--dtype", "float32", "--id-field", "id")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    with_flag = _invoke("classify", fitted["held"], "--task", fitted["task"], "--model", model_dir, "--dtype", "float32",
                        "--id-field", "id", "--head", fitted["head"])
    assert result.stdout == with_flag.stdout


def test_verify_through_the_head_agrees(fitted, model_dir):
    result = _invoke("verify", fitted["held"], "--task", fitted["task"], "--model", model_dir, "--dtype", "float32",
                     "--id-field", "id", "--head", fitted["head"])
    assert result.exit_code == 0, result.output


def test_eval_with_the_head_on_held_out_rows(fitted, model_dir):
    result = _invoke("eval", fitted["held"], "--task", fitted["task"], "--model", model_dir, "--dtype", "float32",
                     "--id-field", "id", "--head", fitted["head"], "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["accuracy"] >= 0.9 and document["method"] == f"head:{FEATURE}"


def test_eval_refuses_rows_the_head_was_fitted_on_naming_them(fitted, model_dir, tmp_path):
    records, gold = separable_rows(30, seed=2)
    train_records, train_gold = separable_rows(60, seed=1)
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", records[:5] + [train_records[7]], gold[:5] + [train_gold[7]])
    result = _invoke("eval", mixed, "--task", fitted["task"], "--model", model_dir, "--dtype", "float32",
                     "--id-field", "id", "--head", fitted["head"])
    assert result.exit_code == 2, result.output
    assert "fitted on" in result.output and "r1-7" in result.output and "r2-0" not in result.output


def test_a_head_for_another_prompt_is_refused_with_exit_2(fitted, model_dir, tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text(TASK_YAML.replace("Classify the customer support ticket.", "Route the ticket."))
    result = _invoke("classify", fitted["held"], "--task", other, "--model", model_dir, "--dtype", "float32",
                     "--id-field", "id", "--head", fitted["head"])
    assert result.exit_code == 2
    assert "another prompt" in result.output


def test_fit_names_the_row_and_field_of_an_unknown_label(fitted, model_dir, tmp_path):
    records, gold = separable_rows(9, seed=3)
    gold[4] = "shipping"
    bad = _write_jsonl(tmp_path / "bad.jsonl", records, gold)
    result = _invoke("fit", bad, "--task", fitted["task"], "--model", model_dir, "--dtype", "float32", "--id-field", "id",
                     "--out", tmp_path / "h.safetensors")
    assert result.exit_code == 2
    assert "'label'" in result.output and "r3-4" in result.output and "shipping" in result.output


@pytest.mark.ray
def test_ray_workers_score_through_the_head_as_a_local_run_does(fitted, model_dir, tmp_path):
    pytest.importorskip("ray.data", reason="Ray is not installed: pip install 'prefixcache[ray]'")
    common = ["--task", fitted["task"], "--model", model_dir, "--dtype", "float32", "--id-field", "id",
              "--threads", "1", "--batch-size", "4", "--head", fitted["head"]]
    local = _invoke("classify", fitted["held"], *common, "--out", tmp_path / "local.jsonl")
    assert local.exit_code == 0, local.output
    on_ray = _invoke("classify", fitted["held"], *common, "--ray", "--workers", "1", "--out", tmp_path / "ray")
    assert on_ray.exit_code == 0, on_ray.output
    want = [json.loads(line) for line in (tmp_path / "local.jsonl").read_text().splitlines()]
    parts = sorted((tmp_path / "ray").glob("part-*.jsonl"))
    got = [json.loads(line) for part in parts for line in part.read_text().splitlines()]
    assert [g["label"] for g in got] == [w["label"] for w in want]
    drift = max(abs(g["scores"][k] - w["scores"][k]) for g, w in zip(got, want) for k in w["scores"])
    assert drift < 1e-4, f"Ray's head probabilities drift by {drift:.2e} from the local run's"


def test_a_served_task_with_a_head_says_so_and_scores_through_it(fitted, model_dir):
    pytest.importorskip("fastapi")
    from tests.server.live import call, serving

    from prefixcache.task.definition import load_task

    loaded = load_model(model_dir, "float32")
    task = load_task(fitted["task"]).model_copy(update={"head": str(fitted["head"])})
    records, _ = separable_rows(6, seed=2)
    with serving(loaded, [task]) as server:
        status, _, listing = call(server, "GET", "/v1/tasks")
        assert status == 200
        info = listing["tasks"][0]
        assert info["method"] == f"head:{FEATURE}"
        assert info["head"]["feature"] == FEATURE and info["head"]["training_rows"] == 90
        items = [{"id": r.id, "text": r.fields["text"]} for r in records]
        status, _, answer = call(server, "POST", "/v1/classify", {"task": task.name, "items": items})
        assert status == 200, answer
        upload = TASK_YAML.replace("tiny-tickets", "tiny-x") + f"head: {fitted['head']}\n"
        refused = call(server, "PUT", "/v1/tasks/tiny-x", raw=upload.encode(), headers={"Content-Type": "application/yaml"})
    assert refused[0] == 422 and "head" in refused[2]["detail"]
    features = collect_features(loaded, task, records, feature=FEATURE)
    head = load_head(fitted["head"])  # the scores are the head's probabilities, calibrated by its stored temperature
    expected = np.exp(head_calibration(head).apply(head.log_probs(features.features, features.prompt_logprobs).numpy()))
    got = np.array([[result["scores"][k] for k in ("billing", "technical", "account")] for result in answer["results"]])
    assert np.abs(got - expected).max() < 1e-4
