"""The bad-input corpus (tests/data/): every bad row gets an error line naming it and the field, nothing valid is lost.

The corpus and each case's expected outcome are listed in tests/data/README.md.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.io.records import read_records, scan_records, scan_rows, to_records
from prefixcache.errors import InputError
from prefixcache.scheduler.classify import Classifier, Record, RunConfig
from prefixcache.eval.verify import compare

from tests.support import paths
from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML

DATA = paths.DATA
JSONL = DATA / "bad_records.jsonl"
CSV = DATA / "bad_records.csv"
CONTEXT = 512  # max_position_embeddings of conftest's tiny models

# id (or "file:line" for rows without a usable id) -> what its output line must hold:
# "ok", "warning", "truncated", or the words its error must contain.
JSONL_EXPECTED = {
    "ok-1": "ok",
    "empty": "warning",
    "spaces": "warning",
    "huge": "truncated",
    "bad-utf8": ["bad_records.jsonl:5", "field 'text'", "UTF-8", "0xe9"],
    "no-text": ["record 'no-text'", "missing field 'text'"],
    "bad_records.jsonl:7": ["duplicate id 'ok-1'", "bad_records.jsonl:1"],
    "number": "ok",
    "list": ["record 'list'", "field 'text'", "not list"],
    "bool": ["record 'bool'", "field 'text'", "not bool"],
    "null": ["record 'null'", "missing field 'text'"],
    "object": ["record 'object'", "field 'text'", "not dict"],
    "bad_records.jsonl:13": ["id field 'id'", "not float"],
    "bad_records.jsonl:14": ["id field 'id'", "not list"],
    "bad_records.jsonl:15": ["not valid JSON"],
    "bad_records.jsonl:16": ["must be a JSON object", "array"],
    "surrogate": ["bad_records.jsonl:17", "field 'text'", "U+D800"],
    "ok-2": "ok",
    "unicode": "ok",
    "ok-last": "ok",
}
CSV_EXPECTED = {
    "ok-1": "ok",
    "quoted": "ok",
    "empty": "warning",
    "bad-utf8": ["bad_records.csv:6", "field 'text'", "UTF-8"],
    "bad_records.csv:7": ["4 field(s)", "header has 3"],
    "bad_records.csv:8": ["2 field(s)", "header has 3"],
    "bad_records.csv:9": ["duplicate id 'quoted'", "bad_records.csv:3"],
    "commas": "ok",
    "ok-2": "ok",
}

runner = CliRunner()


@pytest.fixture(scope="module")
def loaded(tiny_qwen2):
    return tiny_qwen2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, loaded):
    return save_tiny_model(tmp_path_factory, loaded=loaded)


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("task") / "task.yaml"
    path.write_text(TASK_YAML)
    return str(path)


@pytest.fixture(scope="module")
def classifier(loaded):
    from prefixcache.task.definition import parse_task

    return Classifier(loaded, parse_task(TASK_YAML, "tiny.yaml"))


def _classify(model_dir, task_file, source, *extra, **kw):
    args = ["classify", str(source), "--task", task_file, "--model", model_dir, "--dtype", "float32", "--threads", "1",
            "--id-field", "id", "--batch-size", "3", *extra]
    return runner.invoke(app, args, catch_exceptions=False, **kw)


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _key(row: dict) -> str:
    """The id, or the 'file:line' an id-less error line names."""
    if row["id"] is not None:
        return row["id"]
    return row["error"].split(": ")[0].rsplit("/", 1)[-1]


def _check_outcomes(rows: list[dict], expected: dict) -> None:
    assert [_key(r) for r in rows] == list(expected), "one output line per input row, in input order"
    for row in rows:
        want = expected[_key(row)]
        context = f"output line for {_key(row)}: {row}"
        if isinstance(want, list):
            assert row["label"] is None and row["scores"] is None, context
            for words in want:
                assert words in row["error"], context
            continue
        assert row["label"] in {"billing", "technical", "account"} and "error" not in row, context
        assert row.get("truncated", False) == (want == "truncated"), context
        assert ("warning" in row) == (want in ("warning", "truncated")), context


def _valid_only_labels(classifier, source) -> dict:
    """Labels of the corpus's valid records, classified on their own (as if the bad rows were never there)."""
    good = [r for r in scan_records(source, id_field="id") if r.error is None]
    predictions = classifier.classify_all(good, RunConfig("batched", 4, overflow="truncate"))
    return {p.id: p.label for p in predictions if p.error is None}


def test_jsonl_corpus_under_skip(model_dir, task_file, classifier):
    result = _classify(model_dir, task_file, JSONL, "--overflow", "truncate")
    assert result.exit_code == 1, "a record failed, so the exit code is 1"
    rows = _lines(result.stdout)
    _check_outcomes(rows, JSONL_EXPECTED)
    alone = _valid_only_labels(classifier, JSONL)
    labelled = {r["id"]: r["label"] for r in rows if r["label"] is not None}
    assert labelled == alone, "every valid record is classified exactly as it would be without the bad rows"
    huge = next(r for r in rows if r["id"] == "huge")
    assert "100000" in huge["warning"] and f"context of {CONTEXT}" in huge["warning"]


def test_csv_corpus_under_skip(model_dir, task_file, classifier):
    result = _classify(model_dir, task_file, CSV)
    assert result.exit_code == 1
    rows = _lines(result.stdout)
    _check_outcomes(rows, CSV_EXPECTED)
    assert {r["id"]: r["label"] for r in rows if r["label"]} == _valid_only_labels(classifier, CSV)


def test_fail_stops_at_the_first_failed_record(model_dir, task_file):
    result = _classify(model_dir, task_file, JSONL, "--on-error", "fail")  # --overflow error: 'huge' fails first
    assert result.exit_code == 2
    assert [r["id"] for r in _lines(result.stdout)] == ["ok-1", "empty", "spaces"], "lines before the failure are kept"
    assert "record 'huge': field 'text' is too long" in result.output and "--resume" in result.output
    assert "Traceback" not in result.output


def test_stdin_with_a_broken_line_and_bad_bytes(model_dir, task_file):
    payload = b'{"id": "a", "text": "refund"}\n{"id": "b", "text": oops}\n{"id": "c", "text": "\xff"}\n{"id": "d", "text": "crash"}\n'
    result = _classify(model_dir, task_file, "-", input=payload)
    assert result.exit_code == 1
    rows = _lines(result.stdout)
    assert [r["id"] for r in rows] == ["a", None, "c", "d"]
    assert "<stdin>:2: not valid JSON" in rows[1]["error"]
    assert "<stdin>:3: field 'text' is not valid UTF-8" in rows[2]["error"]
    assert rows[0]["label"] and rows[3]["label"]


def test_overflow_error_names_record_field_and_lengths(classifier):
    record = Record("long", {"text": "refund " * 20_000})
    (prediction,) = classifier.classify_all([record], RunConfig("batched", 2))
    assert prediction.label is None
    for words in ("record 'long'", "field 'text'", "too long", f"context is {CONTEXT}", 'overflow="truncate"'):
        assert words in prediction.error, prediction.error
    assert "--" not in prediction.error, "the library's message is neutral: the CLI and HTTP add their own wording"


def test_cli_says_how_to_cut_records_past_the_context(model_dir, task_file, tmp_path):
    """The CLI adds its own wording to the neutral overflow error: the flag that cuts such records."""
    source = tmp_path / "long.jsonl"
    source.write_text(json.dumps({"id": "long", "text": "refund " * 20_000}) + "\n" + json.dumps({"id": "ok", "text": "hi"}) + "\n")
    result = _classify(model_dir, task_file, str(source))
    assert result.exit_code == 1
    assert [r["id"] for r in _lines(result.stdout)] == ["long", "ok"]
    said = " ".join(result.output.split())  # the console wraps long lines
    assert "1 records did not fit the model's context" in said and "--overflow truncate" in said, said


@pytest.mark.parametrize("method", ["first-token", "full"])
def test_truncated_record_fits_and_is_exact(loaded, method):
    """A truncated record is an ordinary shorter record: it fits the context, and cached equals full on it."""
    from prefixcache.task.definition import parse_task

    classifier = Classifier(loaded, parse_task(TASK_YAML, "tiny.yaml"), method)
    records = [Record("long", {"text": "my invoice is wrong and " * 4000}), Record("short", {"text": "crash"})]
    config = RunConfig("batched", 2, overflow="truncate")
    reference = classifier.classify_all(records, RunConfig("full", 1, overflow="truncate"))
    candidate = classifier.classify_all(records, config)
    assert compare(reference, candidate).ok
    assert [p.truncated for p in candidate] == [True, False]
    assert candidate[0].to_json()["truncated"] is True and "truncated" not in candidate[1].to_json()
    kept = int(candidate[0].warning.split(" to ")[1].split()[0])
    shortened = Record("x", {"text": records[0].fields["text"][:kept]})
    encoded = classifier.prompt.encode(loaded.tokenizer, [classifier.prompt.suffix_text(shortened.fields)])[0]
    assert len(encoded.full_ids) + classifier.fit.overhang <= CONTEXT
    longer = {"text": records[0].fields["text"][: kept + 40]}
    encoded = classifier.prompt.encode(loaded.tokenizer, [classifier.prompt.suffix_text(longer)])[0]
    assert classifier.fit.overflows(encoded), "the cut keeps (nearly) as much text as fits"


def test_normal_output_keeps_its_four_keys(classifier):
    (prediction,) = classifier.classify_all([Record(1, {"text": "refund me"})])
    assert set(prediction.to_json()) == {"id", "label", "confidence", "scores", "margin"}


def test_csv_keeps_embedded_newlines_quotes_and_commas():
    records = {r.id: r for r in scan_records(CSV, id_field="id")}
    assert records["quoted"].fields["text"] == 'He wrote "refund me"\nthen, on a new line, "now"'
    assert records["commas"].fields["text"] == "billing, refund, invoice"
    assert records["ok-1"].fields == {"text": "I was charged twice", "note": "plain", "id": "ok-1"}, "the BOM is not in the header"


def test_rows_name_the_line_they_start_on():
    wheres = [row.where.rsplit("/", 1)[-1] for row in scan_rows(CSV)]
    assert wheres[:4] == ["bad_records.csv:2", "bad_records.csv:3", "bad_records.csv:5", "bad_records.csv:6"]
    lines = [row.where.rsplit(":", 1)[-1] for row in scan_rows(JSONL)]
    assert "18" not in lines and lines[-1] == "21", "blank lines are skipped, numbering is by file line"


def test_default_ids_count_bad_rows_so_ids_stay_row_numbers():
    records = list(scan_records(JSONL))
    assert [r.id for r in records] == list(range(20))
    assert records[14].error.endswith("not valid JSON (Invalid control character at column 56)")


def test_strict_readers_raise_at_the_first_bad_row():
    with pytest.raises(InputError, match=r"bad_records.jsonl:5: field 'text' is not valid UTF-8"):
        list(read_records(JSONL, id_field="id"))
    with pytest.raises(InputError, match=r"row 1: duplicate id 'a' \(first used at row 0\)"):
        list(to_records([{"id": "a", "text": "x"}, {"id": "a", "text": "y"}], id_field="id"))


@pytest.mark.parametrize(
    "content, words",
    [
        ("text,text\na,b\n", "names column 'text' twice"),
        ('text\n"unterminated\n', None),  # the csv module reads to the end: one record, not an error
    ],
)
def test_csv_header_problems(tmp_path, content, words):
    path = tmp_path / "in.csv"
    path.write_text(content)
    if words is None:
        assert len(list(scan_records(path))) == 1
        return
    with pytest.raises(InputError, match=words):
        list(scan_records(path))


def test_unreadable_files_are_clear_errors(tmp_path):
    with pytest.raises(InputError, match="no such input file"):
        list(scan_records(tmp_path / "missing.jsonl"))
    with pytest.raises(InputError, match="unsupported input format '.txt'"):
        (tmp_path / "in.txt").write_text("x")
        list(scan_records(tmp_path / "in.txt"))
    (tmp_path / "in.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        list(scan_records(tmp_path / "in.parquet"))
