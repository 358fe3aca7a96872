"""Rows in, Records out on a worker; prediction lines out, finished on the driver.

Ray Data has no global row number: a worker sees a batch of rows, not where
they sit in the input. So the work is split in two:

* on a worker, :func:`record_of` turns one input row into a
  :class:`~prefixcache.scheduler.classify.Record` whose id is the row's ``id_field`` value,
  or the placeholder :data:`ROW` when ids are row numbers; error messages name
  the record by that placeholder, never by a guessed position;
* on the driver, which receives the predictions in input order, :class:`Finisher`
  gives each line its 0-based row number, puts the row's position where the
  placeholder stands, and turns a repeated id into an error line, as the
  local reader does (the first row with an id keeps it).

So, for the same input, a Ray run writes the same ids, labels and scores as a
local run. Messages that locate a bad row say ``INPUT: row N`` (Ray reads
files in blocks, so no line numbers are known).

This module knows nothing about Ray, models or files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

from ..io.jsonl import json_line
from ..types import Prediction, Record



class _RowPosition:
    """Stands for "this row's position" in a worker's ids and messages, until the driver knows it.

    An object, not a string, so no real id can be mistaken for it (compare with ``is``).
    """

    def __repr__(self) -> str:
        return "@row"


ROW = _RowPosition()
_NULL_ID = '{"id": null'  # how every worker line without an id starts (to_json puts the id first)


def record_of(row: Mapping[str, object], text_field: str, id_field: str | None) -> Record:
    """The Record of one input row, mapped as :func:`prefixcache.io.records.records_from_rows` maps it.

    ``text_field`` becomes the Record's ``text``; a null or absent text leaves it out, so the
    classifier reports the record on its own line. Ids come from ``id_field``; without one the id is
    :data:`ROW` (the driver numbers rows). A row whose id is missing, blank, or neither a string
    nor an integer becomes a Record with ``error`` set and id None. Never raises on bad data.
    """
    record_id: object = ROW
    if id_field is not None:
        value = row.get(id_field)
        if value is None or (isinstance(value, str) and not value.strip()):
            return Record(None, {}, error=f"{ROW}: missing id field {id_field!r}")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            return Record(None, {}, error=f"{ROW}: id field {id_field!r} must be a string or an integer, "
                                          f"not {type(value).__name__}")
        record_id = value
    fields = {k: v for k, v in row.items() if k != text_field}
    if row.get(text_field) is not None:
        fields["text"] = row[text_field]
    return Record(record_id, fields)


def prediction_line(prediction: Prediction) -> str:
    """The JSON line the local writer (:func:`prefixcache.io.records.write_jsonl`) writes, without its newline.

    A placeholder id (:data:`ROW`) is written as null; the driver fills it in.
    """
    document = prediction.to_json()
    if document.get("id") is ROW:
        document["id"] = None
    return json_line(document)


@dataclass
class Finisher:
    """Driver side: turns the workers' lines, received in input order, into the final lines.

    ``source`` names the input in messages. With ``id_field`` set, every id seen is kept in
    memory (about 100 bytes each) to catch repeats across workers.
    """

    source: str
    id_field: str | None
    rows: int = 0
    duplicates: int = 0
    _seen: dict[object, int] = field(default_factory=dict, repr=False)

    def finish(self, line: str, record_id: object, error: str | None) -> tuple[str, bool]:
        """The final line for the next row, and whether it is an error line.

        ``record_id`` and ``error`` are the worker's (the same as in ``line``).
        """
        n, self.rows = self.rows, self.rows + 1
        where = f"{self.source}: row {n}"
        if self.id_field is None:
            if error is None and line.startswith(_NULL_ID):  # the common case, without a JSON round trip
                return f'{{"id": {n}' + line[len(_NULL_ID):], False
            document = json.loads(line)
            document["id"] = n
            if error is not None:
                document["error"] = _locate(error, where, f"record {n!r}")
            return json_line(document), error is not None
        if record_id is not None:  # a usable id: the first row that has it keeps it
            first = self._seen.setdefault(record_id, n)
            if first != n:
                self.duplicates += 1
                message = f"{where}: duplicate id {record_id!r} (first used at {self.source}: row {first}); ids must be unique"
                return json_line(Prediction(None, error=message).to_json()), True
        if error is not None and error.startswith(repr(ROW)):
            document = json.loads(line)
            document["error"] = _locate(error, where, where)
            return json_line(document), True
        return line, error is not None


def _locate(error: str, where: str, record: str) -> str:
    """Put the row's position where a worker's message has the placeholder (first occurrence only).

    ``record {ROW!r}`` (the classifier naming a record without an id) becomes ``record``;
    a bare leading ``{ROW}`` (a row-level problem) becomes ``where``.
    """
    named = f"record {ROW!r}"
    if named in error:
        return error.replace(named, record, 1)
    if error.startswith(repr(ROW)):
        return where + error[len(repr(ROW)):]
    return error
