"""classify --resume checks what it resumes (issue 18, item 2): the job file beside the output.

A job writes ``<out>.job.json`` (task, prompt hash, label-set hash, model, method, dtype, head) before
its first line. ``--resume`` with any of them changed is refused with exit 2, naming what differs;
with the same settings it resumes. One case per field, each through the real CLI on a tiny model.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.io.job_file import FIELDS, check_job, job_path, write_job
from prefixcache.errors import InputError

from tests.support.models import save_tiny_model
from tests.support.tasks import LABELS, TASK_YAML, TEXTS

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("job-file")
    rows = root / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t, "label": LABELS[i % 3]}) + "\n" for i, t in enumerate(TEXTS)))
    tasks = {
        "same": TASK_YAML,
        "task": TASK_YAML.replace("name: tiny-tickets", "name: tiny-tickets-2"),
        "prompt": TASK_YAML.replace("Classify the customer support ticket.", "Sort the ticket."),
        "labels": TASK_YAML.replace("account: login", "profile: login").replace("label: account", "label: profile"),
    }
    for name, text in tasks.items():
        (root / f"{name}.yaml").write_text(text)
    models = {"llama": save_tiny_model(tmp_path_factory, "llama"), "qwen2": save_tiny_model(tmp_path_factory, "qwen2")}
    head = root / "tiny.head.safetensors"
    fitted = runner.invoke(app, ["fit", str(rows), "--task", str(root / "same.yaml"), "--model", models["llama"],
                                 "--dtype", "float32", "--folds", "2", "--out", str(head)], catch_exceptions=False)
    assert fitted.exit_code == 0, fitted.output
    return {"root": root, "rows": rows, "models": models, "head": head}


def _classify(setup, out, *extra, task="same", model="llama"):
    """``classify`` of the rows into ``out``; ``extra`` options override the defaults here (``--resume`` is a flag)."""
    options = {"--task": str(setup["root"] / f"{task}.yaml"), "--model": setup["models"][model], "--dtype": "float32",
               "--out": str(out)}
    flags, given = [], iter(extra)
    for item in given:
        if item == "--resume":
            flags.append(item)
        else:
            options[item] = next(given)
    args = ["classify", str(setup["rows"]), *[part for pair in options.items() for part in pair], *flags]
    return runner.invoke(app, args, catch_exceptions=False)


@pytest.fixture
def done_job(setup, tmp_path):
    out = tmp_path / "labels.jsonl"
    result = _classify(setup, out)
    assert result.exit_code == 0, result.output
    return out


def test_a_job_writes_its_job_file_beside_the_output_and_resumes_with_the_same_settings(setup, done_job):
    stored = json.loads(job_path(done_job).read_text())
    assert list(stored) == list(FIELDS)
    assert stored["task"] == "tiny-tickets" and stored["method"] == "first-token" and stored["dtype"] == "float32"
    assert stored["head"] is None and len(stored["prompt"]) == len(stored["labels"]) == 16
    lines = done_job.read_text()
    result = _classify(setup, done_job, "--resume")
    assert result.exit_code == 0, result.output
    assert "resumed after 9 lines" in result.output and done_job.read_text() == lines


CHANGES = {  # field -> (what the resume changes, the words the refusal must hold)
    "task": ({"task": "task"}, "the task (--task): 'tiny-tickets' then, 'tiny-tickets-2' now"),
    "prompt": ({"task": "prompt"}, "the task's prompt"),
    "labels": ({"task": "labels"}, "the label set (--task)"),
    "model": ({"model": "qwen2"}, "the model (--model)"),
    "method": ({"extra": ("--method", "full")}, "the scoring method (--method): 'first-token' then, 'full' now"),
    "dtype": ({"extra": ("--dtype", "bfloat16")}, "the dtype (--dtype): 'float32' then, 'bfloat16' now"),
    "head": ({"extra": ("--head", "{head}")}, "the fitted head (--head): None then"),
    "calibration": ({"extra": ("--head", "{head}")}, "the calibration (--calibration): None then"),
    "threshold": ({"extra": ("--min-confidence", "0.5")}, "the confidence threshold (--min-confidence): None then, '0.5' now"),
}


@pytest.mark.parametrize("field", FIELDS)
def test_resuming_another_job_is_refused_naming_what_differs(setup, done_job, field):
    change, words = CHANGES[field]
    extra = [value.format(head=setup["head"]) for value in change.get("extra", ())]
    before = done_job.read_text()
    result = _classify(setup, done_job, *extra, "--resume", task=change.get("task", "same"), model=change.get("model", "llama"))
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "was written by another job" in message and words in message, message
    assert done_job.read_text() == before, "a refused resume must not touch the output"


def test_lines_without_a_job_file_are_not_resumed(setup, done_job):
    job_path(done_job).unlink()
    result = _classify(setup, done_job, "--resume")
    assert result.exit_code == 2
    assert "no labels.jsonl.job.json beside it" in " ".join(result.output.split())


def test_check_names_every_field_that_differs_and_an_empty_output_needs_no_job_file(tmp_path):
    out = tmp_path / "o.jsonl"
    ours = dict.fromkeys(FIELDS, "x") | {"head": None}
    check_job(out, ours, 0)  # nothing written yet: nothing to check
    write_job(out, ours)
    check_job(out, ours, 5)
    with pytest.raises(InputError) as refused:
        check_job(out, ours | {"model": "y", "dtype": "z"}, 5)
    assert "the model" in str(refused.value) and "the dtype" in str(refused.value) and "the task" not in str(refused.value)
    job_path(out).write_text("{torn")
    with pytest.raises(InputError, match="cannot be read"):
        check_job(out, ours, 5)
