"""Where a Ray run's lines go: numbered JSONL parts in a folder, or standard output.

:class:`PartWriter` writes ``part-00000.jsonl``, ``part-00001.jsonl``, ... in
input order, at most ``rows_per_part`` lines each. A part is written under a
hidden temporary name and renamed when it is complete, so every visible part
is whole; concatenating the parts in name order gives the same lines, in the
same order, as a local ``classify --out FILE``.

This module knows nothing about Ray or models.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO

from ..errors import InputError, setting

PART = "part-{:05d}.jsonl"
SUMMARY = "summary.json"


class PartWriter:
    """Numbered JSONL parts in ``folder`` (created if needed).

    Raises (on construction):
        InputError: ``folder`` is a file, or already holds parts or a summary (a finished
            or half-finished run): pass a new folder or delete them.
    """

    def __init__(self, folder: str | Path, rows_per_part: int = 100_000):
        if rows_per_part < 1:
            raise ValueError("rows_per_part must be at least 1")
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise InputError(f"{setting('out', str(self.folder))} is a file; with {setting('ray')}, {setting('out')} "
                             "names a folder for JSONL parts")
        old = (sorted(self.folder.glob("part-*.jsonl")) + sorted(self.folder.glob(SUMMARY))) if self.folder.is_dir() else []
        if old:
            raise InputError(f"{setting('out', str(self.folder))} already holds results ({old[0].name}, ...); "
                             "pass a new folder or delete them")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rows_per_part = rows_per_part
        self.parts: list[Path] = []
        self._fh: IO[str] | None = None
        self._staging: Path | None = None
        self._in_part = 0

    def write(self, line: str) -> None:
        """Append one line (without its newline)."""
        if self._fh is None or self._in_part >= self.rows_per_part:
            self._seal()
            name = PART.format(len(self.parts))
            self._staging = self.folder / f".{name}.partial"
            self._fh = self._staging.open("w", encoding="utf-8")
            self.parts.append(self.folder / name)
            self._in_part = 0
        self._fh.write(line + "\n")
        self._in_part += 1

    def close(self, summary: dict | None = None) -> None:
        """Seal the last part and write ``summary.json`` (when given). Idempotent."""
        self._seal()
        if summary is not None:
            staging = self.folder / f".{SUMMARY}.partial"
            staging.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
            staging.replace(self.folder / SUMMARY)

    def abort(self) -> None:
        """Stop after a failure: close and delete the unfinished part. Sealed parts stay (the first lines, whole)."""
        if self._fh is not None:
            self._fh.close()
            self._staging.unlink()
            self.parts.pop()
            self._fh = None

    def _seal(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._staging.replace(self.parts[-1])
            self._fh = None


class StdoutWriter:
    """Lines to standard output, flushed per line (the local ``classify`` without ``--out``)."""

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream or sys.stdout
        self.parts: list[Path] = []

    def write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self, summary: dict | None = None) -> None:
        """Nothing to seal; the summary goes to the log only."""

    def abort(self) -> None:
        """Nothing to undo: lines already written stay written."""
