"""Where a Ray run's input is: its format, its size, and paths the workers can use.

This module knows nothing about Ray or models.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from ..errors import InputError, setting
from ..model.load import EMBEDDED

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def input_format(source: str) -> str:
    """``csv``, ``jsonl`` or ``parquet``, from the name's suffix (for a local folder: its files').

    Raises:
        InputError: stdin, or no known format.
    """
    if source == "-":
        raise InputError(f"{setting('ray')} reads files, not stdin: write the input to a .jsonl file and pass its path")
    suffix = PurePosixPath(source.split("://", 1)[-1].rstrip("/")).suffix.lower()
    if suffix in FORMATS:
        return FORMATS[suffix]
    folder = Path(source)
    if "://" not in source and folder.is_dir():
        found = {FORMATS.get(p.suffix.lower()) for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")}
        found.discard(None)
        if len(found) == 1:
            return found.pop()
    raise InputError(
        f"{source}: cannot tell its format; pass a file or a folder of files ending in "
        f"{', '.join(FORMATS)} (one format per folder)"
    )


def block_bytes(source: str, workers: int, blocks_per_worker: int = 8, floor: int = 4096) -> int | None:
    """A block size that gives each worker about ``blocks_per_worker`` blocks of a local input.

    Ray Data hands an actor a whole read block at a time, and a small file reads as one block,
    which one actor would then classify alone. Splitting by size keeps every worker busy. None
    for a remote input (its size is not known here): Ray's own block size then applies.
    """
    if "://" in source:
        return None
    path = Path(source)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    return max(floor, total // max(1, workers * blocks_per_worker))


def absolute(path: str) -> str:
    """An existing local path made absolute (Ray workers do not share the driver's working folder).

    URIs, embedded model names and anything that is not a local path come back unchanged.
    """
    if "://" in path or path in EMBEDDED or not Path(path).expanduser().exists():
        return path
    return str(Path(path).expanduser().resolve())
