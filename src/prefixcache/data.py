"""Readers and writers: files of records in, JSONL of predictions out.

Readers yield :class:`~prefixcache.runner.Record` in file order. Ids come from
``id_field`` when given, else they are 0-based row numbers. The task's
``text`` field is read from ``text_field``.

Supported inputs: ``.csv``, ``.jsonl``/``.ndjson``, ``.parquet``, and ``-``
(JSONL on stdin). A file that cannot be parsed raises
:class:`~prefixcache.errors.InputError` naming the file and the line.
"""

from __future__ import annotations

import csv
import json
import sys
from importlib import resources
from pathlib import Path
from typing import IO, Iterable, Iterator

from .errors import InputError
from .runner import Prediction, Record

FORMATS = (".csv", ".jsonl", ".ndjson", ".parquet")


def read_rows(source: str | Path) -> Iterator[dict]:
    """Raw rows (dicts) from a file or ``-``."""
    if str(source) == "-":
        yield from _jsonl_rows(sys.stdin, "<stdin>")
        return
    path = Path(source)
    if not path.is_file():
        raise InputError(f"{path}: no such input file")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as fh:
            yield from csv.DictReader(fh)
    elif suffix in (".jsonl", ".ndjson"):
        with path.open(encoding="utf-8") as fh:
            yield from _jsonl_rows(fh, str(path))
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
    else:
        raise InputError(f"{path}: unsupported input format {suffix!r}; use one of {', '.join(FORMATS)} or '-'")


def _jsonl_rows(fh: IO[str], name: str) -> Iterator[dict]:
    for line_no, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{name}:{line_no}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise InputError(f"{name}:{line_no}: each line must be a JSON object")
        yield row


def to_records(rows: Iterable[dict], text_field: str = "text", id_field: str | None = None) -> Iterator[Record]:
    """Map raw rows to Records: ``text_field`` becomes ``text``; ids from ``id_field`` or row numbers.

    A row missing ``text_field`` still becomes a Record (without ``text``), so the
    runner reports it on its own line instead of dropping it.
    """
    for n, row in enumerate(rows):
        if id_field is not None and id_field not in row:
            raise InputError(f"row {n}: missing id field {id_field!r}")
        record_id = row[id_field] if id_field is not None else n
        fields = {k: v for k, v in row.items() if k != text_field}
        if text_field in row:
            fields["text"] = row[text_field]
        yield Record(record_id, fields)


def read_records(source: str | Path, text_field: str = "text", id_field: str | None = None) -> Iterator[Record]:
    return to_records(read_rows(source), text_field, id_field)


def write_jsonl(predictions: Iterable[Prediction], out: IO[str]) -> Iterator[Prediction]:
    """Write each prediction as one JSON line (flushed) and pass it on."""
    for prediction in predictions:
        out.write(json.dumps(prediction.to_json(), ensure_ascii=False) + "\n")
        out.flush()
        yield prediction


def bundled_dataset(name: str = "support_tickets.jsonl") -> Path:
    """Path of a dataset shipped inside the package."""
    return Path(str(resources.files("prefixcache.datasets") / name))
