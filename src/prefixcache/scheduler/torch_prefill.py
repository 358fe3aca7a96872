"""Prompt tokens computed on torch, decoded on llama.cpp: the llama.cpp backend's prefill.

On these CPUs torch's packed pass computes many tokens at once faster than llama.cpp does (its kernels quantize
activations per block, and a batch of tokens costs llama.cpp almost as much per token as one; torch's matrix
products reuse each weight across the batch), while llama.cpp decodes one token per row the faster (it reads 4-bit
blocks). So a :class:`TorchPrefill` runs new rows' prompt tokens through torch's packed pass over the torch prefix
(:func:`~prefixcache.engine.rows.packed_pass_kv`), and writes each row's keys and values into its llama.cpp
sequence as a sequence state (:mod:`prefixcache.model.llama_state`); the row's first logits are torch's. A prefix
is placed in a holder the same way, from the torch prefix's own keys and values (so a prefix llama.cpp never
decoded, a tuned one, can be held).

Keys are stored after RoPE. llama.cpp rotates a Llama ``.gguf``'s adjacent pairs, because its converter permuted
each head's query/key rows from Hugging Face's half-split layout, which torch's model (read back through
transformers) uses: so for ``rope_type`` 0 each head's key is re-interleaved (``[x0..x(d/2-1), y0..]`` ->
``[x0, y0, x1, y1, ..]``); for NeoX models (2) it is written as it is. Cells are written as llama.cpp's context
keeps them (float16 by default).

Numerics: a row's later tokens attend to torch's keys and values rounded to the context's type, then run on
llama.cpp's kernels; agreement with torch alone is measured (``studies/backend_agreement.py``), like the backend's.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence as Seq

import numpy as np
import torch

from ..cache.kv import KVShape, PrefixKV
from ..engine.rows import packed_pass_kv
from ..errors import BackendError
from ..model.llama_cpp import LlamaCpp
from ..model.llama_state import StateLayout, read_state, write_state

ROPE_PAIRS = {0: True, 2: False}  # llama.cpp's RoPE type -> whether torch's half-split keys are re-interleaved


class Prefilled(NamedTuple):
    """One row's output from torch's prefill: next-token ``logits [V]`` and the final layer's ``state [H]`` at its
    last prompt token (what a fitted head reads)."""

    logits: torch.Tensor
    state: torch.Tensor


def layout_of(llama: LlamaCpp, scratch: int) -> StateLayout:
    """The cells' layout of ``llama``'s context, read from one token decoded into sequence ``scratch`` (freed after).

    Raises:
        BackendError: the cells are of a type or layout :mod:`~prefixcache.model.llama_state` does not write.
    """
    llama.decode([0], [0], [scratch], [])
    try:
        return read_state(llama.sequence_state(scratch)).layout
    finally:
        llama.drop_sequence(scratch)


class TorchPrefill:
    """Rows' prompt tokens on torch ``model``, written into ``llama``'s sequences (see the module docstring).

    Raises (on construction):
        BackendError: llama.cpp's RoPE layout or cells are ones this module does not write, or its layers or widths
            differ from the torch model's.
    """

    def __init__(self, model: torch.nn.Module, llama: LlamaCpp, scratch: int):
        if llama.rope_type not in ROPE_PAIRS:
            raise BackendError(f"llama.cpp's RoPE type {llama.rope_type} is not one torch's keys are written in")
        if "sliding_attention" in (getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()):
            raise BackendError("llama.cpp keeps sliding-window layers in cells of their own, which are not written here")
        self.model, self.llama, self.pairs = model, llama, ROPE_PAIRS[llama.rope_type]
        self.layout = layout_of(llama, scratch)
        shape = KVShape.of(model.config)
        width, widths = shape.kv_heads * shape.head_dim, {*self.layout.key_dims, *self.layout.value_dims}
        if len(self.layout.key_dims) != shape.layers or widths != {width}:
            raise BackendError(f"llama.cpp's cells ({len(self.layout.key_dims)} layers of {sorted(widths)}) are not "
                               f"torch's ({shape.layers} layers of {width})")

    def place(self, seq: int, start: int, keys: Seq[torch.Tensor], values: Seq[torch.Tensor]) -> None:
        """Write cells at positions ``start ..`` of sequence ``seq`` from per-layer ``keys[l]``/``values[l]``
        ``[kv_heads, n, head_dim]`` (torch's layout); ``seq``'s old cells are freed first."""
        n = keys[0].shape[1]
        cells_k = [self._cells(k, rotate=self.pairs) for k in keys]  # L x [n, kv_heads * head_dim]
        cells_v = [self._cells(v, rotate=False) for v in values]
        self.llama.set_sequence_state(seq, write_state(np.arange(start, start + n), cells_k, cells_v, self.layout))

    def place_prefix(self, seq: int, prefix: PrefixKV) -> None:
        """Sequence ``seq`` holds ``prefix``'s keys and values at positions ``0 .. P-1``."""
        self.place(seq, 0, [k[0] for k in prefix.keys], [v[0] for v in prefix.values])

    def rows(self, prefix: PrefixKV, seqs: Seq[int], rows: Seq[Seq[int]], vocab: int) -> list[Prefilled]:
        """Run ``rows`` (each a row's first tokens) after ``prefix`` in one packed torch pass, place each row's keys and
        values into llama.cpp sequence ``seqs[i]`` (positions ``P ..``; its prefix cells are copied in by the
        caller after), and return each row's :class:`Prefilled`: its next-token logits ``[vocab]`` (float32; torch's
        head, cut or padded to llama.cpp's vocabulary with ``-inf``) and its final-layer state at its last token."""
        with torch.inference_mode():
            hidden, packing, cache = packed_pass_kv(self.model, prefix, rows)  # [N, H]
            last = hidden[packing.last]  # [B, H]
            logits = self.model.get_output_embeddings()(last).float()  # [B, V_torch]
            start = 0
            for seq, length in zip(seqs, packing.lengths):
                span = slice(start, start + length)
                self.place(seq, prefix.length, [layer.keys[0, :, span] for layer in cache.layers],
                           [layer.values[0, :, span] for layer in cache.layers])
                start += length
        return [Prefilled(row, state) for row, state in zip(_fit(logits, vocab), last)]

    @staticmethod
    def _cells(tensor: torch.Tensor, rotate: bool) -> np.ndarray:
        """``[kv_heads, n, head_dim]`` -> ``[n, kv_heads * head_dim]`` float32, halves interleaved when ``rotate``."""
        heads, n, dim = tensor.shape
        if rotate:
            tensor = tensor.reshape(heads, n, 2, dim // 2).transpose(-1, -2).reshape(heads, n, dim)
        return tensor.permute(1, 0, 2).reshape(n, heads * dim).float().numpy()


def _fit(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, V]`` cut or padded (``-inf``) to ``[B, vocab]``."""
    if logits.shape[-1] >= vocab:
        return logits[:, :vocab]
    pad = torch.full((logits.shape[0], vocab - logits.shape[-1]), float("-inf"), dtype=logits.dtype)
    return torch.cat([logits, pad], dim=-1)
