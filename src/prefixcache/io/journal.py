"""Resumable output: predictions written durably as JSONL, and a killed job picked up where it stopped.

The output file is its own journal. The runner keeps input order and gives
every record exactly one Prediction (bad rows get error lines), so line k of
the output is always the result for input row k. Hence:

* resuming is counting the complete lines already written and skipping that
  many input rows as they stream past (:func:`recover`, then :func:`skip_done`);
* a torn last line (the process died mid-write, or the disk kept a zero-filled
  tail) is cut off, and its row is run again;
* the ids of the kept lines must equal the ids of the first input rows, or the
  output belongs to another input and resuming is refused (:func:`skip_done`, :func:`check_matches`);
* a finished job resumed again does nothing, and every id appears once.

Durability (:func:`write_predictions`): each line is written as the runner
yields it, and the file is flushed and fsynced every ``sync_every`` lines and
at the end. The runner yields a window of records at a time (sorted by length
inside it, restored to input order on output), so syncing every ``window``
lines makes each finished window durable; a kill loses at most the window in
flight.

Error policy: ``skip`` writes a failed record's error line and goes on;
``fail`` stops at the first failed record without writing its line, so that a
fixed input, resumed, continues from that very record.

This module knows nothing about models or tasks: only predictions, ids and files.
"""

from __future__ import annotations

import json
import os
import stat
from itertools import islice
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Sequence

from ..errors import InputError, setting
from .jsonl import json_line, write_line
from ..types import Prediction, Record

ON_ERROR = ("skip", "fail")


@dataclass(frozen=True)
class Recovered:
    """What an existing output already holds.

    ``lines``: complete prediction lines kept (= input rows done); ``failed``: how many of them
    are error lines; ``ids``: their ids in order (from :func:`recover`, a :class:`JournalIds` that reads them
    again from the file as they are iterated, so a resumed job of many lines holds none of them);
    ``cut_bytes``: size of the torn last line that was removed (0 when there was none).
    """

    lines: int = 0
    failed: int = 0
    ids: Iterable = field(default_factory=list)
    cut_bytes: int = 0


@dataclass(frozen=True)
class JournalIds:
    """The ids of the first ``lines`` lines of the journal at ``path``, read from it each time they are iterated."""

    path: Path
    lines: int

    def __iter__(self) -> Iterator:
        with self.path.open("rb") as fh:
            for raw in islice(fh, self.lines):
                yield json.loads(raw)["id"]


@dataclass(frozen=True)
class Written:
    """What one :func:`write_predictions` call wrote: lines, error lines, and lines flagged with a warning."""

    lines: int
    failed: int
    flagged: int


def recover(path: Path) -> Recovered:
    """Read an existing output, cut a torn last line off the file (and fsync it), and count what is done.

    A missing or empty file means nothing is done.

    Raises:
        InputError: a complete line that is not a prediction (JSON object with an ``id``), other
            than a torn last one; the file was not written by ``classify`` or was edited.
    """
    if not path.exists():
        return Recovered()
    lines, failed, kept_bytes = 0, 0, 0
    with path.open("rb") as fh:
        number, raw = 0, fh.readline()
        while raw:
            number, following = number + 1, fh.readline()  # one line of lookahead: is ``raw`` the last?
            prediction = _parse_line(raw)
            if prediction is None and not following and _torn(raw):
                break
            if prediction is None:
                raise InputError(
                    f"{path}:{number}: not a prediction line; this file was not written by 'prefixcache classify' "
                    f"or was edited. Move it aside, or choose another {setting('out')}"
                )
            lines += 1
            failed += prediction.get("error") is not None
            kept_bytes += len(raw)
            raw = following
    cut = path.stat().st_size - kept_bytes
    if cut:
        _truncate(path, kept_bytes)
    return Recovered(lines, failed, JournalIds(path, lines), cut)


def _parse_line(raw: bytes) -> dict | None:
    """The prediction on a complete line (ending in a newline), or None."""
    if not raw.endswith(b"\n"):
        return None
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) and "id" in value else None


def _torn(raw: bytes) -> bool:
    """A last line a crash can leave: no newline yet, or the zero bytes of a tail the disk never got."""
    return not raw.endswith(b"\n") or b"\x00" in raw


def _truncate(path: Path, size: int) -> None:
    with path.open("r+b") as fh:
        fh.truncate(size)
        fh.flush()
        os.fsync(fh.fileno())


def check_matches(done: Recovered, records: Sequence[Record], out: Path) -> None:
    """Refuse to resume ``out`` onto ``records`` unless its lines are exactly their first rows.

    Raises:
        InputError: ``out`` has more lines than there are rows, or line k's id differs from row k's.
    """
    if done.lines > len(records):
        raise InputError(
            f"{out} has {done.lines} lines but the input has only {len(records)} rows: it belongs to another "
            f"input. Move it aside, or choose another {setting('out')}"
        )
    for number, (got, record) in enumerate(zip(done.ids, records), start=1):
        _check_line(out, number, got, record)


def skip_done(done: Recovered, records: Iterable[Record], out: Path) -> Iterator[Record]:
    """The records after the ``done.lines`` that ``out`` already holds, streamed: the done ones are read now
    (and checked as :func:`check_matches` does), never held.

    Raises:
        InputError: the input has fewer rows than ``out`` has lines, or row k's id is not line k's.
    """
    records = iter(records)
    for number, got in enumerate(done.ids, start=1):
        record = next(records, None)
        if record is None:
            raise InputError(
                f"{out} has {done.lines} lines but the input has only {number - 1} rows: it belongs to another "
                f"input. Move it aside, or choose another {setting('out')}"
            )
        _check_line(out, number, got, record)
    return records


def _check_line(out: Path, number: int, got: object, record: Record) -> None:
    want = _as_json(record.id)
    if got != want:
        raise InputError(
            f"{out}:{number} is for id {got!r} but input row {number - 1} has id {want!r}: the output belongs "
            f"to another input (or {setting('id_field')}). Move it aside, or choose another {setting('out')}"
        )


def _as_json(value: object) -> object:
    """``value`` as it reads back from a JSON line (tuples become lists, and so on)."""
    return json.loads(json_line(value))


def write_predictions(
    predictions: Iterable[Prediction], sink: IO[str], on_error: str = "skip", sync_every: int | None = None,
    render: Callable[[Prediction], dict] = Prediction.to_json,
) -> Written:
    """Write each prediction as one JSON line (``render(prediction)``), in order.

    ``sync_every``: flush and fsync ``sink`` every so many lines and at the end (None: flush only,
    for pipes and terminals). ``on_error``: see :data:`ON_ERROR`.

    Raises:
        InputError: under ``fail``, at the first error prediction (not written; everything before
            it is written and synced). The message names the record and says how to go on.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, not {on_error!r}")
    lines = failed = flagged = 0
    try:
        for prediction in predictions:
            if prediction.error is not None and on_error == "fail":
                raise InputError(
                    f"{prediction.error}\nstopped by {setting('on_error', 'fail')} after {lines} lines; fix the input, "
                    f"then rerun with {setting('resume')} to continue from this record (or use {setting('on_error', 'skip')})"
                )
            write_line(sink, render(prediction))
            lines += 1
            failed += prediction.error is not None
            flagged += prediction.warning is not None
            if sync_every and lines % sync_every == 0:
                _sync(sink)
    finally:
        if sync_every:
            _sync(sink)
        else:
            sink.flush()
    return Written(lines, failed, flagged)


def _sync(sink: IO[str]) -> None:
    """Flush ``sink``; fsync it when it is a regular file (pipes and terminals cannot be fsynced)."""
    sink.flush()
    if stat.S_ISREG(os.fstat(sink.fileno()).st_mode):
        os.fsync(sink.fileno())
