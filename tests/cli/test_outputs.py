"""classify's outputs (issue 38): --out's extension picks JSON Lines, CSV or Parquet; --keep-fields carries input
columns through; --resume writes each id once in every format; --min-confidence abstains and --review-out queues."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.io.job_file import job_path
from prefixcache.io.outputs import journal_path

from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML, TEXTS

runner = CliRunner()
N = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, "qwen2")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("job")
    (folder / "task.yaml").write_text(TASK_YAML)
    rows = [{"id": f"r{i}", "text": f"{TEXTS[i % len(TEXTS)]} ({i})", "team": f"t{i % 3}", "label": "billing"}
            for i in range(N)]
    (folder / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def classify(model_dir, job, out, *extra, task=None):
    args = ["classify", str(job / "in.jsonl"), "--task", str(task or job / "task.yaml"), "--model", model_dir, "--dtype",
            "float32", "--threads", "1", "--id-field", "id", "--batch-size", "4", "--window", "4", "--out", str(out), *extra]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def read(path) -> pd.DataFrame:
    if path.suffix == ".csv":
        return pd.read_csv(path)
    if path.suffix == ".parquet":
        return pd.read_parquet(path)
    return pd.read_json(path, lines=True)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_each_format_round_trips_with_kept_fields_and_resume_writes_each_id_once(model_dir, job, tmp_path, suffix):
    out = tmp_path / f"out{suffix}"
    classify(model_dir, job, out, "--keep-fields", "team,label")
    table = read(out)
    assert list(table["id"]) == [f"r{i}" for i in range(N)]
    assert list(table["team"]) == [f"t{i % 3}" for i in range(N)], "kept field carried beside its own row"
    assert (table["input.label"] == "billing").all(), "a kept field named like an output key is input.<name>"
    assert set(table["label"]) <= {"billing", "technical", "account"} and table["confidence"].between(0, 1).all()
    assert not journal_path(out).exists() or suffix == ".jsonl", "the journal of a table is removed when it is written"
    # a killed run: the journal holds the first 5 lines; resume runs the rest, and every id is written once
    lines = [json.dumps({k: _plain(v) for k, v in row.items()}) for row in table.head(5).to_dict("records")]
    journal_path(out).write_text("\n".join(lines) + "\n")
    if suffix != ".jsonl":
        out.unlink()
    result = classify(model_dir, job, out, "--keep-fields", "team,label", "--resume")
    again = read(out)
    assert list(again["id"]) == [f"r{i}" for i in range(N)], result.output
    assert list(again["label"]) == list(table["label"])


def _plain(value):
    if isinstance(value, str) and value.startswith("{"):
        return json.loads(value)
    return value.item() if hasattr(value, "item") else (dict(value) if isinstance(value, dict) else value)


def test_a_threshold_above_every_confidence_queues_every_row_for_review(model_dir, job, tmp_path):
    out, review = tmp_path / "out.jsonl", tmp_path / "review.jsonl"
    result = classify(model_dir, job, out, "--min-confidence", "1.0", "--review-out", str(review))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["label"] is None and r["abstained"] and r["best_guess"] for r in rows)
    queued = [json.loads(line) for line in review.read_text().splitlines()]
    assert [q["id"] for q in queued] == [f"r{i}" for i in range(N)] and all(q["team"] for q in queued)
    assert "coverage 0.0%" in result.output
    assert json.loads(job_path(out).read_text())["threshold"] == "1.0"
    none = classify(model_dir, job, tmp_path / "none.jsonl", "--min-confidence", "0")
    assert "coverage 100.0%" in none.output


def test_target_accuracy_without_stored_rows_is_refused(model_dir, job, tmp_path):
    args = ["classify", str(job / "in.jsonl"), "--task", str(job / "task.yaml"), "--model", model_dir, "--dtype",
            "float32", "--id-field", "id", "--out", str(tmp_path / "o.jsonl"), "--target-accuracy", "0.9"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "out-of-fold" in result.output


def test_a_prompt_only_task_is_calibrated_beside_its_task_file_and_used(model_dir, job, tmp_path):
    task = tmp_path / "task.yaml"
    task.write_text(TASK_YAML)
    fit = runner.invoke(app, ["fit", str(job / "in.jsonl"), "--task", str(task), "--prompt-only", "--model", model_dir,
                              "--dtype", "float32", "--id-field", "id"], catch_exceptions=False)
    assert fit.exit_code == 0, fit.output
    written = json.loads((tmp_path / "task.calibration.json").read_text())
    assert written["format"] == "prefixcache-calibration/1" and len(written["rows"]["correct"]) == N
    temperature = written["calibration"]["temperature"]
    plain, calibrated = tmp_path / "plain.jsonl", tmp_path / "calibrated.jsonl"
    classify(model_dir, job, plain, task=task)
    task.write_text(TASK_YAML + "calibration: task.calibration.json\ntarget_accuracy: 1.0\n")
    classify(model_dir, job, calibrated, task=task)
    before = [json.loads(line) for line in plain.read_text().splitlines()]
    after = [json.loads(line) for line in calibrated.read_text().splitlines()]
    assert [r.get("best_guess", r["label"]) for r in after] == [r["label"] for r in before], "calibration keeps labels"
    if abs(temperature - 1.0) > 1e-3:
        assert any(abs(a["confidence"] - b["confidence"]) > 1e-4 for a, b in zip(after, before))
    stored = json.loads(job_path(calibrated).read_text())
    assert stored["calibration"] == repr(temperature) and stored["target_accuracy"] == 1.0
    assert 0 <= stored["expected_coverage"] <= 1


def test_eval_reports_the_calibration_error_and_draws_the_reliability_diagram(model_dir, job, tmp_path):
    plot = tmp_path / "eval.png"
    args = ["eval", str(job / "in.jsonl"), "--task", str(job / "task.yaml"), "--model", model_dir, "--dtype", "float32",
            "--id-field", "id", "--json", "--plot", str(plot)]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    document = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    figures = document["confidence"]
    assert figures["rows"] == N and 0 <= figures["ece"] <= 1 and figures["accuracy"] == document["accuracy"]
    assert plot.with_suffix(".trust.png").stat().st_size > 1000
