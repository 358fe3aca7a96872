"""The output journal (``resume``) on its own: what ``recover`` keeps, cuts and refuses, what
``check_matches`` accepts, and what ``write_predictions`` writes, counts and syncs.

The end-to-end kill-and-resume tests (tests/cli/test_cli_resume.py) run the CLI in a subprocess;
these pin each rule of the journal in-process, one rule per test.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os

import pytest

from prefixcache.io import journal as resume
from prefixcache.errors import InputError
from prefixcache.scheduler.classify import Prediction, Record
from prefixcache.engine.scoring import LabelScores

SCORES = LabelScores(("a", "b"), (-0.1, -2.4))


def line(value) -> bytes:
    return json.dumps(value).encode() + b"\n"


def ok(i) -> bytes:
    return line({"id": i, "label": "a", "scores": {"a": 1.0}, "margin": 1.0})


@pytest.mark.parametrize(
    "last", [line([1, 2]), line({"label": "a"}), b"\xff\xfe not utf-8\n", b"plain text\n"], ids=["list", "no-id", "bytes", "text"]
)
def test_a_complete_last_line_that_is_not_a_prediction_is_refused_not_cut(tmp_path, last):
    """Only a line a crash can leave (no newline, or zero bytes) is cut; a whole foreign line is refused."""
    path = tmp_path / "out.jsonl"
    path.write_bytes(ok(0) + ok(1) + last)
    with pytest.raises(InputError, match=r"out.jsonl:3: not a prediction line") as refused:
        resume.recover(path)
    assert "was not written by 'prefixcache classify' or was edited. Move it aside, or choose another out" in str(
        refused.value
    ), "the message says what to do next"
    assert path.read_bytes() == ok(0) + ok(1) + last, "a refused file is left as it was"


@pytest.mark.parametrize("middle", [line([1]), line({"label": "a"}), b"\x00\x00\n"], ids=["list", "no-id", "zeros"])
def test_a_bad_line_before_the_last_is_refused_even_if_it_looks_torn(tmp_path, middle):
    path = tmp_path / "out.jsonl"
    path.write_bytes(ok(0) + middle + ok(2))
    with pytest.raises(InputError, match=r"out.jsonl:2: not a prediction line"):
        resume.recover(path)


def _listed(done: resume.Recovered) -> resume.Recovered:
    """``done`` with its ids read into a list, to compare."""
    return dataclasses.replace(done, ids=list(done.ids))


def test_recover_counts_error_lines_and_keeps_string_and_list_ids(tmp_path):
    path = tmp_path / "out.jsonl"
    err = line({"id": "r-2", "label": None, "scores": None, "margin": None, "error": "bad"})
    explicit_null = line({"id": ["k", 3], "label": "a", "error": None})
    path.write_bytes(ok("r-1") + err + explicit_null + err)
    done = resume.recover(path)
    assert _listed(done) == resume.Recovered(4, 2, ["r-1", "r-2", ["k", 3], "r-2"], 0)
    assert isinstance(done.ids, resume.JournalIds), "the ids are read again from the file, not held"


def test_recover_cuts_a_torn_tail_and_makes_the_cut_durable(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(resume.os, "fsync", lambda fd: synced.append(fd))
    path = tmp_path / "out.jsonl"
    path.write_bytes(ok(0) + b'{"id": 1, "la')
    done = resume.recover(path)
    assert (done.lines, list(done.ids), done.cut_bytes) == (1, [0], len(b'{"id": 1, "la'))
    assert path.read_bytes() == ok(0)
    assert len(synced) == 1, "the truncation is fsynced"
    assert _listed(resume.recover(path)) == resume.Recovered(1, 0, [0], 0), "recovering again cuts nothing"


def test_a_torn_only_line_leaves_an_empty_file(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": 0')
    assert _listed(resume.recover(path)) == resume.Recovered(0, 0, [], 8)
    assert path.read_bytes() == b""


def test_check_matches_accepts_a_finished_output_and_ids_as_json_reads_them(tmp_path):
    records = [Record(("k", 1), {"text": "x"}), Record("é", {"text": "y"}), Record(7, {"text": "z"})]
    done = resume.Recovered(3, 0, [["k", 1], "é", 7])  # tuples read back as lists
    resume.check_matches(done, records, tmp_path / "o")  # as many lines as rows: finished, not foreign
    resume.check_matches(resume.Recovered(), records, tmp_path / "o")
    with pytest.raises(InputError, match=r"o:1 is for id \['k', 2\] but input row 0 has id \['k', 1\]"):
        resume.check_matches(resume.Recovered(1, 0, [["k", 2]]), records, tmp_path / "o")
    with pytest.raises(InputError, match=r"o:3 is for id 8 but input row 2 has id 7"):
        resume.check_matches(resume.Recovered(3, 0, [["k", 1], "é", 8]), records, tmp_path / "o")


def test_write_predictions_counts_errors_and_warnings_and_writes_utf8_json_lines():
    predictions = [
        Prediction("é-0", SCORES),
        Prediction(1, error="record 1: missing field 'text'"),
        Prediction(2, SCORES, warning="field 'text' is blank"),
        Prediction(3, SCORES, truncated=True, warning="cut"),
    ]
    sink = io.StringIO()
    written = resume.write_predictions(predictions, sink)
    assert written == resume.Written(lines=4, failed=1, flagged=2)
    text = sink.getvalue()
    assert '"é-0"' in text, "non-ASCII is written as is (ensure_ascii=False)"
    assert text.endswith("\n") and text.count("\n") == 4
    assert [json.loads(x) for x in text.splitlines()] == [p.to_json() for p in predictions]


def test_write_predictions_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="on_error must be one of"):
        resume.write_predictions([], io.StringIO(), on_error="ignore")


def test_without_sync_every_it_flushes_and_never_fsyncs(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(resume.os, "fsync", lambda fd: synced.append(fd))
    path = tmp_path / "out.jsonl"
    with path.open("w") as sink:
        resume.write_predictions([Prediction(i, SCORES) for i in range(5)], sink)
        assert path.read_text().count("\n") == 5, "flushed before returning"
    assert synced == []


def test_a_pipe_is_flushed_not_fsynced(monkeypatch):
    synced = []
    monkeypatch.setattr(resume.os, "fsync", lambda fd: synced.append(fd))
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as sink, os.fdopen(read_end) as source:
        written = resume.write_predictions([Prediction(i, SCORES) for i in range(3)], sink, sync_every=1)
        assert written.lines == 3
        assert source.readline().startswith('{"id": 0'), "the pipe got the lines"
    assert synced == []


def test_the_fail_policy_syncs_what_it_wrote_before_stopping(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    synced = []
    monkeypatch.setattr(resume.os, "fsync", lambda fd: synced.append(path.read_text().count("\n")))
    predictions = [Prediction(0, SCORES), Prediction(1, SCORES), Prediction(2, SCORES), Prediction(3, error="bad")]
    with path.open("w") as sink, pytest.raises(InputError, match="after 3 lines"):
        resume.write_predictions(predictions, sink, "fail", sync_every=2)
    assert synced == [2, 3], "synced at the window, and again on the way out"
    # under skip the same records are all written, the error as an error line
    with (tmp_path / "skip.jsonl").open("w") as sink:
        assert resume.write_predictions(predictions, sink, "skip") == resume.Written(4, 1, 0)


# --- the messages say what to do next (each names the settings to change; mutation testing found them unpinned) ---


def test_check_matches_messages_name_the_settings_to_change(tmp_path):
    records = [Record(i, {"text": "x"}) for i in range(3)]
    with pytest.raises(InputError) as longer:
        resume.check_matches(resume.Recovered(4, 0, [0, 1, 2, 3]), records, tmp_path / "o")
    assert str(longer.value) == (f"{tmp_path / 'o'} has 4 lines but the input has only 3 rows: it belongs to another "
                                 "input. Move it aside, or choose another out")
    with pytest.raises(InputError) as other:
        resume.check_matches(resume.Recovered(2, 0, [0, 5]), records, tmp_path / "o")
    assert str(other.value) == (f"{tmp_path / 'o'}:2 is for id 5 but input row 1 has id 1: the output belongs to "
                                "another input (or id_field). Move it aside, or choose another out")


def test_skip_done_streams_the_rest_and_refuses_a_shorter_or_other_input(tmp_path):
    records = [Record(i, {"text": "x"}) for i in range(4)]
    rest = resume.skip_done(resume.Recovered(2, 0, [0, 1]), iter(records), tmp_path / "o")
    assert [r.id for r in rest] == [2, 3]
    with pytest.raises(InputError) as refused:  # an InputError, not the StopIteration of a bare next()
        list(resume.skip_done(resume.Recovered(3, 0, [0, 1, 2]), iter(records[:2]), tmp_path / "o"))
    assert str(refused.value) == (f"{tmp_path / 'o'} has 3 lines but the input has only 2 rows: it belongs to another "
                                  "input. Move it aside, or choose another out")
    with pytest.raises(InputError, match=r"o:2 is for id 7 but input row 1 has id 1"):
        list(resume.skip_done(resume.Recovered(2, 0, [0, 7]), iter(records), tmp_path / "o"))


def test_the_fail_policy_says_how_to_go_on(tmp_path):
    predictions = [Prediction(0, SCORES), Prediction(1, error="record 1: no field 'text'")]
    with pytest.raises(InputError) as stopped:
        resume.write_predictions(predictions, io.StringIO(), "fail")
    assert str(stopped.value) == ("record 1: no field 'text'\nstopped by on_error=\"fail\" after 1 lines; fix the input, "
                                  "then rerun with resume to continue from this record (or use on_error=\"skip\")")
