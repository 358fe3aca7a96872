"""Which backend runs a task's generating rows: ``--backend auto|torch|llama.cpp`` (:data:`~prefixcache.types.BACKENDS`).

* ``torch``: the engine's own decoder (:class:`~prefixcache.scheduler.generation.TorchGeneration`), always there.
* ``llama.cpp``: :class:`~prefixcache.scheduler.llama_generation.LlamaGeneration` on the model's ``.gguf``. Asked
  for where it cannot run, it is refused with the reason (:class:`~prefixcache.errors.BackendError`).
* ``auto``: llama.cpp where it can run and torch's generation is the slower one, else torch. It can run on a CPU
  model given as a ``.gguf`` (an embedded model is one), with llama-cpp-python installed and a probe decode
  passing, for a task whose rows need nothing only torch has (a tuned prefix, fitted heads over the prompt's
  state). Torch's generation is the slower one (``docs/benchmarks.md``, "Generation backends") with float32
  weights (a CPU without native bfloat16) at any batch, and with bfloat16 weights one row at a time; torch is the
  faster with bfloat16 weights at batches (``rows`` above :data:`BF16_LLAMA_ROWS`).

Scoring never moves: labels are scored on torch whatever is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache.kv import KVShape
from ..cache.pool import PrefixPool
from ..errors import BackendError, setting
from ..model.llama_cpp import ContextShape, LlamaCpp, llama_cpp_problem
from ..model.requantize import requantized
from ..model.load import EMBEDDED, LoadedModel, cpu_has_fast_bf16, embedded_gguf
from ..types import BACKENDS
from .llama_generation import LlamaGeneration
from .torch_prefill import TorchPrefill

LLAMA_CELLS = 8192  # key/value cells of a llama.cpp context (every row and prefix together)
LLAMA_HOLDERS = 4  # prefixes a llama.cpp context keeps decoded at once
LLAMA_OWNER = "llama.cpp context"  # its reservation's name in a prefix pool
LLAMA_WEIGHTS = "own"  # the blocks llama.cpp's rows read: the .gguf's own (requantized ones measured faster and
# further from torch's answers: studies/llama_weights.py, docs/benchmarks.md "Generation backends")
BF16_LLAMA_ROWS = 1  # at most this many rows at once, llama.cpp out-generates torch's bfloat16 (measured: B=1, B=32)


@dataclass(frozen=True)
class BackendChoice:
    """What was chosen (``name``: ``torch`` or ``llama.cpp``) and why, in a few words."""

    name: str
    why: str


def gguf_of(loaded: LoadedModel) -> Path | None:
    """The ``.gguf`` the model was read from (an embedded name or a ``.gguf`` path), or None."""
    if loaded.spec in EMBEDDED:
        return embedded_gguf(loaded.spec)
    return Path(loaded.spec).expanduser() if loaded.spec.endswith(".gguf") else None


def choose(loaded: LoadedModel, asked: str, needs_torch: str | None = None, rows: int = 1) -> BackendChoice:
    """The backend for ``loaded``'s generating rows, up to ``rows`` at once (see the module docstring).
    ``needs_torch``: why this task's rows must run on torch (something only torch gives them), or None.

    Raises:
        BackendError: ``asked`` is not one of BACKENDS, or ``llama.cpp`` was asked for where it cannot run.
    """
    if asked not in BACKENDS:
        raise BackendError(f"backend must be one of {', '.join(BACKENDS)}, not {asked!r}")
    if asked == "torch":
        return BackendChoice("torch", "asked for")
    faster = None if asked == "llama.cpp" else _faster(loaded, rows)  # cheap rules before the probe decode
    if faster is not None and faster.name == "torch":
        return faster
    problem = needs_torch or _llama_problem(loaded)
    if problem is not None:
        if asked == "llama.cpp":
            raise BackendError(f"the llama.cpp backend cannot run this: {problem}; use {setting('backend', 'torch')}")
        return BackendChoice("torch", problem)
    return faster or BackendChoice("llama.cpp", "asked for")


def _faster(loaded: LoadedModel, rows: int) -> BackendChoice:
    """Which backend generates ``rows`` at once the faster on this machine, as measured (see the module docstring)."""
    if loaded.dtype == torch.float32 or not cpu_has_fast_bf16():
        return BackendChoice("llama.cpp", "torch's generation reads float32 weights here; llama.cpp reads 4-bit blocks")
    if rows <= BF16_LLAMA_ROWS:
        return BackendChoice("llama.cpp", "one row at a time, llama.cpp's 4-bit blocks out-generate torch's bfloat16")
    return BackendChoice("torch", f"{rows} rows at once on native bfloat16: torch's batched generation is the faster")


def _llama_problem(loaded: LoadedModel) -> str | None:
    if loaded.device.type != "cpu":
        return f"the model is on {loaded.device}, and llama.cpp here runs on the CPU"
    gguf = gguf_of(loaded)
    if gguf is None:
        return "llama.cpp reads a .gguf model, and this model is not one"
    return llama_cpp_problem(str(gguf), 1)


def llama_generation(loaded: LoadedModel, rows: int, cells: int = LLAMA_CELLS, torch_prefill: bool = True,
                     weights: str = LLAMA_WEIGHTS) -> LlamaGeneration:
    """A llama.cpp backend over ``loaded``'s ``.gguf``: ``rows`` rows and LLAMA_HOLDERS prefix holders in one
    context of ``cells`` cells (at most the model's context per row), on torch's thread count, reading ``weights``
    blocks (:func:`~prefixcache.model.requantize.requantized`: the ``.gguf`` requantized once and kept, or ``own``).
    With
    ``torch_prefill`` (and a model whose cells :class:`~prefixcache.scheduler.torch_prefill.TorchPrefill` can
    write), prefixes are computed on torch and placed in llama.cpp's cells (so a tuned prefix runs there too), and
    so are rows' prompts where torch computes them the faster: with bfloat16 weights (measured in
    ``docs/benchmarks.md``, "Generation backends"; with float32 weights llama.cpp's own prefill of one record is the
    faster)."""
    gguf = gguf_of(loaded)
    if gguf is None:
        raise BackendError(f"the llama.cpp backend reads a .gguf model; use {setting('backend', 'torch')}")
    rows = max(1, min(rows, 256 - LLAMA_HOLDERS))
    shape = ContextShape(cells, rows + LLAMA_HOLDERS, min(cells, 2048), torch.get_num_threads())
    llama = LlamaCpp(requantized(gguf, weights), shape)
    prefill = None
    if torch_prefill:
        try:
            prefill = TorchPrefill(loaded.model, llama, shape.sequences - 1)
        except BackendError:  # cells it cannot write: llama.cpp decodes the prompts itself
            prefill = None
    return LlamaGeneration(llama, rows, prefill, prompts_on_torch=loaded.dtype == torch.bfloat16)


def context_bytes(loaded: LoadedModel, cells: int = LLAMA_CELLS) -> int:
    """Bytes of a llama.cpp context's keys/values (float16 cells), to reserve in a prefix pool's budget."""
    return KVShape.of(loaded.config).nbytes(cells, 2)


def pooled_llama_generation(loaded: LoadedModel, rows: int, pool: PrefixPool) -> LlamaGeneration:
    """A llama.cpp backend whose context's keys/values are reserved in ``pool``'s budget (as ``llama.cpp context``):
    at most LLAMA_CELLS cells, and at most half the budget, so prefixes keep the other half.

    Raises:
        PoolReservationError: the context does not fit beside the pinned prefixes.
    """
    per_cell = context_bytes(loaded, 1)
    cells = max(256, min(LLAMA_CELLS, pool.config.budget_bytes // 2 // per_cell))
    pool.reserve(LLAMA_OWNER, context_bytes(loaded, cells))
    try:
        return llama_generation(loaded, rows, cells)
    except BaseException:
        pool.release(LLAMA_OWNER)
        raise
