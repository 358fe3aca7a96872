"""Jobs stream from reader to writer (issue 18, item 1): memory does not grow with the input.

The real CLI (``python -m prefixcache classify``) runs in a subprocess on a tiny model saved to a folder,
over 10,000 and then 1,000,000 rows, and its resident memory is sampled while it runs (psutil). The
peaks must lie within 100 MB of each other. This is the slowest test of the suite (a few minutes:
a million records really are classified and written); it runs in CI like every other.

A cheaper test runs in seconds: rows that all fail (no text field, so no model work) with ``--id-field``, at
20,000 and 100,000 rows; the exact peaks (each child's ``VmHWM``) may differ by no more than
:data:`BYTES_PER_ROW` a row. A dict of every id seen cost about 235 bytes a row there (``io/seen_ids.py`` keeps 16).

Also here: the cheap row count behind the progress bar, and streaming pieces (a Parquet file read a
batch at a time, ``--resume`` skipping done rows as they stream past).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from prefixcache.io.journal import Recovered, skip_done
from prefixcache.io.records import count_rows, scan_records
from prefixcache.errors import InputError
from prefixcache.types import Record

import torch

from prefixcache.model.load import LoadedModel, build_random_model

from tests.support.models import make_tokenizer, save_tiny_model, tiny_config
from tests.support.tasks import TASK_YAML

ALLOWED_GROWTH = 100 * 2**20
BYTES_PER_ROW = 96  # peak growth a row allowed between the two cheap runs (16 for the ids, the rest noise)


def _smallest_model(tmp_path_factory) -> str:
    """A one-layer model 16 wide: the job's own memory, not the model's arithmetic, is what is measured."""
    tokenizer = make_tokenizer()
    config = tiny_config("llama", len(tokenizer)).to_dict() | dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    config.pop("layer_types", None)
    model = build_random_model(type(tiny_config("llama", 8)).from_dict(config), seed=0)
    return save_tiny_model(tmp_path_factory, loaded=LoadedModel(model, tokenizer, "tiny-flat", "tiny-flat", torch.float32,
                                                                torch.device("cpu")))


def _write_rows(path: Path, n: int) -> Path:
    words = ("refund", "crash", "password", "invoice", "login", "error", "charge", "sync")
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"text": f"{words[i % 8]} {words[(i // 8) % 8]} ticket {i}"}) + "\n")
    return path


def _peak_rss(args: list[str], log: Path) -> tuple[int, float]:
    """Run ``python -m prefixcache *args`` (standard error to ``log``: a pipe nobody reads would fill up with the
    progress bar and stall the job); its peak resident memory (sampled every 20 ms) and seconds."""
    started = time.perf_counter()
    with log.open("wb") as stderr:
        child = subprocess.Popen([sys.executable, "-m", "prefixcache", *args], stdout=subprocess.DEVNULL, stderr=stderr)
        process, peak = psutil.Process(child.pid), 0
        while child.poll() is None:
            try:
                peak = max(peak, process.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
    assert child.returncode == 0, log.read_text(errors="replace")[-2000:]
    return peak, time.perf_counter() - started


@pytest.fixture
def scratch(tmp_path):
    """A folder in memory (tmpfs) where there is one: the job fsyncs its output every window, and on a shared
    disk those syncs, not the job, would set the pace of a million rows. Memory is what is measured here."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="prefixcache-stream-", dir=shm))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_a_million_rows_take_no_more_memory_than_ten_thousand(tmp_path_factory, scratch):
    model = _smallest_model(tmp_path_factory)
    (scratch / "task.yaml").write_text(TASK_YAML)
    peaks = {}
    for n in (10_000, 1_000_000):
        rows = _write_rows(scratch / f"rows-{n}.jsonl", n)
        out = scratch / f"out-{n}.jsonl"
        peaks[n], seconds = _peak_rss(["classify", str(rows), "--task", str(scratch / "task.yaml"), "--model", model,
                                       "--dtype", "float32", "--threads", "1", "--batch-size", "256", "--out", str(out)],
                                      scratch / f"stderr-{n}.txt")
        with out.open("rb") as fh:
            assert sum(1 for _ in fh) == n
        print(f"\n[streaming] {n:,} rows: peak RSS {peaks[n] / 2**20:.0f} MiB in {seconds:.0f} s")
        rows.unlink()
        out.unlink()
    growth = peaks[1_000_000] - peaks[10_000]
    assert growth <= ALLOWED_GROWTH, f"peak RSS grew by {growth / 2**20:.0f} MiB from 10k to 1M rows"


# The child reports its own peak (VmHWM: the high-water mark of its resident memory since exec) as it exits. Its
# ru_maxrss would not do: Linux starts a child's count at exec from the parent's (pytest's, with torch) memory.
REPORT_PEAK = ("import atexit, os, runpy\n"
               "def report():\n"
               "    peak = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
               "    open(os.environ['PEAK_FILE'], 'w').write(peak)\n"
               "atexit.register(report)\n"
               "runpy.run_module('prefixcache', run_name='__main__', alter_sys=True)\n")


def _child_peak(args: list[str], log: Path) -> tuple[int, int]:
    """Run ``python -m prefixcache *args`` to its end; its exit code and its exact peak resident memory in bytes."""
    peak_file = log.with_suffix(".peak")
    with log.open("wb") as stderr:
        code = subprocess.call([sys.executable, "-c", REPORT_PEAK, *args], stdout=subprocess.DEVNULL, stderr=stderr,
                               env={**os.environ, "PEAK_FILE": str(peak_file)})
    return code, int(peak_file.read_text()) * 1024  # kB


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak is read from /proc/self/status")
def test_failing_rows_with_ids_take_no_memory_per_row(tmp_path_factory, scratch):
    model = _smallest_model(tmp_path_factory)
    (scratch / "task.yaml").write_text(TASK_YAML)
    peaks = {}
    for n in (20_000, 100_000):
        rows = scratch / f"ids-{n}.jsonl"
        with rows.open("w") as fh:
            for i in range(n):  # no "text": every row fails before the model, and its id is remembered
                fh.write(json.dumps({"id": f"ticket-{i:08d}", "body": f"refund ticket {i}"}) + "\n")
        out = scratch / f"ids-out-{n}.jsonl"
        code, peaks[n] = _child_peak(["classify", str(rows), "--task", str(scratch / "task.yaml"), "--model", model,
                                      "--threads", "1", "--id-field", "id", "--out", str(out)], scratch / f"ids-{n}.txt")
        assert code == 1, (scratch / f"ids-{n}.txt").read_text(errors="replace")[-2000:]
        with out.open("rb") as fh:
            assert sum(1 for line in fh if b'"error"' in line) == n
    per_row = (peaks[100_000] - peaks[20_000]) / 80_000
    print(f"\n[ids] peak RSS {peaks[20_000] / 2**20:.1f} then {peaks[100_000] / 2**20:.1f} MiB: {per_row:.0f} bytes a row")
    assert per_row <= BYTES_PER_ROW, (
        f"peak RSS grew {per_row:.0f} bytes a row from 20,000 to 100,000 failing rows with --id-field "
        f"({peaks[20_000] / 2**20:.1f} -> {peaks[100_000] / 2**20:.1f} MiB): something keeps every row (or its id) again")


def test_count_rows_counts_without_parsing_and_says_none_for_stdin(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"text": "a"}\n\n{"text": "b"}\nnot json at all\n')
    assert count_rows(jsonl) == 3 == sum(1 for _ in scan_records(jsonl))  # a bad row still counts: it gets a line
    csv_file = tmp_path / "a.csv"
    csv_file.write_text('text,label\n"two\nlines",x\nplain,y\n')
    assert count_rows(csv_file) == 2 == sum(1 for _ in scan_records(csv_file))
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"t{i}" for i in range(10_000)]}), parquet, row_group_size=3000)
    assert count_rows(parquet) == 10_000
    assert [r.fields["text"] for r in scan_records(parquet)][::2500] == ["t0", "t2500", "t5000", "t7500"]
    assert count_rows("-") is None and count_rows(tmp_path / "missing.jsonl") is None


def test_skip_done_consumes_only_the_done_rows_and_checks_their_ids(tmp_path):
    consumed = []

    def rows():
        for i in range(10):
            consumed.append(i)
            yield Record(i, {"text": "x"})

    rest = skip_done(Recovered(3, 0, [0, 1, 2]), rows(), tmp_path / "o")
    assert consumed == [0, 1, 2], "the done rows are read now, the rest only as the job asks"
    assert next(rest).id == 3
    with pytest.raises(InputError, match="o:2 is for id 9"):
        skip_done(Recovered(2, 0, [0, 9]), rows(), tmp_path / "o")
    with pytest.raises(InputError, match="has 12 lines but the input has only 10 rows"):
        skip_done(Recovered(12, 0, list(range(12))), rows(), tmp_path / "o")
