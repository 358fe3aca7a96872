"""The Ray Data stage: same lines as a local run, nothing lost or doubled when a worker dies.

Ray runs locally here (2 CPUs, no dashboard, loopback only), started once for
the module and shut down at its end; each run uses 2 actors and a tiny model
saved to a folder. The helpers that need no Ray (row mapping, the driver's
finishing of lines, the part writer, the summary) are tested first, without it.

Without Ray installed these tests are skipped, except in CI (``CI`` set), where
a missing Ray is an error: CI must install the ``ray`` extra.
"""

from __future__ import annotations

import csv
import json
import math
import os

import pytest

from prefixcache.io import records as data
from prefixcache.errors import InputError, ModelNotFoundError, ResourceError
from prefixcache.model.load import load_model
from prefixcache.scheduler.classify import Classifier, Prediction, Record, RunConfig
from prefixcache.task.definition import load_task
from prefixcache.datasets.tickets import generate_tickets

from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML

if os.environ.get("CI"):
    import ray.data  # noqa: F401 - CI must have Ray: fail loudly instead of skipping
else:
    pytest.importorskip("ray.data", reason="Ray is not installed: pip install 'prefixcache[ray]'")

from prefixcache.scaleout.inputs import input_format  # noqa: E402
from prefixcache.scaleout.job import RayCluster, WorkerSpec  # noqa: E402
from prefixcache.scaleout.ray import FAIL_ONCE_ENV, run_ray_classify  # noqa: E402
from prefixcache.scaleout.resources import check_gpus, cpus_per_worker  # noqa: E402
from prefixcache.scaleout.blocks import ROW, Finisher, prediction_line, record_of  # noqa: E402
from prefixcache.scaleout.sink import PartWriter  # noqa: E402
from prefixcache.scaleout.summary import RaySummary, Tally  # noqa: E402

BATCH = 8
ROWS_PER_CALL = 20  # 200 records -> 10 calls, spread over the 2 actors


# ---------------------------------------------------------------------------
# Without Ray
# ---------------------------------------------------------------------------


def test_record_of_maps_rows_like_the_local_reader():
    record = record_of({"tid": "T1", "body": "refund", "lang": "en"}, "body", "tid")
    assert record == Record("T1", {"tid": "T1", "lang": "en", "text": "refund"})
    assert record_of({"body": None}, "body", None) == Record(ROW, {})  # null text: reported by the runner
    missing = record_of({"tid": " ", "body": "x"}, "body", "tid")
    assert missing.id is None and missing.error == f"{ROW}: missing id field 'tid'"
    bad = record_of({"tid": 1.5, "body": "x"}, "body", "tid")
    assert "must be a string or an integer, not float" in bad.error


def test_finisher_numbers_rows_locates_errors_and_flags_repeated_ids():
    numbered = Finisher("in.csv", None)
    line, failed = numbered.finish('{"id": null, "label": "billing"}', None, None)
    assert (json.loads(line)["id"], failed) == (0, False)
    error = f"record {ROW!r}: missing field 'text' (the task's input_template needs it)"
    line, failed = numbered.finish(prediction_line(Prediction(ROW, error=error)), None, error)
    assert failed and json.loads(line) == {
        "id": 1, "label": None, "scores": None, "margin": None,
        "error": "record 1: missing field 'text' (the task's input_template needs it)",
    }

    keyed = Finisher("in.jsonl", "tid")
    first = prediction_line(Prediction("T1", error="record 'T1': missing field 'text'"))
    assert keyed.finish(first, "T1", "record 'T1': missing field 'text'") == (first, True)
    line, failed = keyed.finish('{"id": "T1", "label": "billing"}', "T1", None)
    assert failed and keyed.duplicates == 1
    assert json.loads(line)["error"].startswith("in.jsonl: row 1: duplicate id 'T1' (first used at in.jsonl: row 0)")
    no_id = f"{ROW}: missing id field 'tid'"
    line, _ = keyed.finish(prediction_line(Prediction(None, error=no_id)), None, no_id)
    assert json.loads(line)["error"] == "in.jsonl: row 2: missing id field 'tid'"


def test_part_writer_rolls_parts_and_refuses_a_used_folder(tmp_path):
    writer = PartWriter(tmp_path / "out", rows_per_part=2)
    for n in range(5):
        writer.write(f'{{"n": {n}}}')
    writer.close({"records": 5})
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl", "summary.json"]
    lines = [line for p in writer.parts for line in p.read_text().splitlines()]
    assert [json.loads(line)["n"] for line in lines] == [0, 1, 2, 3, 4]
    with pytest.raises(InputError, match="already holds results"):
        PartWriter(tmp_path / "out")

    aborted = PartWriter(tmp_path / "half", rows_per_part=2)
    for n in range(3):
        aborted.write("{}")
    aborted.abort()
    assert sorted(p.name for p in (tmp_path / "half").iterdir()) == ["part-00000.jsonl"]


def test_input_format_errors_say_what_to_do(tmp_path):
    assert input_format("s3://bucket/tickets.parquet") == "parquet"
    assert input_format("x.ndjson") == "jsonl"
    (tmp_path / "a.csv").write_text("text\nhi\n")
    assert input_format(str(tmp_path)) == "csv"
    with pytest.raises(InputError, match="not stdin"):
        input_format("-")
    with pytest.raises(InputError, match="cannot tell its format"):
        input_format(str(tmp_path / "tickets.txt"))


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    import sys

    from prefixcache.scaleout import RayNotInstalledError
    from prefixcache.scaleout import run_ray_classify as lazy_run

    monkeypatch.delitem(sys.modules, "prefixcache.scaleout.ray")
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` fail as if it were not installed
    with pytest.raises(RayNotInstalledError, match=r"pip install 'prefixcache\[ray\]'"):
        lazy_run("in.jsonl", None, WorkerSpec("support-tickets"))


def test_one_cpu_stays_free_for_ray_datas_own_tasks():
    assert cpus_per_worker(threads=1, workers=2, cluster_cpus=2) == 0.5  # reads and listings still get a CPU
    assert cpus_per_worker(threads=4, workers=8, cluster_cpus=64) == 4.0  # room enough: as asked
    assert cpus_per_worker(threads=2, workers=1, cluster_cpus=0) == 2.0  # no CPU figure (a GPU-only view)


def test_gpus_a_local_ray_lacks_are_refused_at_once():
    check_gpus(0, workers=4, cluster_gpus=0, local=True)  # no GPUs asked: fine
    check_gpus(0.5, workers=2, cluster_gpus=1, local=True)  # two workers share one GPU
    check_gpus(1, workers=8, cluster_gpus=0, local=False)  # a remote cluster may autoscale: Ray waits
    with pytest.raises(ResourceError, match=r'num_gpus="1" for 2 worker\(s\) needs 2 GPU\(s\).*has 1'):
        check_gpus(1, workers=2, cluster_gpus=1, local=True)


def test_summary_counts_rows_per_worker():
    tally = Tally()
    for worker, seconds in [("a:1", 0.5), ("a:1", 0.5), ("b:2", 0.25)]:
        tally.add({"worker": worker, "seconds": seconds, "load_seconds": 2.0, "prefix_seconds": 0.1,
                   "prefix_source": "computed"})
    summary = RaySummary(3, 0, 0, 2.0, 1.5, 2, tuple(tally.workers.values()))
    by_name = {w.worker: w for w in summary.workers}
    assert by_name["a:1"].records == 2 and by_name["a:1"].items_per_second == pytest.approx(2.0)
    assert summary.items_per_second == pytest.approx(1.5)
    assert summary.lines()[-1].startswith("total: 3 records (0 errors) in 2.0 s wall = 1.5 items/s")
    assert summary.to_json()["workers"][0]["items_per_second"] > 0


# ---------------------------------------------------------------------------
# With a local Ray
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fail_marker(tmp_path_factory):
    """The fault-injection marker. It exists (no fault) unless a test deletes it."""
    marker = tmp_path_factory.mktemp("fault") / "failed-once"
    marker.touch()
    return marker


@pytest.fixture(scope="module")
def local_ray(fail_marker):
    """A local Ray for this module: 2 CPUs, no dashboard; the workers see the fault marker's path."""
    import ray

    os.environ[FAIL_ONCE_ENV] = str(fail_marker)  # inherited by the Ray processes started below
    try:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        yield
    finally:
        ray.shutdown()
        os.environ.pop(FAIL_ONCE_ENV, None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, "qwen2")


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("task") / "task.yaml"
    path.write_text(TASK_YAML)
    return str(path)


@pytest.fixture(scope="module")
def local_classifier(model_dir, task_file):
    return Classifier(load_model(model_dir, "float32", 1), load_task(task_file))


def _local_lines(classifier, source, text_field, id_field):
    """What a local run writes for ``source``, as parsed JSON lines."""
    records = data.scan_records(source, text_field, id_field)
    return [p.to_json() for p in classifier.classify(records, RunConfig("batched", BATCH))]


def _ray_lines(summary):
    return [json.loads(line) for part in summary.parts for line in open(part, encoding="utf-8")]


def _assert_same_lines(ray_lines, local_lines):
    assert len(ray_lines) == len(local_lines), "every input row gives exactly one output line"
    for n, (got, want) in enumerate(zip(ray_lines, local_lines)):
        assert got["id"] == want["id"], f"row {n}: ids out of order or renumbered"
        assert got["label"] == want["label"], f"row {n} ({want['id']}): Ray's label differs from the local run's"
        assert (got.get("error") is None) == (want.get("error") is None), f"row {n}: error on one side only"
        assert (got["scores"] is None) == (want["scores"] is None), f"row {n}: scored on one side only"
        for label, p in (want["scores"] or {}).items():
            drift = abs(math.log(got["scores"][label]) - math.log(p))
            assert drift <= 1e-4, f"row {n}: Ray's log P({label}) is {drift:.2e} from the local run's (float32 noise is < 1e-4)"


@pytest.mark.ray
def test_two_actors_give_the_local_runs_lines(local_ray, model_dir, task_file, local_classifier, tmp_path):
    tickets = generate_tickets(200)
    tickets[5]["text"] = None  # reported on its own line, as locally
    tickets[7]["id"] = tickets[3]["id"]  # a repeated id: an error line, as locally
    source = tmp_path / "tickets.jsonl"
    source.write_text("".join(json.dumps(t) + "\n" for t in tickets))
    log: list[str] = []

    spec = WorkerSpec(task_file, model_dir, "float32", config=RunConfig(batch_size=BATCH), id_field="id")
    cluster = RayCluster(workers=2, rows_per_call=ROWS_PER_CALL)
    summary = run_ray_classify(str(source), tmp_path / "out", spec, cluster, log.append, progress=False)

    _assert_same_lines(_ray_lines(summary), _local_lines(local_classifier, source, "text", "id"))
    assert (summary.records, summary.errors, summary.duplicates) == (200, 2, 1)
    # Which actor gets which block is Ray's scheduling: on a loaded 2-core machine one actor may take them all.
    assert 1 <= len(summary.workers) <= 2 and sum(w.records for w in summary.workers) == 200, summary.lines()
    assert all(w.items_per_second > 0 and w.load_seconds > 0 for w in summary.workers)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["records"] == 200
    assert any(line.startswith("total: 200 records") for line in log)


@pytest.mark.ray
def test_a_worker_that_dies_is_retried_and_no_row_is_lost_or_doubled(
    local_ray, fail_marker, model_dir, task_file, local_classifier, tmp_path
):
    source = tmp_path / "tickets.csv"
    with source.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["body"])
        writer.writerows([t["text"]] for t in generate_tickets(120, seed=1))
    fail_marker.unlink()  # arm the fault: the first worker to start its second call dies

    spec = WorkerSpec(task_file, model_dir, "float32", config=RunConfig(batch_size=BATCH), text_field="body")
    cluster = RayCluster(workers=2, rows_per_call=ROWS_PER_CALL)
    summary = run_ray_classify(str(source), tmp_path / "out", spec, cluster, lambda line: None, progress=False)

    assert fail_marker.exists(), "the fault was never injected: no worker reached its second call"
    lines = _ray_lines(summary)
    assert [line["id"] for line in lines] == list(range(120)), "a row was lost, doubled or reordered"
    _assert_same_lines(lines, _local_lines(local_classifier, source, "body", None))
    assert summary.records == 120 and summary.errors == 0


@pytest.mark.ray
def test_a_local_run_asking_for_gpus_it_lacks_fails_before_starting_workers(local_ray, model_dir, task_file, tmp_path):
    """Without the check, the workers would wait for GPUs until --start-timeout (900 s by default).
    (64 GPUs: more than any machine this runs on has.)"""
    source = tmp_path / "tickets.jsonl"
    source.write_text('{"text": "refund"}\n')
    with pytest.raises(ResourceError, match="GPU"):
        run_ray_classify(str(source), tmp_path / "out", WorkerSpec(task_file, model_dir),
                         RayCluster(workers=1, num_gpus=64), lambda line: None, progress=False)
    assert not list((tmp_path / "out").glob("part-*.jsonl"))


@pytest.mark.ray
def test_an_error_on_a_worker_reaches_the_caller_as_itself(local_ray, task_file, tmp_path):
    source = tmp_path / "tickets.jsonl"
    source.write_text('{"text": "refund"}\n')
    # ray_address skips the check on this machine, so the worker itself meets the unknown model
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'") as caught:
        run_ray_classify(str(source), tmp_path / "out", WorkerSpec(task_file, "no-such-model"),
                         RayCluster("auto", workers=1), lambda line: None, progress=False)
    assert "Failed to apply UDF" not in str(caught.value), "Ray's retry note leaked into the message"
    assert not list((tmp_path / "out").glob("part-*.jsonl")), "a failed run leaves no half part"
