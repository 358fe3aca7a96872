"""How a pool entry is stored in memory: as the float prefix itself, or as int8 with scales.

A *storage* turns a :class:`~prefixcache.cache.kv.PrefixKV` into a packed form that
the pool keeps (``pack``), and back into a float PrefixKV when a batch needs it
(``unpack``). The registry :data:`STORAGES` is where the CLI's ``--kv-storage``
choices come from.

* ``float``: the prefix as computed (model dtype). ``unpack`` returns the same
  object, so a pool hit costs nothing.
* ``int8``: keys quantized **per channel** (one scale per ``(kv_head, head_dim)``
  over all tokens, since keys have outlier channels) and values **per token**
  (one scale per ``(kv_head, token)``), symmetric, to ``[-127, 127]``; scales in
  float32. ``unpack`` dequantizes into a fresh float prefix at the model's dtype
  on every use: memory held by the pool drops by about 4x against float32 (2x
  against bfloat16), and a batch holds one transient float copy while it runs.
  Labels are no longer guaranteed identical to full re-encoding:
  :func:`storage_agreement` measures the label agreement against float storage
  on real records (``prefixcache verify --kv-storage int8`` reports it).

Apart from :func:`storage_agreement` (which drives a classifier), this module
knows nothing about pools, tasks or models beyond tensor shapes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from .kv import KVShape, PrefixKV

QMAX = 127


class Packed(Protocol):
    """What a storage keeps for one prefix: its tokens, its bytes, and named tensors for the disk tier."""

    token_ids: tuple[int, ...]

    @property
    def nbytes(self) -> int: ...

    def to_tensors(self) -> dict[str, torch.Tensor]: ...


class KVStorage(ABC):
    """A way to hold prefixes in memory.

    Contract: ``unpack(pack(p))`` has ``p``'s tokens and shapes at ``p``'s dtype;
    ``pack(p).nbytes == estimate(shape, p.length, p's element size)`` exactly,
    so the pool can check its budget before computing a prefix. Neither call
    modifies its argument.
    """

    name: ClassVar[str]

    @abstractmethod
    def pack(self, prefix: PrefixKV) -> Packed: ...

    @abstractmethod
    def unpack(self, packed: Packed, dtype: torch.dtype) -> PrefixKV: ...

    @abstractmethod
    def from_tensors(self, tensors: dict[str, torch.Tensor]) -> Packed:
        """Inverse of ``Packed.to_tensors``. Raises KeyError when a tensor is missing."""

    @abstractmethod
    def estimate(self, shape: KVShape, tokens: int, element_size: int) -> int:
        """Bytes that ``pack`` of a ``tokens``-long prefix will hold."""


class FloatStorage(KVStorage):
    """The prefix as computed; pack and unpack are the identity."""

    name = "float"

    def pack(self, prefix: PrefixKV) -> PrefixKV:
        return prefix

    def unpack(self, packed: PrefixKV, dtype: torch.dtype) -> PrefixKV:
        return packed

    def from_tensors(self, tensors: dict[str, torch.Tensor]) -> PrefixKV:
        return PrefixKV.from_tensors(tensors)

    def estimate(self, shape: KVShape, tokens: int, element_size: int) -> int:
        return shape.nbytes(tokens, element_size)


@dataclass(frozen=True)
class Int8KV:
    """An int8 prefix.

    Attributes:
        keys: per layer ``[1, kv_heads, P, head_dim]`` int8; ``key_scales`` ``[1, kv_heads, 1, head_dim]`` float32.
        values: per layer ``[1, kv_heads, P, head_dim]`` int8; ``value_scales`` ``[1, kv_heads, P, 1]`` float32.
    """

    token_ids: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    key_scales: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    value_scales: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        tensors = (*self.keys, *self.key_scales, *self.values, *self.value_scales)
        return sum(t.numel() * t.element_size() for t in tensors)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {"token_ids": torch.tensor(self.token_ids, dtype=torch.int64)}
        for i in range(len(self.keys)):
            out[f"k.{i}"], out[f"ks.{i}"] = self.keys[i].contiguous(), self.key_scales[i].contiguous()
            out[f"v.{i}"], out[f"vs.{i}"] = self.values[i].contiguous(), self.value_scales[i].contiguous()
        return out


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of ``x`` with one float32 scale per slice along every axis but ``dim``.

    Returns ``(q, scale)`` with ``q`` int8 shaped like ``x`` and ``scale`` keeping ``dim`` as size 1.
    An all-zero slice gets scale 1 (it dequantizes to zeros exactly).
    """
    amax = x.detach().float().abs().amax(dim=dim, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(x.float() / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


class Int8Storage(KVStorage):
    """Keys per channel, values per token, int8 with float32 scales; dequantized on every unpack."""

    name = "int8"

    def pack(self, prefix: PrefixKV) -> Int8KV:
        keys = [quantize(k, dim=-2) for k in prefix.keys]  # scale over tokens: one per channel
        values = [quantize(v, dim=-1) for v in prefix.values]  # scale over channels: one per token
        return Int8KV(
            prefix.token_ids,
            tuple(q for q, _ in keys),
            tuple(s for _, s in keys),
            tuple(q for q, _ in values),
            tuple(s for _, s in values),
        )

    def unpack(self, packed: Int8KV, dtype: torch.dtype) -> PrefixKV:
        keys = tuple(dequantize(q, s, dtype) for q, s in zip(packed.keys, packed.key_scales))
        values = tuple(dequantize(q, s, dtype) for q, s in zip(packed.values, packed.value_scales))
        return PrefixKV(packed.token_ids, keys, values)

    def from_tensors(self, tensors: dict[str, torch.Tensor]) -> Int8KV:
        layers = sum(1 for name in tensors if name.startswith("k."))
        pick = lambda prefix: tuple(tensors[f"{prefix}.{i}"] for i in range(layers))  # noqa: E731
        token_ids = tuple(int(t) for t in tensors["token_ids"].tolist())
        return Int8KV(token_ids, pick("k"), pick("ks"), pick("v"), pick("vs"))

    def estimate(self, shape: KVShape, tokens: int, element_size: int) -> int:
        data = shape.nbytes(tokens, 1)
        key_scales = shape.layers * shape.kv_heads * shape.head_dim * 4
        value_scales = shape.layers * shape.kv_heads * tokens * 4
        return data + key_scales + value_scales


STORAGES: dict[str, type[KVStorage]] = {cls.name: cls for cls in (FloatStorage, Int8Storage)}
"""``--kv-storage`` name -> storage class."""
