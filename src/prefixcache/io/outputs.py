"""What a classify run writes: the output format by extension, input fields kept beside each label, the review queue.

* **Formats** (:func:`output_format`): ``.csv`` is CSV, ``.parquet``/``.pq`` is Parquet, anything else JSON
  Lines. Every format is written through the resumable JSON Lines journal (:mod:`prefixcache.io.journal`):
  a JSONL output is its own journal; a CSV or Parquet output's journal is ``<out>.journal.jsonl`` beside
  it, turned into the table when the run ends (:func:`finish_table`) and then removed. So ``--resume``
  works for every format the same way, and writes each id once.
* **Kept fields** (:class:`RowTap`): the classifier yields exactly one prediction per record, in input
  order, so a record handed to it is remembered until its prediction comes back (a window of them at
  most) and its ``keep`` fields are written beside the prediction's keys. A kept field whose name is an
  output key is written as ``input.<name>``.
* **Review queue**: an abstained record's whole input row (its fields), with ``best_guess`` and
  ``confidence`` under ``prefixcache``, one JSON line each, for people to label.

This module knows nothing about models or tasks: only records, predictions and files.
"""

from __future__ import annotations

import json
import os
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Iterator, Sequence

from ..errors import InputError, setting
from ..types import Prediction, Record
from .jsonl import write_line

FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}  # every other extension: JSON Lines
OUTPUT_KEYS = ("id", "label", "confidence", "scores", "margin", "abstained", "best_guess", "error", "truncated", "warning")
ALL_FIELDS = "*"  # ``--keep-input``: every input field


def output_format(path: Path | None) -> str:
    """``jsonl``, ``csv`` or ``parquet``, by ``path``'s extension (stdout: ``jsonl``)."""
    return FORMATS.get(path.suffix.lower(), "jsonl") if path is not None else "jsonl"


def journal_path(out: Path) -> Path:
    """Where the lines of ``out`` are journalled: ``out`` itself for JSON Lines, else ``<out>.journal.jsonl``."""
    return out if output_format(out) == "jsonl" else out.with_name(out.name + ".journal.jsonl")


@dataclass
class Tally:
    """What a run's summary says about its labels: records labelled, abstained, failed, and each label's count."""

    labelled: int = 0
    abstained: int = 0
    failed: int = 0
    labels: Counter = field(default_factory=Counter)
    best_guesses: Counter = field(default_factory=Counter)

    def add(self, prediction: Prediction) -> None:
        if prediction.scores is None:
            self.failed += 1
        elif prediction.abstained:
            self.abstained += 1
            self.best_guesses[prediction.best_guess] += 1
        else:
            self.labelled += 1
            self.labels[prediction.label] += 1

    def summary(self, top: int = 5) -> str:
        """``coverage 92.1% (1,105 labelled, 95 to review); labels: a 41.0%, b 33.2%, ...`` (shares of the labelled)."""
        scored = self.labelled + self.abstained
        if not scored:
            return "no record was scored"
        shares = ", ".join(f"{label} {n / max(self.labelled, 1):.1%}" for label, n in self.labels.most_common(top))
        more = f", {len(self.labels) - top} more" if len(self.labels) > top else ""
        return (f"coverage {self.labelled / scored:.1%} ({self.labelled:,} labelled, {self.abstained:,} to review); "
                f"labels: {shares}{more}")


class RowTap:
    """Pairs each prediction with the record it came from (both in input order, one for one) and renders its line.

    ``keep``: input fields written beside the prediction's keys (:data:`ALL_FIELDS`: all of them).
    ``review``: a sink for abstained records' input rows (None: none written).
    """

    def __init__(self, keep: Sequence[str] = (), review: IO[str] | None = None):
        self.keep, self.review, self.tally = tuple(keep), review, Tally()
        self._pending: deque[Record] = deque()

    def records(self, records: Iterable[Record]) -> Iterator[Record]:
        """``records``, each remembered until :meth:`render` takes its prediction."""
        for record in records:
            self._pending.append(record)
            yield record

    def render(self, prediction: Prediction) -> dict:
        """The output line of the next record's ``prediction``: its JSON, the kept fields; an abstention is queued."""
        if not self._pending:
            raise ValueError("a prediction came back for no record: the classifier must yield one per record, in order")
        record = self._pending.popleft()
        self.tally.add(prediction)
        document = prediction.to_json()
        if self.keep:
            names = list(record.fields) if self.keep == (ALL_FIELDS,) else self.keep
            for name in names:
                document[f"input.{name}" if name in OUTPUT_KEYS else name] = record.fields.get(name)
        if self.review is not None and prediction.abstained:
            write_line(self.review, {**record.fields, "prefixcache": {
                "id": prediction.id, "best_guess": prediction.best_guess, "confidence": round(prediction.confidence, 6)}})
        return document


def parse_keep(keep_fields: str | None, keep_input: bool) -> tuple[str, ...]:
    """``--keep-fields a,b`` / ``--keep-input`` as the names :class:`RowTap` keeps.

    Raises:
        InputError: both given, or an empty name.
    """
    if keep_input and keep_fields:
        raise InputError(f"give {setting('keep_fields')} or {setting('keep_input')}, not both")
    if keep_input:
        return (ALL_FIELDS,)
    names = tuple(name.strip() for name in (keep_fields or "").split(",")) if keep_fields else ()
    if any(not name for name in names):
        raise InputError(f"{setting('keep_fields')} {keep_fields!r} has an empty name; write names separated by commas")
    return names


def finish_table(journal: Path, out: Path) -> Path:
    """Turn the JSON Lines ``journal`` into ``out`` (CSV or Parquet, by its extension), atomically, and remove the
    journal. CSV cells that hold objects (``scores``) are JSON text; Parquet keeps them as structs."""
    import pandas as pd
    import pyarrow

    with journal.open(encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    frame = pd.DataFrame.from_records(rows)
    temporary = out.with_name(out.name + ".tmp")
    if output_format(out) == "csv":
        for column in frame.columns:
            if frame[column].map(lambda v: isinstance(v, (dict, list))).any():
                frame[column] = frame[column].map(lambda v: json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v)
        frame.to_csv(temporary, index=False)
    else:
        try:
            frame.to_parquet(temporary, index=False)
        except (pyarrow.ArrowException, TypeError, ValueError) as exc:  # a column that mixes types
            temporary.unlink(missing_ok=True)
            raise InputError(f"the results cannot be written as Parquet ({exc}); the lines are kept in {journal}") from exc
    os.replace(temporary, out)
    journal.unlink()
    return out
