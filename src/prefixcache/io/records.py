"""Readers and writers: files of records in, JSONL of predictions out.

Readers go through two layers, one direction:

1. :func:`scan_rows` yields one :class:`Row` per input row, in file order. A
   row that cannot be read (a broken JSONL line, a line that is not a JSON
   object, bytes that are not UTF-8, a CSV row whose field count differs from
   the header's) is still a Row: its ``error`` says what is wrong and where
   (``file:line`` and, where one is to blame, the field). Reading goes on.
2. :func:`records_from_rows` turns Rows into :class:`~prefixcache.scheduler.classify.Record`.
   Ids come from ``id_field`` when given, else they are 0-based row numbers
   (bad rows count). A row whose id is missing, not a string or an integer,
   or already used by an earlier row becomes a Record with ``error`` set and
   ``id`` None (so every usable id appears once); the runner passes such a
   Record through as an error line, in its place.

Two entry points on top: :func:`scan_records` is lenient (bad rows become error
Records, for ``classify --on-error``), :func:`read_records` is strict (the
first bad row raises :class:`~prefixcache.errors.InputError`).

Supported inputs: ``.csv`` (UTF-8, an optional BOM, a header row, quoted fields
may hold newlines and quotes), ``.jsonl``/``.ndjson``, ``.parquet``, and ``-``
(JSONL on stdin). A file that cannot be read at all (missing, unknown format,
a CSV the parser cannot follow, a corrupt Parquet file) raises InputError.

This module knows nothing about models, prompts or tokens.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from itertools import islice
from pathlib import Path
from typing import IO, BinaryIO, Iterable, Iterator, Mapping

from ..errors import InputError
from ..types import TEXT_FIELD, Prediction, Record
from .jsonl import write_line
from .seen_ids import SeenIds

FORMATS = (".csv", ".jsonl", ".ndjson", ".parquet")


@dataclass(frozen=True)
class Row:
    """One raw input row.

    ``where`` locates it (``in.jsonl:3``: the file and the 1-based line where the
    row starts). When ``error`` is None, ``fields`` is the row. When ``error`` is
    set (a message naming ``where`` and, when one is to blame, the field), the
    row is bad and ``fields`` holds whatever could be parsed (often nothing),
    used only to name the record's id.
    """

    where: str
    fields: Mapping[str, object] = field(default_factory=dict)
    error: str | None = None


PARQUET_BATCH = 4096  # rows per Parquet record batch read


def scan_rows(source: str | Path) -> Iterator[Row]:
    """Every row of a file (or ``-``), readable or not, in file order. Never skips a non-blank row.

    Raises:
        InputError: the file is missing, of an unknown format, or unreadable as a whole.
    """
    if str(source) == "-":
        yield from _jsonl_rows(sys.stdin.buffer, "<stdin>")
        return
    path = Path(source)
    if not path.is_file():
        raise InputError(f"{path}: no such input file")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
            yield from _csv_rows(fh, str(path))
    elif suffix in (".jsonl", ".ndjson"):
        with path.open("rb") as fh:
            yield from _jsonl_rows(fh, str(path))
    elif suffix == ".parquet":
        yield from _parquet_rows(path)
    else:
        raise InputError(f"{path}: unsupported input format {suffix!r}; use one of {', '.join(FORMATS)} or '-'")


def read_rows(source: str | Path) -> Iterator[dict]:
    """Raw rows (dicts) from a file or ``-``, strictly.

    Raises:
        InputError: at the first row that cannot be read, naming the file and the line.
    """
    for row in scan_rows(source):
        if row.error is not None:
            raise InputError(row.error)
        yield dict(row.fields)


def _jsonl_rows(fh: BinaryIO, name: str) -> Iterator[Row]:
    """Rows of a JSONL byte stream. Blank lines are skipped; every other line is one Row."""
    for line_no, raw in enumerate(fh, start=1):
        line = raw.decode("utf-8", errors="surrogateescape")
        if line_no == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        where = f"{name}:{line_no}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            problem = "not valid UTF-8" if _undecodable(line) else f"not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})"
            yield Row(where, error=f"{where}: {problem}")
            continue
        except RecursionError:
            yield Row(where, error=f"{where}: not valid JSON (nested too deeply)")
            continue
        if not isinstance(value, dict):
            yield Row(where, error=f"{where}: each line must be a JSON object, not {_json_type(value)}")
            continue
        yield _checked(where, value)


def _csv_rows(fh: IO[str], name: str) -> Iterator[Row]:
    """Rows of a CSV text stream (decoded with ``surrogateescape``) with a header row.

    Raises:
        InputError: the header is unusable, or the parser cannot follow the file.
    """
    reader = csv.reader(fh)
    try:
        header = next(reader, None)
        if header is None:
            return
        _check_header(header, f"{name}:1")
        start = reader.line_num + 1
        for values in reader:
            where, start = f"{name}:{start}", reader.line_num + 1
            if not values:  # a blank line
                continue
            if len(values) != len(header):
                yield Row(where, error=f"{where}: row has {len(values)} field(s) but the header has {len(header)} "
                                       "(an unquoted comma or newline?)")
                continue
            yield _checked(where, dict(zip(header, values)))
    except csv.Error as exc:
        raise InputError(f"{name}:{reader.line_num}: not valid CSV ({exc}); fix the quoting from there on") from None


def _check_header(header: list[str], where: str) -> None:
    """Raises InputError for a CSV header with blank, repeated or undecodable names."""
    seen: set[str] = set()
    for column in header:
        if not column.strip() or _undecodable(column):
            raise InputError(f"{where}: the header has a blank or non-UTF-8 column name {column!r}")
        if column in seen:
            raise InputError(f"{where}: the header names column {column!r} twice")
        seen.add(column)


def _parquet_rows(path: Path) -> Iterator[Row]:
    """Rows of a Parquet file, read a record batch at a time (never the whole table)."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH)
        n = 0
        for batch in batches:
            for values in batch.to_pylist():
                yield _checked(f"{path}: row {n}", values)
                n += 1
    except (OSError, pyarrow.ArrowException) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None


def count_rows(source: str | Path) -> int | None:
    """How many rows :func:`scan_rows` will give, by a cheap pass that does not parse them (a progress bar's
    total): non-blank lines of a JSONL file, CSV records after the header, a Parquet file's row count.
    None for ``-`` (stdin can be read once) and for a file :func:`scan_rows` will refuse."""
    path = Path(source)
    if str(source) == "-" or not path.is_file():
        return None
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson"):
            with path.open("rb") as fh:
                return sum(1 for line in fh if line.strip())
        if suffix == ".csv":
            with path.open(newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
                return max(0, sum(1 for _ in csv.reader(fh)) - 1)
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001 - a total is a nicety; scan_rows reports what is wrong with the file
        return None
    return None


def _checked(where: str, values: dict) -> Row:
    """A Row of ``values``, or an error Row naming the first field whose text is not valid Unicode."""
    for key, value in values.items():
        if isinstance(value, str):
            bad = _bad_character(value)
            if bad is not None:
                return Row(where, values, error=f"{where}: field {key!r} is not valid UTF-8 text ({bad})")
    return Row(where, values)


def _bad_character(text: str) -> str | None:
    """Describe the first lone surrogate in ``text`` (an undecodable byte or a bad ``\\u`` escape), or None."""
    found = _SURROGATE.search(text)
    if found is None:
        return None
    position, code = found.start(), ord(found.group())
    if 0xDC80 <= code <= 0xDCFF:
        return f"byte 0x{code - 0xDC00:02x} at character {position}"
    return f"unpaired surrogate U+{code:04X} at character {position}"


_SURROGATE = re.compile("[\ud800-\udfff]")  # a str holds one only as an undecodable byte or a lone escape


def _undecodable(text: str) -> bool:
    return any(0xDC80 <= ord(c) <= 0xDCFF for c in text)


def _json_type(value: object) -> str:
    return {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(type(value), "a number")


def records_from_rows(rows: Iterable[Row], text_field: str = TEXT_FIELD, id_field: str | None = None) -> Iterator[Record]:
    """One Record per Row, in order; bad rows and rows without a usable, unique id become error Records.

    ``text_field`` becomes the Record's ``text``. A row missing ``text_field`` still becomes a
    Record (without ``text``), so the runner reports it on its own line instead of dropping it.
    With ``id_field``, rows are read :data:`ID_CHUNK` at a time and their ids checked against those of every
    earlier row (:class:`~prefixcache.io.seen_ids.SeenIds`: 16 bytes an id, not the ids themselves).
    """
    if id_field is None:
        for n, row in enumerate(rows):
            yield _record(row, n, row.error, text_field)
        return
    seen, rows = SeenIds(), iter(rows)
    try:
        while chunk := list(islice(rows, ID_CHUNK)):
            for row, (record_id, problem) in zip(chunk, _chunk_ids(chunk, id_field, seen)):
                yield _record(row, record_id, row.error or problem, text_field)
    finally:
        seen.close()


ID_CHUNK = 1024  # rows whose ids are checked for duplicates together


def _record(row: Row, record_id: object, problem: str | None, text_field: str) -> Record:
    """The Record of ``row``: an error Record when there is a ``problem``, else its fields with ``text_field`` as ``text``."""
    if problem is not None:
        return Record(record_id, {}, error=problem)
    fields = {k: v for k, v in row.fields.items() if k != text_field}
    if text_field in row.fields:
        fields["text"] = row.fields[text_field]
    return Record(record_id, fields)


def _chunk_ids(chunk: list[Row], id_field: str, seen: SeenIds) -> list[tuple[object, str | None]]:
    """Each row's id from ``id_field``, or (None, why it has none): missing, of another type, or a duplicate of an
    earlier row's (remembered in ``seen``). A bad row's id is checked too, so its id is not used twice either."""
    checked = [_row_id(row, id_field) for row in chunk]
    usable = [i for i, (value, problem) in enumerate(checked) if problem is None]
    firsts = seen.first_uses([checked[i][0] for i in usable], [chunk[i].where for i in usable])
    for i, first in zip(usable, firsts):
        if first is not None:
            value = checked[i][0]
            checked[i] = (None, f"{chunk[i].where}: duplicate id {value!r} (first used at {first}); ids must be unique")
    return checked


def _row_id(row: Row, id_field: str) -> tuple[object, str | None]:
    """The row's id from ``id_field``, or (None, why it has no usable one); duplicates are :func:`_chunk_ids`'s."""
    value = row.fields.get(id_field)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None, f"{row.where}: missing id field {id_field!r}"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None, f"{row.where}: id field {id_field!r} must be a string or an integer, not {type(value).__name__}"
    bad = _bad_character(value) if isinstance(value, str) else None
    if bad is not None:
        return None, f"{row.where}: id field {id_field!r} is not valid UTF-8 text ({bad})"
    return value, None


def to_records(rows: Iterable[dict], text_field: str = TEXT_FIELD, id_field: str | None = None) -> Iterator[Record]:
    """Strictly map raw rows (dicts) to Records: ids from ``id_field`` or row numbers.

    Raises:
        InputError: a row has no usable id, or repeats an earlier row's id.
    """
    wrapped = (Row(f"row {n}", row) for n, row in enumerate(rows))
    return _strict(records_from_rows(wrapped, text_field, id_field))


def scan_records(source: str | Path, text_field: str = TEXT_FIELD, id_field: str | None = None) -> Iterator[Record]:
    """Every row of ``source`` as a Record, bad rows included (with ``error`` set). See :func:`records_from_rows`."""
    return records_from_rows(scan_rows(source), text_field, id_field)


def read_records(source: str | Path, text_field: str = TEXT_FIELD, id_field: str | None = None) -> Iterator[Record]:
    """Records of ``source``, strictly.

    Raises:
        InputError: at the first row that cannot be read or has no usable, unique id.
    """
    return _strict(scan_records(source, text_field, id_field))


def _strict(records: Iterable[Record]) -> Iterator[Record]:
    for record in records:
        if record.error is not None:
            raise InputError(record.error)
        yield record


def write_jsonl(predictions: Iterable[Prediction], out: IO[str]) -> Iterator[Prediction]:
    """Write each prediction as one JSON line (flushed) and pass it on."""
    for prediction in predictions:
        write_line(out, prediction.to_json())
        out.flush()
        yield prediction


def bundled_dataset(name: str = "support_tickets.jsonl") -> Path:
    """Path of a dataset shipped inside the package."""
    return Path(str(resources.files("prefixcache.datasets") / name))
