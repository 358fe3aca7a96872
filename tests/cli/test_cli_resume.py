"""classify --resume: a job killed with SIGKILL continues where it stopped; every id ends up in the output exactly once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixcache.io import journal as resume
from prefixcache.io.job_file import job_path
from prefixcache.cli.app import app
from prefixcache.errors import InputError
from prefixcache.scheduler.classify import LabelScores, Prediction, Record

from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML, TEXTS

runner = CliRunner()
N = 80  # records in the killed job: enough that it cannot finish between our poll and the kill


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, "qwen2")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A task file and an input of N records with ids r0..r{N-1}."""
    folder = tmp_path_factory.mktemp("job")
    (folder / "task.yaml").write_text(TASK_YAML)
    rows = [{"id": f"r{i}", "text": f"{TEXTS[i % len(TEXTS)]} (ticket {i})"} for i in range(N)]
    (folder / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _args(model_dir, job, out, *extra):
    return ["classify", str(job / "in.jsonl"), "--task", str(job / "task.yaml"), "--model", model_dir,
            "--dtype", "float32", "--threads", "1", "--id-field", "id", "--batch-size", "2", "--window", "4",
            "--out", str(out), *extra]


def _run(args, **kw):
    return runner.invoke(app, args, catch_exceptions=False, **kw)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _complete_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.fixture(scope="module")
def uninterrupted(model_dir, job, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    result = _run(_args(model_dir, job, out))
    assert result.exit_code == 0, result.output
    shutil.copy(job_path(out), job / "job.json")  # the job file of this job, for outputs written by hand below
    return _rows(out)


def _hand_written(out: Path, rows: list[dict], job) -> None:
    """``rows`` as the output ``out`` of this very job (its job file beside it), as a killed run leaves it."""
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copy(job / "job.json", job_path(out))


def _assert_same_job(rows: list[dict], reference: list[dict]) -> None:
    ids = [r["id"] for r in rows]
    assert ids == [f"r{i}" for i in range(N)], "every id exactly once, in input order"
    assert [r["label"] for r in rows] == [r["label"] for r in reference], "labels identical to an uninterrupted run"
    for got, want in zip(rows, reference):
        for label, p in want["scores"].items():
            assert abs(got["scores"][label] - p) < 1e-5, f"{got['id']}: scores drifted"


def test_sigkill_midway_then_resume(model_dir, job, uninterrupted, tmp_path):
    out, log = tmp_path / "out.jsonl", tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "prefixcache", *_args(model_dir, job, out, "--resume")]
    with log.open("w") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=os.environ | {"PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 240
        while proc.poll() is None and _complete_lines(out) < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        running = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert running, f"the job ended before it could be killed (rc {proc.returncode}):\n{log.read_text()[-2000:]}"
    assert proc.returncode == -signal.SIGKILL
    killed_at = _complete_lines(out)
    assert 4 <= killed_at < N, f"killed after {killed_at} of {N} lines: not midway"
    with out.open("ab") as fh:  # and a torn write on top, as a kill inside write() leaves
        fh.write(b'{"id": "r' + str(killed_at).encode() + b'", "label": "bil')

    result = _run(_args(model_dir, job, out, "--resume"))
    assert result.exit_code == 0, result.output
    assert f"resumed after {killed_at} lines" in result.output and "cut a torn last line" in result.output
    _assert_same_job(_rows(out), uninterrupted)


def test_resume_with_nothing_yet_and_after_the_end(model_dir, job, uninterrupted, tmp_path):
    out = tmp_path / "out.jsonl"
    assert _run(_args(model_dir, job, out, "--resume")).exit_code == 0, "no output yet: a fresh start"
    _assert_same_job(_rows(out), uninterrupted)
    before = out.read_bytes()
    result = _run(_args(model_dir, job, out, "--resume"))
    assert result.exit_code == 0 and f"resumed after {N} lines" in result.output
    assert out.read_bytes() == before, "a finished job resumed again writes nothing"


def test_fail_fix_resume(model_dir, job, uninterrupted, tmp_path):
    """--on-error fail stops at a bad record without writing it; fixed and resumed, the job ends as if never stopped."""
    rows = [json.loads(line) for line in (job / "in.jsonl").read_text().splitlines()]
    broken = tmp_path / "in.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines[37] = '{"id": "r37", "text": oops}'
    broken.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    args = _args(model_dir, job, out, "--resume", "--on-error", "fail")
    args[1] = str(broken)
    result = _run(args)
    assert result.exit_code == 2 and "in.jsonl:38: not valid JSON" in result.output
    assert [r["id"] for r in _rows(out)] == [f"r{i}" for i in range(37)]
    broken.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert _run(args).exit_code == 0
    _assert_same_job(_rows(out), uninterrupted)


def test_exit_code_counts_failures_written_before_the_resume(model_dir, job, uninterrupted, tmp_path):
    out = tmp_path / "out.jsonl"
    failed = dict(uninterrupted[0], label=None, scores=None, margin=None, error="an earlier failure")
    _hand_written(out, [failed, *uninterrupted[1:]], job)
    result = _run(_args(model_dir, job, out, "--resume"))
    assert result.exit_code == 1 and "(1 errors)" in result.output


def test_resume_refuses_an_output_of_another_input(model_dir, job, uninterrupted, tmp_path):
    out = tmp_path / "out.jsonl"
    _hand_written(out, [dict(r, id=f"x{i}") for i, r in enumerate(uninterrupted[:3])], job)
    result = _run(_args(model_dir, job, out, "--resume"))
    assert result.exit_code == 2
    assert "out.jsonl:1 is for id 'x0' but input row 0 has id 'r0'" in result.output


def test_resume_needs_out(model_dir, job):
    args = _args(model_dir, job, "x")
    result = runner.invoke(app, args[: args.index("--out")] + ["--resume"])
    assert result.exit_code == 2 and "--resume needs --out" in result.output


# --- the journal logic on its own -------------------------------------------------------------------------------


def _line(i: int, error: str | None = None) -> bytes:
    if error:
        return json.dumps({"id": i, "label": None, "scores": None, "margin": None, "error": error}).encode() + b"\n"
    return json.dumps({"id": i, "label": "a", "scores": {"a": 1.0}, "margin": 1.0}).encode() + b"\n"


def test_recover_missing_empty_and_complete(tmp_path):
    path = tmp_path / "out.jsonl"
    assert resume.recover(path) == resume.Recovered()
    path.write_bytes(b"")
    assert resume.recover(path).lines == 0
    path.write_bytes(_line(0) + _line(1, "bad") + _line(2))
    done = resume.recover(path)
    assert (done.lines, done.failed, list(done.ids), done.cut_bytes) == (3, 1, [0, 1, 2], 0)


@pytest.mark.parametrize("tail", [b'{"id": 3, "lab', _line(3)[:-1], b"\x00" * 4096, b"\x00\x00\x00\n"])
def test_recover_cuts_a_torn_last_line(tmp_path, tail):
    path = tmp_path / "out.jsonl"
    good = _line(0) + _line(1) + _line(2)
    path.write_bytes(good + tail)
    done = resume.recover(path)
    assert (done.lines, done.cut_bytes) == (3, len(tail))
    assert path.read_bytes() == good, "the torn line is cut off the file"


def test_recover_refuses_a_garbled_middle_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(_line(0) + b"not json\n" + _line(2))
    with pytest.raises(InputError, match=r"out.jsonl:2: not a prediction line"):
        resume.recover(path)


def test_check_matches(tmp_path):
    records = [Record(i, {"text": "x"}) for i in range(3)]
    resume.check_matches(resume.Recovered(2, 0, [0, 1]), records, tmp_path / "o")
    with pytest.raises(InputError, match="has 4 lines but the input has only 3 rows"):
        resume.check_matches(resume.Recovered(4, 0, [0, 1, 2, 3]), records, tmp_path / "o")
    with pytest.raises(InputError, match=r"o:2 is for id 5 but input row 1 has id 1"):
        resume.check_matches(resume.Recovered(2, 0, [0, 5]), records, tmp_path / "o")


def test_write_predictions_syncs_every_window_and_at_the_end(tmp_path, monkeypatch):
    synced: list[int] = []
    path = tmp_path / "out.jsonl"
    monkeypatch.setattr(resume.os, "fsync", lambda fd: synced.append(_complete_lines(path)))
    scores = LabelScores(("a", "b"), (-0.1, -2.4))
    predictions = [Prediction(i, scores) for i in range(7)]
    with path.open("w") as sink:
        written = resume.write_predictions(predictions, sink, sync_every=3)
    assert written == resume.Written(7, 0, 0)
    assert synced == [3, 6, 7], "durable after every window of 3 lines, and at the end"


def test_write_predictions_fail_policy_stops_before_the_failed_record(tmp_path):
    scores = LabelScores(("a", "b"), (-0.1, -2.4))
    predictions = [Prediction(0, scores), Prediction(1, error="record 1: missing field 'text'"), Prediction(2, scores)]
    path = tmp_path / "out.jsonl"
    with path.open("w") as sink, pytest.raises(InputError, match="record 1: missing field 'text'\nstopped by on_error=\"fail\" after 1 lines"):
        resume.write_predictions(predictions, sink, "fail", sync_every=2)
    assert [r["id"] for r in _rows(path)] == [0]
