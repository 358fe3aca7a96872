"""PrefixKV: a prefix's key/value cache, computed once and shared read-only.

A :class:`PrefixKV` holds, per decoder layer, the keys and values of the prefix
tokens for batch size 1. It is never written after it is built.

A batch does not copy the prefix. :meth:`PrefixKV.fork` returns a
:class:`ForkedCache`, whose layers keep the shared
prefix tensors by reference and store only the batch's *own* tokens. On every
attention call a layer hands the attention a :class:`~prefixcache.attention.shared_prefix.SharedKV`
(prefix + own), and :mod:`prefixcache.attention.shared_prefix` reads the single prefix copy
for all rows: neither memory nor work per batch ever holds ``B x prefix``.

Forks of one prefix are independent: each has its own suffix state, so any
number of them (threads, requests, label continuations) can run at once
without sharing a mutable tensor (invariant 2).

A fork is a plain object that the lean decoder (:mod:`prefixcache.model.lean`) calls as it is. Once
transformers is loaded in the process (a transformers model may be in use), a fork is also a transformers
``Cache`` (:func:`_fork_classes`), which transformers' models need; so the lean path never imports
transformers, and the transformers path works as before.

This module knows nothing about tasks, labels or tokenizers.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from ..attention.shared_prefix import Packing, SharedKV, use_shared_prefix_attention
from ..errors import PromptError


@dataclass(frozen=True)
class PrefixKV:
    """Read-only keys/values of one prefix.

    Attributes:
        token_ids: the prefix tokens, in order.
        keys, values: one tensor per layer, each ``[1, kv_heads, P, head_dim]``.
    """

    token_ids: tuple[int, ...] = field(repr=False)
    keys: tuple[torch.Tensor, ...] = field(repr=False)
    values: tuple[torch.Tensor, ...] = field(repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes held by the key/value tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @classmethod
    def build(cls, model: torch.nn.Module, token_ids: list[int] | tuple[int, ...]) -> PrefixKV:
        """Run the prefix through the decoder once and keep its cache.

        Only the decoder stack runs (no output head): the prefix's logits are never needed.

        Raises:
            PromptError: the prefix is empty or the model uses non-attention layers.
        """
        if not token_ids:
            raise PromptError("the prefix is empty: nothing to cache")
        _require_attention_layers(model.config)
        with torch.inference_mode():
            device = next(model.parameters()).device
            ids = torch.tensor([list(token_ids)], device=device)  # [1, P]
            cache = _prefill_cache(model)
            model.base_model(input_ids=ids, cache=cache, use_cache=True)
            keys = tuple(layer.keys for layer in cache.layers)  # each [1, kv_heads, P, head_dim]
            values = tuple(layer.values for layer in cache.layers)
            return cls(tuple(int(t) for t in token_ids), keys, values)

    def fork(self, batch_size: int, packing: Packing | None = None) -> ForkedCache:
        """A fresh cache for ``batch_size`` rows that all continue this prefix. The prefix is shared, not copied.

        With ``packing`` the rows arrive laid end to end as one sequence (``batch_size`` 1), for a
        single forward pass.
        """
        if packing is not None and batch_size != 1:
            raise ValueError(f"packed rows are one sequence: fork(1, packing), not fork({batch_size}, packing)")
        layer_class, cache_class = _fork_classes("transformers" in sys.modules)
        return cache_class([layer_class(k, v, batch_size, packing) for k, v in zip(self.keys, self.values)])

    def checksum(self) -> str:
        """SHA-256 over the token ids and every stored tensor's dtype, shape and raw bytes.

        Used by tests to prove nothing mutated the prefix: unlike a sum, it changes when values are
        permuted or when two changes cancel. Reads the tensors only (copies them to the CPU when needed).
        """
        digest = hashlib.sha256(",".join(map(str, self.token_ids)).encode())
        for t in (*self.keys, *self.values):
            raw = t.detach().contiguous().cpu()
            digest.update(f"|{raw.dtype}|{tuple(raw.shape)}|".encode())
            digest.update(raw.reshape(-1).view(torch.uint8).numpy().tobytes())  # bytes, so bfloat16 works too
        return digest.hexdigest()

    def leading(self, length: int) -> PrefixKV:
        """The first ``length`` tokens as *views* of this prefix (no copy; exact, since attention is causal).

        A view keeps the whole of this prefix's storage alive; call :meth:`copy` to own only the head.

        Raises:
            ValueError: ``length`` is not in ``0..self.length``.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"leading({length}) of a {self.length}-token prefix")
        return PrefixKV(
            self.token_ids[:length],
            tuple(k[..., :length, :] for k in self.keys),  # each [1, kv_heads, length, head_dim]
            tuple(v[..., :length, :] for v in self.values),
        )

    def copy(self) -> PrefixKV:
        """A prefix with the same tokens whose tensors are fresh, contiguous copies (owns its memory)."""
        return PrefixKV(
            self.token_ids,
            tuple(k.clone(memory_format=torch.contiguous_format) for k in self.keys),
            tuple(v.clone(memory_format=torch.contiguous_format) for v in self.values),
        )

    def cast(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> PrefixKV:
        """The same prefix as fresh, contiguous ``dtype`` tensors on ``device`` (a copy even when nothing changes)."""
        def moved(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=dtype).clone(memory_format=torch.contiguous_format)

        return PrefixKV(self.token_ids, tuple(map(moved, self.keys)), tuple(map(moved, self.values)))

    def extend(self, model: torch.nn.Module, tail_ids: list[int] | tuple[int, ...]) -> PrefixKV:
        """A new read-only prefix ``self.token_ids + tail_ids``, computing only the tail.

        The tail runs through the decoder over a :meth:`fork` of this prefix (positions
        ``P .. P+T-1``), then the stored and the new keys/values are concatenated into fresh
        tensors. This prefix is not modified, and the result shares no storage with it.

        Raises:
            PromptError: the model uses non-attention layers.
            ValueError: ``tail_ids`` is empty (use :meth:`copy`).
        """
        if not tail_ids:
            raise ValueError("extend() needs at least one tail token; use copy()")
        if self.length == 0:
            return PrefixKV.build(model, tail_ids)
        _require_attention_layers(model.config)
        with torch.inference_mode():
            device = self.keys[0].device
            ids = torch.tensor([list(tail_ids)], device=device)  # [1, T]
            positions = torch.arange(self.length, self.length + ids.shape[1], device=device)[None, :]  # [1, T]
            cache = self.fork(1)
            use_shared_prefix_attention(model)
            model.base_model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
            # each [1, kv_heads, P + T, head_dim]
            keys = tuple(torch.cat([layer.prefix_keys, layer.keys], dim=-2) for layer in cache.layers)
            values = tuple(torch.cat([layer.prefix_values, layer.values], dim=-2) for layer in cache.layers)
            return PrefixKV(self.token_ids + tuple(int(t) for t in tail_ids), keys, values)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Named contiguous tensors for serialization: ``token_ids`` [P] int64, ``k.{i}``/``v.{i}`` per layer."""
        out = {"token_ids": torch.tensor(self.token_ids, dtype=torch.int64)}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            out[f"k.{i}"], out[f"v.{i}"] = k.contiguous(), v.contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> PrefixKV:
        """Inverse of :meth:`to_tensors`.

        Raises:
            KeyError: a layer or ``token_ids`` is missing.
        """
        layers = sum(1 for name in tensors if name.startswith("k."))
        keys = tuple(tensors[f"k.{i}"] for i in range(layers))
        values = tuple(tensors[f"v.{i}"] for i in range(layers))
        return cls(tuple(int(t) for t in tensors["token_ids"].tolist()), keys, values)


def build_in_chunks(model: torch.nn.Module, token_ids: Sequence[int], chunk_tokens: int) -> Iterator[PrefixKV]:
    """The prefix of ``token_ids`` computed ``chunk_tokens`` at a time: yields the prefix so far after each chunk
    (the last one yielded is the whole), so that a caller can let other work run between chunks. Each chunk
    attends to those before it as :meth:`PrefixKV.extend` does: the same keys/values as one
    :meth:`PrefixKV.build`, up to float rounding.

    Raises:
        ValueError: ``token_ids`` is empty or ``chunk_tokens`` under 1.
    """
    ids = tuple(int(t) for t in token_ids)
    if not ids or chunk_tokens < 1:
        raise ValueError(f"build_in_chunks of {len(ids)} tokens in chunks of {chunk_tokens}")
    built = PrefixKV.build(model, ids[:chunk_tokens])
    yield built
    for start in range(chunk_tokens, len(ids), chunk_tokens):
        built = built.extend(model, ids[start : start + chunk_tokens])
        yield built


@dataclass(frozen=True)
class KVShape:
    """Per-token cache geometry of a model: ``layers`` x 2 (keys, values) x ``kv_heads`` x ``head_dim``."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> KVShape:
        cfg = config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)

    def nbytes(self, tokens: int, element_size: int) -> int:
        """Bytes of keys + values for ``tokens`` tokens at ``element_size`` bytes per element."""
        return 2 * self.layers * self.kv_heads * tokens * self.head_dim * element_size


ATTENTION_LAYERS = ("full_attention", "sliding_attention")  # sliding: the attention's prefix band applies the window


def _require_attention_layers(config) -> None:
    """Refuse a decoder with layers that are not attention (linear attention, state-space, chunked).

    Sliding-window layers are served: their prefix is stored whole, and each record's queries see the part of it
    inside their window (:func:`~prefixcache.attention.shared_prefix.prefix_band`)."""
    text_config = config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in ATTENTION_LAYERS})
    if odd:
        raise PromptError(
            f"model type {config.model_type!r} uses layer types {odd}; "
            "prefix sharing supports attention decoders only (full or sliding-window)"
        )


def _prefill_cache(model: torch.nn.Module):
    """An empty cache for a prefix build: the lean decoder's own, else a transformers ``DynamicCache`` that keeps
    every layer's keys whole (made without the config, so sliding-window layers are not cut to their window:
    records after the prefix sit at later positions and see its end)."""
    new_cache = getattr(model.base_model, "new_cache", None)
    if new_cache is not None:
        return new_cache()
    from transformers.cache_utils import DynamicCache

    return DynamicCache()


class _ForkLayer:
    """One layer of a fork: the shared prefix by reference plus this batch's own keys/values.

    ``self.keys``/``self.values`` hold only the own tokens, ``[B, kv_heads, S_own, head_dim]``; ``self.positions``
    their positions ``[B|1, S_own]`` where every pass gave them (transformers' layers pass ``position_ids``), else
    None. A sliding-window layer reads them to keep a long row's queries off its own keys outside the window.
    """

    is_croppable = False

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor, batch_size: int, packing: Packing | None = None):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False
        self.prefix_keys = prefix_keys  # [1, kv_heads, P, head_dim], never written
        self.prefix_values = prefix_values
        self.batch_size = batch_size
        self.packing = packing
        self.device = prefix_keys.device
        self.positions: torch.Tensor | None = None  # [B|1, S_own]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, kv_heads, S_new, head_dim]
        if key_states.shape[0] != self.batch_size:
            raise ValueError(f"fork was made for batch {self.batch_size}, got {key_states.shape[0]} rows")
        positions = (kwargs.get("kwargs") or {}).get("position_ids")  # [B|1, S_new], where the layer passes them
        if self.packing is not None:
            if self.is_initialized:
                raise ValueError("a packed fork serves one forward pass; fork again for another")
            self.keys, self.values, self.is_initialized = key_states, value_states, True
            return SharedKV(self.prefix_keys, key_states, self.packing), SharedKV(self.prefix_values, value_states, self.packing)
        if self.is_initialized:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.positions = None if positions is None or self.positions is None else torch.cat(
                [self.positions.expand(self.batch_size, -1), positions.expand(self.batch_size, -1)], dim=-1)
        else:
            self.keys, self.values, self.is_initialized = key_states, value_states, True
            self.positions = positions
        return (SharedKV(self.prefix_keys, self.keys, own_positions=self.positions),
                SharedKV(self.prefix_values, self.values, own_positions=self.positions))

    def own_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def get_seq_length(self) -> int:
        return self.prefix_keys.shape[-2] + self.own_length()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)
            if self.positions is not None:
                self.positions = self.positions.expand(self.batch_size, -1).repeat_interleave(repeats, dim=0)
        self.batch_size *= repeats

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys = self.keys[indices, ...]
            self.values = self.values[indices, ...]
            if self.positions is not None:
                self.positions = self.positions.expand(self.batch_size, -1)[indices, ...]
        self.batch_size = int(indices.numel())


class ForkedCache:
    """A per-batch cache over a shared :class:`PrefixKV`. Safe to mutate; the prefix is untouched.

    ``update(k, v, layer_idx)`` appends a pass's keys/values and returns a
    :class:`~prefixcache.attention.shared_prefix.SharedKV` pair; ``get_seq_length()`` is prefix length plus own
    tokens, so masks are sized correctly.
    """

    def __init__(self, layers: list[_ForkLayer]):
        self.layers = layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    @property
    def own_length(self) -> int:
        return self.layers[0].own_length()


@functools.cache
def _fork_classes(transformers_loaded: bool) -> tuple[type, type]:
    """The fork's layer and cache classes: plain, or (once transformers is loaded) also transformers' ``Cache``
    and ``DynamicLayer``, which transformers' models call. Both serve the lean decoder alike."""
    if not transformers_loaded:
        return _ForkLayer, ForkedCache
    from transformers.cache_utils import Cache, DynamicLayer

    class TransformersForkLayer(_ForkLayer, DynamicLayer):
        def __init__(self, *args, **kwargs):
            DynamicLayer.__init__(self)
            _ForkLayer.__init__(self, *args, **kwargs)

    class TransformersForkedCache(ForkedCache, Cache):
        def __init__(self, layers: list[_ForkLayer]):
            Cache.__init__(self, layers=layers)

    return TransformersForkLayer, TransformersForkedCache
