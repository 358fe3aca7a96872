"""``prefixcache bench --ray-workers N``: local Ray against one process on the same records (scaleout/bench_lane.py)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.scaleout.bench_lane import Row, agreement, ray_table

from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML


def row(run: str, labels: list[str], margins=(), classify=2.0, wall=4.0) -> Row:
    return Row(run, "1 x 1 threads", load=1.0, prefix=0.5, classify=classify, wall=wall, labels=labels,
               margins=list(margins))


def test_agreement_counts_equal_labels_and_names_the_largest_margin_of_those_that_differ():
    reference = row("single process", ["a", "b", "c", "a"], margins=[0.9, 0.02, 0.05, 0.7])
    assert agreement(reference, reference) == "4/4"
    other = row("local Ray", ["a", "c", "b", "a"])
    assert agreement(other, reference) == "2/4 (max ref. margin 0.050)"


def test_the_table_gives_items_per_second_over_classify_and_wall_time():
    reference = row("single process", ["a"] * 8, margins=[1.0] * 8, classify=2.0, wall=4.0)
    table = ray_table([reference, row("local Ray", ["a"] * 8, classify=1.0, wall=8.0)], 8)
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].startswith("| run |")
    assert "| 4.0 | 2.0 | - | 8/8 |" in lines[2], lines[2]  # 8 items in 2 s classify, 4 s wall
    assert "| 8.0 | 1.0 | - | 8/8 |" in lines[3], lines[3]


@pytest.mark.ray
@pytest.mark.slow
def test_bench_ray_workers_gives_the_labels_of_one_process(tmp_path, tmp_path_factory):
    pytest.importorskip("ray.data", reason="Ray is not installed: pip install 'prefixcache[ray]'")
    model = save_tiny_model(tmp_path_factory, "qwen2")
    task = tmp_path / "task.yaml"
    task.write_text(TASK_YAML)
    result = CliRunner().invoke(app, ["bench", "--ray-workers", "1", "--items", "12", "--task", str(task), "--model", model,
                                      "--dtype", "float32", "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("| single process") or line.startswith("| local Ray")]
    assert any(r.startswith("| local Ray | 1 x ") for r in rows), result.output
    assert rows and all(re.search(r"\| 12/12 \|$", r) for r in rows), f"every row must give the first row's labels: {rows}"
