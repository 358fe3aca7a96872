"""The CLI, driven through typer's test runner with a tiny model saved to a local folder."""

from __future__ import annotations

import csv
import json
import math

import pytest
from typer.testing import CliRunner

from prefixcache.cli.app import app

from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML, TEXTS

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, "qwen2")


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "task.yaml"
    path.write_text(TASK_YAML)
    return str(path)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"ticket_id": f"T{i}", "body": t}) + "\n" for i, t in enumerate(TEXTS)))
    return str(path)


def _invoke(*args, **kw):
    result = runner.invoke(app, list(args), catch_exceptions=False, **kw)
    return result


def _lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_classify_jsonl_with_fields(model_dir, task_file, jsonl, tmp_path):
    out = tmp_path / "out.jsonl"
    result = _invoke(
        "classify", jsonl, "--task", task_file, "--model", model_dir, "--dtype", "float32",
        "--text-field", "body", "--id-field", "ticket_id", "--batch-size", "3", "--out", str(out),
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"T{i}" for i in range(len(TEXTS))]
    for row in rows:
        assert row["label"] in {"billing", "technical", "account"}
        assert set(row["scores"]) == {"billing", "technical", "account"}
        assert abs(sum(row["scores"].values()) - 1) < 1e-4
        assert row["margin"] >= 0


def test_classify_csv_default_ids_and_modes_agree(model_dir, task_file, tmp_path):
    path = tmp_path / "in.csv"
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text"])
        writer.writerows([[t] for t in TEXTS])
    runs = {}
    for mode in ("full", "cached", "batched"):
        result = _invoke("classify", str(path), "--task", task_file, "--model", model_dir, "--dtype", "float32", "--mode", mode)
        assert result.exit_code == 0, result.output
        rows = _lines(result.stdout)
        assert [r["id"] for r in rows] == list(range(len(TEXTS)))
        runs[mode] = rows
    for mode in ("cached", "batched"):
        assert [r["label"] for r in runs[mode]] == [r["label"] for r in runs["full"]], f"{mode} labels differ from full"
        for want, got in zip(runs["full"], runs[mode]):
            assert_same_scores(got, want, f"{mode}, record {want['id']}")


def assert_same_scores(got: dict, want: dict, where: str, tol: float = 1e-4) -> None:
    """Two output lines' label log-probs agree within ``tol`` (invariant 1 in float32), not only their labels."""
    assert set(got["scores"]) == set(want["scores"]), f"{where}: not the same labels scored"
    for label, p in want["scores"].items():
        drift = abs(math.log(got["scores"][label]) - math.log(p))
        assert drift <= tol, f"{where}: log P({label}) differs by {drift:.2e} from the reference"
    assert got["margin"] == pytest.approx(want["margin"], abs=2 * tol), f"{where}: margins differ"


def test_classify_stdin(model_dir, task_file):
    payload = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:3])
    result = _invoke("classify", "-", "--task", task_file, "--model", model_dir, "--dtype", "float32", input=payload)
    assert result.exit_code == 0, result.output
    assert len(_lines(result.stdout)) == 3


def test_verify_json(model_dir, task_file, jsonl):
    result = _invoke(
        "verify", jsonl, "--task", task_file, "--model", model_dir, "--dtype", "float32",
        "--text-field", "body", "--id-field", "ticket_id", "--batch-size", "7", "--json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert set(report) == {"records", "agree", "max_abs_logprob_diff", "disagreeing_ids", "reference", "stored_prefix_equal"}
    assert report["reference"] == "full" and report["stored_prefix_equal"] is None  # no tuned prefix here
    assert report["records"] == report["agree"] == len(TEXTS)
    assert report["disagreeing_ids"] == []
    assert report["max_abs_logprob_diff"] < 1e-4


def test_verify_table(model_dir, task_file, jsonl):
    result = _invoke(
        "verify", jsonl, "--task", task_file, "--model", model_dir, "--dtype", "float32",
        "--text-field", "body", "--id-field", "ticket_id", "--mode", "cached",
    )
    assert result.exit_code == 0, result.output
    assert "verify: full vs cached" in result.output and "disagreeing ids" in result.output
    assert "100.00%" in result.output and "none" in result.output


def test_bad_record_is_reported_and_exit_code_is_1(model_dir, task_file, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "refund"}\n{"body": "no text"}\n')
    result = _invoke("classify", str(path), "--task", task_file, "--model", model_dir, "--dtype", "float32")
    assert result.exit_code == 1
    rows = _lines(result.stdout)
    assert rows[0]["label"] and rows[1]["label"] is None
    assert "record 1" in rows[1]["error"] and "'text'" in rows[1]["error"]


def test_invalid_task_file_is_a_clean_error(model_dir, tmp_path, jsonl):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TASK_YAML + "colour: blue\n")
    result = _invoke("classify", jsonl, "--task", str(bad), "--model", model_dir)
    assert result.exit_code == 2
    assert "bad.yaml:15" in result.output and "colour" in result.output
    assert "Traceback" not in result.output


def test_broken_jsonl_names_the_line(model_dir, task_file, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "ok"}\n{"text": oops}\n')
    result = _invoke("classify", str(path), "--task", task_file, "--model", model_dir, "--on-error", "fail")
    assert result.exit_code == 2
    assert "in.jsonl:2" in result.output


def test_tasks_and_models_list():
    result = _invoke("tasks")
    assert result.exit_code == 0 and "support-tickets" in result.output
    assert "ticket-fields" in result.output and "extract" in result.output
    result = _invoke("models")
    assert result.exit_code == 0 and "smollm2-135m" in result.output
