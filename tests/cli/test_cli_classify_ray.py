"""``prefixcache classify --ray``: the CLI in front of :func:`prefixcache.scaleout.run_ray_classify`.

The option checks need no Ray and always run. The one Ray run (a local Ray, 2 workers, a
tiny model saved to a folder) is skipped without Ray, except in CI (``CI`` set), where a
missing Ray is an error, as in ``tests/scaleout/test_scaleout_ray.py``.
"""

from __future__ import annotations

import importlib
import json
import math
import os

import pytest
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.datasets.tickets import generate_tickets

from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML

runner = CliRunner()


def _invoke(*args, **kw):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False, **kw)


def _text(output: str) -> str:
    """The output as one line of words, without the frame of rich's error box."""
    return " ".join(output.replace("│", " ").split())


@pytest.fixture
def source(tmp_path):
    tickets = generate_tickets(40, seed=3)
    tickets[6]["text"] = None  # a bad record: an error line and exit code 1, in both runs
    path = tmp_path / "tickets.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in tickets))
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ray", "--resume"], "--resume does not work with --ray"),
        (["--ray", "--on-error", "fail"], "--on-error fail does not work with --ray"),
        (["--ray", "--window", "8"], "--window does not work with --ray"),
        (["--ray", "--cache-budget", "64MB"], "--cache-budget does not work with --ray"),
        (["--ray", "--kv-storage", "int8"], "--kv-storage does not work with --ray"),
        (["--ray-address", "auto"], "--ray-address needs --ray: add --ray, or drop it"),
        (["--workers", "4", "--num-gpus", "1"], "--workers, --num-gpus need --ray"),
        (["--ray", "--workers", "0"], "--workers"),  # typer's own range check
    ],
)
def test_options_that_make_no_sense_together_are_refused(source, tmp_path, args, message):
    result = _invoke("classify", source, "--model", tmp_path / "never-loaded", "--out", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert message in _text(result.output), result.output
    assert not (tmp_path / "out").exists(), "nothing may run before the options are checked"


def test_ray_does_not_read_stdin(tmp_path):
    result = _invoke("classify", "-", "--ray", input='{"text": "refund"}\n')
    assert result.exit_code == 2 and "--ray reads files, not stdin" in _text(result.output), result.output


@pytest.fixture
def ray_installed():
    if os.environ.get("CI"):
        importlib.import_module("ray.data")  # CI must have Ray: fail loudly instead of skipping
    else:
        pytest.importorskip("ray.data", reason="Ray is not installed: pip install 'prefixcache[ray]'")


@pytest.mark.ray
def test_ray_workers_write_the_labels_of_a_local_run(ray_installed, source, tmp_path, tmp_path_factory):
    model = save_tiny_model(tmp_path_factory, "qwen2")
    task = tmp_path / "task.yaml"
    task.write_text(TASK_YAML)
    common = ["--task", task, "--model", model, "--id-field", "id", "--dtype", "float32", "--threads", "1",
              "--batch-size", "4"]

    local = _invoke("classify", source, *common, "--out", tmp_path / "local.jsonl")
    assert local.exit_code == 1, local.output  # the bad record
    on_ray = _invoke("classify", source, *common, "--ray", "--workers", "2", "--out", tmp_path / "ray",
                     "--cache-dir", tmp_path / "prefixes")
    assert on_ray.exit_code == 1, on_ray.output  # the same bad record, reported the same way

    want = [json.loads(line) for line in (tmp_path / "local.jsonl").read_text().splitlines()]
    parts = sorted((tmp_path / "ray").glob("part-*.jsonl"))
    got = [json.loads(line) for part in parts for line in part.read_text().splitlines()]
    assert len(got) == len(want) == 40
    assert [g["id"] for g in got] == [w["id"] for w in want]
    assert [g["label"] for g in got] == [w["label"] for w in want], "Ray's labels differ from the local run's"
    for g, w in zip(got, want):
        assert (g["scores"] is None) == (w["scores"] is None), f"{w['id']}: scored on one side only"
        for label, p in (w["scores"] or {}).items():
            drift = abs(math.log(g["scores"][label]) - math.log(p))
            assert drift <= 1e-4, f"{w['id']}: Ray's log P({label}) is {drift:.2e} from the local run's"
    assert [g.get("error") is None for g in got] == [w.get("error") is None for w in want]
    assert sum(g.get("error") is not None for g in got) == 1

    output = _text(on_ray.output)
    assert "items/s" in output and "total: 40 records (1 errors)" in output, on_ray.output
    assert "with 2 worker(s)" in output
    summary = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert summary["records"] == 40 and summary["errors"] == 1 and summary["workers"]
    assert any((tmp_path / "prefixes").iterdir()), "--cache-dir reached the workers: the prefix was stored there"
