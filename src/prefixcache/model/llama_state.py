"""One llama.cpp sequence's key/value state as bytes: read and written in the format its sources define.

``llama_state_seq_get_data`` / ``llama_state_seq_set_data`` move one sequence's cells in and out of a context
(llama.cpp 0.3.36's ``llama_kv_cache::state_write`` and ``state_read``, one stream: the context is unified). The
layout, all little-endian:

* ``u32`` magic (:data:`MAGIC`), ``i32`` the sequence id it was read from;
* ``u32`` streams (1), ``u32`` cells ``n``;
* per cell: ``i32`` position, ``u32`` sequence-id count (1), ``i32`` sequence id (set_data writes its own);
* ``u32`` values transposed, ``u32`` layers ``L``;
* per layer: ``i32`` key type, ``u64`` bytes per key row, then ``n`` key rows (``[n, kv_dim]``);
* values, per layer: not transposed, ``i32`` type, ``u64`` row bytes, ``n`` rows; transposed, ``i32`` type,
  ``u32`` element bytes, ``u32`` ``kv_dim``, then ``kv_dim`` runs of ``n`` elements (``[kv_dim, n]``).

:func:`read_state` parses such bytes into a :class:`SeqState` and :func:`write_state` writes one, so keys and
values computed elsewhere (torch's prefill, a tuned prefix) can be placed in a llama.cpp context. Only float16 and
float32 cells are read and written (llama.cpp's default key/value type is float16); a model with per-cell extras
(M-RoPE positions) writes cells this module does not know, and is refused.

This module knows nothing about torch or llama-cpp-python: numpy arrays and bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..errors import BackendError

MAGIC = 0xAF143CD8  # llama_context's io_magic: the first word of every sequence state
GGML_TYPES = {0: np.dtype("<f4"), 1: np.dtype("<f2")}  # ggml's type ids of the cells read and written here


@dataclass(frozen=True)
class StateLayout:
    """What a context's cells look like: ``key_type``/``value_type`` (ggml type ids), ``transposed`` values, and per
    layer the key and value widths (``kv_dim``: key/value heads x head size)."""

    key_type: int
    value_type: int
    transposed: bool
    key_dims: tuple[int, ...]
    value_dims: tuple[int, ...]


@dataclass(frozen=True)
class SeqState:
    """One sequence's cells: ``positions [n]``, and per layer ``keys[l] [n, key_dims[l]]`` and ``values[l]``
    ``[n, value_dims[l]]`` in the layout's types."""

    positions: np.ndarray
    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    layout: StateLayout


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = memoryview(data), 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        out = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.at).copy()
        self.at += count * dtype.itemsize
        return out


def read_state(data: bytes) -> SeqState:
    """Parse one sequence's state (see the module docstring).

    Raises:
        BackendError: the bytes are not one stream of float16/float32 cells with one sequence id each, or are cut.
    """
    try:
        return _read(_Reader(data))
    except (struct.error, ValueError) as exc:
        raise BackendError(f"a llama.cpp sequence state that cannot be read: {exc}") from None


def _read(r: _Reader) -> SeqState:
    if r.take("I") != MAGIC:
        raise BackendError("bytes that are not a llama.cpp sequence state (no magic word)")
    r.take("i")
    if r.take("I") != 1:
        raise BackendError("a llama.cpp sequence state of more than one stream (the context is not unified)")
    n = r.take("I")
    positions = np.empty(n, dtype=np.int32)
    for i in range(n):
        positions[i] = r.take("i")
        if r.take("I") != 1:
            raise BackendError("a llama.cpp cell with other than one sequence id (or with per-cell extras)")
        r.take("i")
    transposed, layers = bool(r.take("I")), r.take("I")
    key_type, keys, key_dims = _read_rows(r, n, layers)
    if transposed:
        value_type, values, value_dims = _read_columns(r, n, layers)
    else:
        value_type, values, value_dims = _read_rows(r, n, layers)
    layout = StateLayout(key_type, value_type, transposed, key_dims, value_dims)
    return SeqState(positions, keys, values, layout)


def _dtype(kind: int) -> np.dtype:
    if kind not in GGML_TYPES:
        raise BackendError(f"llama.cpp key/value cells of ggml type {kind}: only float16 and float32 are read here")
    return GGML_TYPES[kind]


def _read_rows(r: _Reader, n: int, layers: int) -> tuple[int, tuple[np.ndarray, ...], tuple[int, ...]]:
    kinds, arrays, dims = set(), [], []
    for _ in range(layers):
        kind = r.take("i")
        dtype, row_bytes = _dtype(kind), r.take("Q")
        dim = row_bytes // dtype.itemsize
        arrays.append(r.array(dtype, n * dim).reshape(n, dim))
        kinds.add(kind)
        dims.append(dim)
    return _one(kinds), tuple(arrays), tuple(dims)


def _read_columns(r: _Reader, n: int, layers: int) -> tuple[int, tuple[np.ndarray, ...], tuple[int, ...]]:
    kinds, arrays, dims = set(), [], []
    for _ in range(layers):
        kind = r.take("i")
        dtype = _dtype(kind)
        r.take("I")  # element bytes: the type's
        dim = r.take("I")
        arrays.append(r.array(dtype, n * dim).reshape(dim, n).T.copy())  # [n, dim]
        kinds.add(kind)
        dims.append(dim)
    return _one(kinds), tuple(arrays), tuple(dims)


def _one(kinds: set[int]) -> int:
    if len(kinds) > 1:
        raise BackendError(f"llama.cpp layers of mixed key/value types {sorted(kinds)}")
    return kinds.pop() if kinds else 1


def write_state(positions, keys, values, layout: StateLayout) -> bytes:
    """The bytes of one sequence holding cells at ``positions [n]`` with ``keys[l] [n, key_dims[l]]`` and
    ``values[l] [n, value_dims[l]]`` (any float arrays: cast to the layout's types), for ``llama_state_seq_set_data``.

    Raises:
        BackendError: the arrays do not match the layout (layer count, widths, cell count).
    """
    positions = np.asarray(positions, dtype=np.int32)
    n = len(positions)
    if len(keys) != len(layout.key_dims) or len(values) != len(layout.value_dims):
        raise BackendError(f"{len(keys)} layers of keys and {len(values)} of values for a context of "
                           f"{len(layout.key_dims)} layers")
    parts = [struct.pack("<IiII", MAGIC, 0, 1, n)]
    cell = np.zeros((n, 3), dtype="<i4")  # position, one sequence id, the id (set_data writes its own)
    cell[:, 0], cell[:, 1] = positions, 1
    parts += [cell.tobytes(), struct.pack("<II", int(layout.transposed), len(keys))]
    key_dtype, value_dtype = _dtype(layout.key_type), _dtype(layout.value_type)
    for key, dim in zip(keys, layout.key_dims):
        parts += [struct.pack("<iQ", layout.key_type, dim * key_dtype.itemsize), _cells(key, n, dim, key_dtype)]
    for value, dim in zip(values, layout.value_dims):
        block = _cells(value, n, dim, value_dtype)
        if layout.transposed:
            parts += [struct.pack("<iII", layout.value_type, value_dtype.itemsize, dim),
                      np.ascontiguousarray(np.frombuffer(block, value_dtype).reshape(n, dim).T).tobytes()]
        else:
            parts += [struct.pack("<iQ", layout.value_type, dim * value_dtype.itemsize), block]
    return b"".join(parts)


def _cells(array, n: int, dim: int, dtype: np.dtype) -> bytes:
    array = np.asarray(array)
    if array.shape != (n, dim):
        raise BackendError(f"key/value cells of shape {array.shape} where the context takes {(n, dim)}")
    return np.ascontiguousarray(array, dtype=dtype).tobytes()
