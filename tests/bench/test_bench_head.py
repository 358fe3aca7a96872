"""bench's head lanes (issue 15): the same records through a fitted head, batched measured against full
re-encoding through the same head; ``--head fit`` fits one on the bench's records; a head for another prompt
is refused, and so is ``--head fit`` on records without the task's labels.

No timed assertions: only structure, agreement and drift.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from prefixcache.bench.head_lanes import gold_labels
from prefixcache.bench.workload import ticket_records
from prefixcache.cli.app import app
from prefixcache.errors import InputError
from prefixcache.task.definition import load_task, parse_task

from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML
from tests.bench.json_keys import MODE_KEYS

TOL = 1e-4  # float32: full and batched through the same head give log-probs this close (invariant 1)
runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, "llama")


def bench(model_dir, *args):
    base = ["bench", "--items", "12", "--model", model_dir, "--dtype", "float32", "--batch-size", "4", "--no-llama-cpp"]
    return runner.invoke(app, [*base, *args])


def head_lanes_hold_invariant_1(document: dict) -> dict:
    """The head lanes of a bench document, checked: every key, agreement with full+head, bounded drift."""
    modes = {m["mode"]: m for m in document["modes"]}
    assert [m["mode"] for m in document["modes"]][:5] == ["full", "cached", "batched", "full+head", "batched+head"]
    for name in ("full+head", "batched+head"):
        lane = modes[name]
        assert MODE_KEYS <= set(lane), f"{name} lacks {MODE_KEYS - set(lane)}"
        assert set(lane) == set(modes["full"]), "a head lane has the same keys as the other lanes"
        assert lane["reference"] == "full+head", f"{name} must be measured against full re-encoding through the head"
        assert lane["records"] == document["items"] and lane["speedup_vs_full"] > 0
    batched = modes["batched+head"]
    assert batched["batch_size"] == 4
    assert batched["label_agreement"] == 1.0, f"batched through the head differs from full through it: {batched}"
    assert batched["disagreements_outside_ties"] == 0, batched
    assert batched["max_abs_logprob_diff"] <= TOL, f"head log-probs drift from full re-encoding through the head: {batched}"
    assert modes["full+head"]["max_abs_logprob_diff"] == 0.0  # the reference against itself
    assert modes["full"]["reference"] == "full" and modes["batched"]["reference"] == "full"
    return modes


@pytest.mark.slow
def test_head_fit_adds_head_lanes_equal_to_full_through_the_head(model_dir, tmp_path):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    result = bench(model_dir, "--head", "fit", "--json", str(out), "--plot", str(plot))
    assert result.exit_code == 0, result.output
    assert "for timing only" in " ".join(result.output.split())
    assert "batched+head" in result.output and "against full+head" in " ".join(result.output.split())
    document = json.loads(out.read_text())
    head_lanes_hold_invariant_1(document)
    assert document["head"]["source"] == "fit" and document["head"]["fitted_on_bench_records"] is True
    assert document["head"]["training_rows"] == 12 and document["head"]["labels"] == 3
    assert plot.stat().st_size > 10_000


@pytest.mark.slow
def test_a_head_file_from_fit_runs_and_another_prompts_head_is_refused(model_dir, tmp_path):
    rows = tmp_path / "tickets.jsonl"
    rows.write_text("".join(json.dumps({"text": r.fields["text"], "label": r.fields["label"]}) + "\n"
                            for r in ticket_records(12, seed=3)))
    tickets_head, other_head = tmp_path / "tickets.safetensors", tmp_path / "other.safetensors"
    (tmp_path / "task.yaml").write_text(TASK_YAML)
    common = ["--model", model_dir, "--dtype", "float32", "--folds", "2"]
    for task, head in (("tickets-compact", tickets_head), (str(tmp_path / "task.yaml"), other_head)):
        fitted = runner.invoke(app, ["fit", str(rows), "--task", task, "--out", str(head), *common])
        assert fitted.exit_code == 0, fitted.output

    out = tmp_path / "bench.json"
    result = bench(model_dir, "--head", str(tickets_head), "--json", str(out))
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    head_lanes_hold_invariant_1(document)
    assert document["head"]["fitted_on_bench_records"] is False

    refused = bench(model_dir, "--head", str(other_head))
    assert refused.exit_code == 2, refused.output
    assert "fitted for another prompt" in " ".join(refused.output.split())
    assert "Traceback" not in refused.output


def test_head_fit_without_the_tasks_labels_is_a_usage_error(model_dir, tmp_path):
    task = tmp_path / "mood.yaml"
    task.write_text("name: mood\ninstruction: Is the ticket's customer happy?\nlabels: {happy: glad, unhappy: upset}\n"
                    "input_template: 'Ticket: {text}'\n")
    result = bench(model_dir, "--task", str(task), "--head", "fit")
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "--head fit" in message and "happy, unhappy" in message and "Traceback" not in result.output
    assert "running" not in message, "refused before any lane runs"


def test_head_beside_an_extraction_task_is_a_usage_error(model_dir, tmp_path):
    from tests.support.tasks import EXTRACT_YAML

    task = tmp_path / "extract.yaml"
    task.write_text(EXTRACT_YAML)
    result = bench(model_dir, "--task", str(task), "--head", "fit")
    assert result.exit_code == 2 and "extraction task" in " ".join(result.output.split()), result.output


def test_gold_labels_names_a_record_without_one():
    task = parse_task(TASK_YAML, "t.yaml")
    records = ticket_records(6)
    assert gold_labels(records, task) == {r.id: r.fields["label"] for r in records}
    records[4].fields.pop("label")
    with pytest.raises(InputError, match=repr(records[4].id)):
        gold_labels(records, task)


def test_the_prompt_lanes_ignore_a_task_files_head(tmp_path):
    from prefixcache.bench.head_lanes import without_head

    task = load_task("tickets-compact").model_copy(update={"head": str(tmp_path / "h.safetensors")})
    assert without_head(task).head is None and without_head(task).labels == task.labels
