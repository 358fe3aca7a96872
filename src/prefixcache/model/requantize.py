"""A ``.gguf``'s weights requantized for llama.cpp's faster kernels, made once and kept.

llama.cpp repacks Q4_0 blocks at load into an interleaved layout its CPU matrix kernels read many rows of at once
(AVX2 and AVX512 both), and has no such path for Q4_1, the embedded model's blocks. So a Q4_1 ``.gguf``
requantized to Q4_0 computes a batch of tokens several times faster, and one token somewhat faster
(``docs/benchmarks.md``, "Generation backends": llama-bench and the bench's lanes, side by side). The price is a
second rounding of every weight; its agreement with torch's path is measured there too.

:func:`requantized` writes the requantized file under ``cache_home()/gguf``, named by the source's name, size and
modification time and the target type, with llama.cpp's own ``llama_model_quantize`` (``allow_requantize``), under a
file lock, so concurrent processes make it once. A source already of that type is returned as it is.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..errors import BackendError
from .paths import cache_home

FILE_TYPES = {"q4_0": 2, "q8_0": 7}  # llama.cpp's LLAMA_FTYPE_MOSTLY_* of the types offered
OWN = "own"  # the .gguf's own blocks, as they are


def file_type(gguf: Path) -> int:
    """The ``general.file_type`` a ``.gguf`` declares (llama.cpp's LLAMA_FTYPE_*)."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields["general.file_type"]
    return int(field.parts[field.data[0]][0])


def requantized(gguf: Path, kind: str, folder: Path | None = None) -> Path:
    """``gguf`` with its weights in ``kind`` blocks (one of FILE_TYPES, or OWN for ``gguf`` itself): made once and
    kept under ``folder`` (default ``cache_home()/gguf``).

    Raises:
        BackendError: ``kind`` is not offered, llama-cpp-python is missing, or llama.cpp could not write the file.
    """
    if kind == OWN:
        return gguf
    if kind not in FILE_TYPES:
        raise BackendError(f"llama.cpp weights must be {OWN!r} or one of {', '.join(FILE_TYPES)}, not {kind!r}")
    if file_type(gguf) == FILE_TYPES[kind]:
        return gguf
    stat = gguf.stat()
    tag = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = folder or cache_home() / "gguf"
    target = folder / f"{gguf.stem}.{tag}.{kind}.gguf"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(target) + ".lock"):
        if not target.exists():
            _quantize(gguf, target, FILE_TYPES[kind])
    return target


def _quantize(source: Path, target: Path, ftype: int) -> None:
    try:
        import llama_cpp as lc
    except ImportError as exc:
        raise BackendError("llama.cpp: llama-cpp-python is not installed") from exc
    params = lc.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, max(1, (os.cpu_count() or 1))
    partial = target.with_suffix(".partial")
    lc.llama_backend_init()
    if lc.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
        partial.unlink(missing_ok=True)
        raise BackendError(f"llama.cpp could not requantize {source} to {target.name}")
    partial.replace(target)  # whole or absent: a reader never sees a half-written file
