"""``prefixcache loadtest`` end to end on a tiny model: two real ``prefixcache serve`` subprocesses on loopback,
every answer checked against the sequential in-process result, the table and the ``--json`` document."""

from __future__ import annotations

import json
from functools import partial

import pytest
from typer.testing import CliRunner

from prefixcache.bench import roofline
from prefixcache.cli.app import app

from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML

pytestmark = pytest.mark.slow  # two servers started in subprocesses, and a model loaded in each


def test_the_plain_lane_checks_both_servers_and_writes_its_figures(tmp_path_factory, tmp_path, monkeypatch):
    monkeypatch.setattr(roofline, "matmul_peak_gflops", partial(roofline.matmul_peak_gflops, seconds=0.05, sizes=(1024,)))
    model = save_tiny_model(tmp_path_factory, "qwen2")
    (tmp_path / "task.yaml").write_text(TASK_YAML)
    out = tmp_path / "loadtest.json"
    result = CliRunner().invoke(app, [
        "loadtest", "--model", model, "--task", str(tmp_path / "task.yaml"), "--dtype", "float32", "--threads", "1",
        "--clients", "2", "--requests", "6", "--distinct", "4", "--max-batch", "4", "--target", "0", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output and "micro-batched (<= 4)" in result.output and "max-batch 1" in result.output
    document = json.loads(out.read_text())
    assert document["errors"] == 0 and document["machine"]["command"]
    assert {"ratio", "engine_ceiling", "arithmetic_bound", "engine_one_ms", "engine_batched_ms", "near_ties",
            "max_prob_diff", "load_average_end"} <= set(document)
    lanes = {lane["name"]: lane for lane in document["lanes"]}
    assert set(lanes) == {"micro-batched (<= 4)", "max-batch 1"}
    assert all(lane["items"] == 6 and lane["errors"] == 0 and lane["mismatches"] == 0 for lane in lanes.values())
    assert lanes["max-batch 1"]["max_batch"] == 1 and lanes["micro-batched (<= 4)"]["passes"] > 0
