"""llama.cpp (ggml) as a decoder of packed tokens, through llama-cpp-python's low-level API.

:class:`LlamaCpp` owns one llama.cpp model and one context over a ``.gguf``'s own quantized blocks. The context
keeps its key/value cells in one unified buffer (``kv_unified``), so :meth:`LlamaCpp.copy_sequence` shares a
sequence's cells with another instead of copying them: a prefix decoded once into a holder sequence is read by
every row copied from it.

Every call is checked here first. llama.cpp answers a bad batch (too many tokens, a sequence id past
``n_seq_max``, a token outside the vocabulary) with a ``GGML_ASSERT`` that aborts the whole process, so such a
call raises :class:`~prefixcache.errors.BackendError` instead, before it reaches the library.

:func:`llama_cpp_problem` says why llama.cpp cannot run here (not installed, or a build that crashes on this CPU,
found by a probe decode in a child process), or None.

Not thread-safe: one thread (the engine loop's) owns a context. This module knows nothing about sequences,
prefixes or tasks: only token ids, positions, sequence ids and logits.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import BackendError

PROBE_TIMEOUT_S = 120
_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_threads=int(sys.argv[2]), verbose=False)
llm.eval(llm.tokenize(b"Hello there, how are you today?", add_bos=False))
"""


def _silent(level, text, user_data) -> None:  # llama.cpp's log lines go nowhere (its errors come back as codes)
    return None


_LOG_SINK = None  # the ctypes callback, kept alive for as long as the library may call it


@functools.lru_cache(maxsize=None)
def llama_cpp_problem(gguf: str, threads: int = 1) -> str | None:
    """Why llama.cpp cannot decode ``gguf`` here, in a few words, or None when it can: llama-cpp-python is not
    installed, or a probe decode in a child process failed (a build that crashes on this CPU must not take the
    process down). Cached per ``(gguf, threads)``."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (make installs it; see the README)"
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, gguf, str(threads)], capture_output=True,
                              timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"a 7-token probe decode did not finish in {PROBE_TIMEOUT_S} s"
    if done.returncode != 0:
        return (f"its probe decode failed on this CPU (exit {done.returncode}); rebuild it from source for this CPU "
                "(docs/benchmarks.md, 'llama.cpp on AMX CPUs')")
    return None


@dataclass(frozen=True)
class ContextShape:
    """What one context holds: ``cells`` key/value cells (tokens, every sequence together), ``sequences`` sequence
    ids (0 .. sequences-1), ``batch`` tokens per :meth:`LlamaCpp.decode` call, ``threads`` CPU threads."""

    cells: int
    sequences: int
    batch: int
    threads: int

    def __post_init__(self):
        if min(self.cells, self.sequences, self.batch, self.threads) < 1 or self.sequences > 256:
            raise ValueError(f"a llama.cpp context needs cells, batch and threads >= 1 and 1..256 sequences: {self}")


class LlamaCpp:
    """One llama.cpp model and context over ``gguf`` (see the module docstring).

    Raises (on construction):
        BackendError: llama-cpp-python is missing, or the model or context could not be made.
    """

    def __init__(self, gguf: str | Path, shape: ContextShape):
        global _LOG_SINK
        try:
            import llama_cpp as lc
        except ImportError as exc:
            raise BackendError("llama.cpp: llama-cpp-python is not installed") from exc
        self.lc, self.shape, self.path = lc, shape, str(gguf)
        if _LOG_SINK is None:
            _LOG_SINK = lc.llama_log_callback(_silent)
            lc.llama_log_set(_LOG_SINK, ctypes.c_void_p())
        lc.llama_backend_init()
        self._model = lc.llama_model_load_from_file(self.path.encode(), lc.llama_model_default_params())
        if not self._model:
            raise BackendError(f"llama.cpp could not load {self.path}")
        self._ctx = lc.llama_init_from_model(self._model, self._context_params(shape))
        if not self._ctx:
            lc.llama_model_free(self._model)
            raise BackendError(f"llama.cpp could not make a context of {shape.cells} cells for {self.path}")
        self._memory = lc.llama_get_memory(self._ctx)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self._batch = lc.llama_batch_init(shape.batch, 0, 1)
        self.weight_bytes = os.path.getsize(self.path)

    def _context_params(self, shape: ContextShape):
        params = self.lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = shape.cells, shape.batch, min(shape.batch, 512)
        params.n_seq_max, params.n_threads, params.n_threads_batch = shape.sequences, shape.threads, shape.threads
        params.kv_unified, params.no_perf = True, True  # unified: a copied sequence shares its cells
        return params

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               outputs: Sequence[int]) -> np.ndarray:
        """Decode one batch: token ``i`` at ``positions[i]`` in sequence ``seq_ids[i]``. Returns the logits at the
        batch indexes ``outputs`` (ascending), ``[len(outputs), vocab]`` float32, a copy.

        Raises:
            BackendError: a bad batch (checked before the library sees it), or llama.cpp refused it (no free
                cells: the context is full).
        """
        n = len(tokens)
        self._check(tokens, positions, seq_ids, outputs)
        batch, flags = self._batch, np.zeros(n, dtype=np.int8)
        flags[list(outputs)] = 1
        np.ctypeslib.as_array(batch.token, shape=(n,))[:] = tokens
        np.ctypeslib.as_array(batch.pos, shape=(n,))[:] = positions
        np.ctypeslib.as_array(batch.n_seq_id, shape=(n,))[:] = 1
        np.ctypeslib.as_array(batch.logits, shape=(n,))[:] = flags
        for i, seq in enumerate(seq_ids):
            batch.seq_id[i][0] = seq
        batch.n_tokens = n
        code = self.lc.llama_decode(self._ctx, batch)
        if code != 0:
            raise BackendError(f"llama.cpp refused a batch of {n} tokens (llama_decode returned {code}"
                               f"{': no free key/value cells' if code == 1 else ''})")
        if not outputs:
            return np.zeros((0, self.vocab), dtype=np.float32)
        logits = self.lc.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(logits, shape=(len(outputs), self.vocab)).copy()

    def _check(self, tokens, positions, seq_ids, outputs) -> None:
        n, shape = len(tokens), self.shape
        if not 0 < n <= shape.batch or len(positions) != n or len(seq_ids) != n:
            raise BackendError(f"a llama.cpp batch needs 1..{shape.batch} tokens with a position and a sequence each "
                               f"(got {n} tokens, {len(positions)} positions, {len(seq_ids)} sequence ids)")
        ids = np.asarray(tokens)
        if ids.min() < 0 or ids.max() >= self.vocab:
            raise BackendError(f"token id outside the model's vocabulary of {self.vocab}: {int(ids.max())}")
        seqs = np.asarray(seq_ids)
        if seqs.min() < 0 or seqs.max() >= shape.sequences:
            raise BackendError(f"sequence id outside 0..{shape.sequences - 1}: {int(seqs.max())}")
        if min(positions) < 0 or max(positions) >= shape.cells:
            raise BackendError(f"position outside 0..{shape.cells - 1}")
        if any(not 0 <= i < n for i in outputs) or list(outputs) != sorted(set(outputs)):
            raise BackendError("outputs must be ascending batch indexes")

    @property
    def rope_type(self) -> int:
        """llama.cpp's RoPE kind for this model: 0 rotates adjacent pairs (a Llama ``.gguf``, whose converter
        permuted the query/key rows of Hugging Face's half-split layout), 2 the half-split pairs (NeoX: Qwen, Gemma)."""
        return int(self.lc.llama_model_rope_type(self._model))

    def sequence_state(self, seq: int) -> bytes:
        """Sequence ``seq``'s cells as bytes (:mod:`prefixcache.model.llama_state` reads them).

        Raises:
            BackendError: llama.cpp could not write them.
        """
        self._check_seq(seq)
        size = self.lc.llama_state_seq_get_size(self._ctx, seq)
        buffer = (ctypes.c_ubyte * max(size, 1))()
        if size == 0 or self.lc.llama_state_seq_get_data(self._ctx, buffer, size, seq) != size:
            raise BackendError(f"llama.cpp could not write the state of sequence {seq}")
        return bytes(buffer)

    def set_sequence_state(self, seq: int, data: bytes) -> None:
        """Replace sequence ``seq``'s cells with those in ``data`` (its old cells freed first, as llama.cpp does).

        Raises:
            BackendError: llama.cpp refused the bytes (another layout, or no free cells); ``seq`` then holds none.
        """
        self._check_seq(seq)
        buffer = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        if self.lc.llama_state_seq_set_data(self._ctx, buffer, len(data), seq) == 0:
            raise BackendError(f"llama.cpp refused a state of {len(data)} bytes for sequence {seq} (another layout, "
                               "or no free cells)")

    def copy_sequence(self, source: int, target: int) -> None:
        """``target`` reads every cell of ``source`` (shared, not copied: the buffer is unified)."""
        self._check_seq(source, target)
        self.lc.llama_memory_seq_cp(self._memory, source, target, -1, -1)

    def drop_sequence(self, seq: int) -> None:
        """Free ``seq``'s cells (cells another sequence still reads stay)."""
        self._check_seq(seq)
        self.lc.llama_memory_seq_rm(self._memory, seq, -1, -1)

    def _check_seq(self, *seqs: int) -> None:
        for seq in seqs:
            if not 0 <= seq < self.shape.sequences:
                raise BackendError(f"sequence id outside 0..{self.shape.sequences - 1}: {seq}")

    def close(self) -> None:
        """Free the context, the batch and the model (idempotent)."""
        if getattr(self, "_ctx", None):
            self.lc.llama_batch_free(self._batch)
            self.lc.llama_free(self._ctx)
            self.lc.llama_model_free(self._model)
            self._ctx = self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass
