"""Attention over a shared prefix without copying it per row.

A fork of a :class:`~prefixcache.cache.kv.PrefixKV` hands each attention layer a
:class:`SharedKV` instead of a key (or value) tensor: the prefix's tensor,
``[1, kv_heads, P, head_dim]``, shared by every row, plus the batch's own
tensor, ``[B, kv_heads, S, head_dim]``. :func:`shared_prefix_attention`, the
model's attention implementation (registered as ``"prefixcache"``), then
attends in two parts and merges them exactly:

* prefix part: every query of every row (and every head of a kv group) is
  folded into one long query sequence against the single prefix copy, so the
  prefix is read once per layer, never expanded to ``B x P``;
* own part: each row against its own tokens, under the causal/padding mask,
  with the heads of a kv group folded into one query sequence (no per-head
  copies of the keys);
* merge: ``softmax`` over the concatenated keys equals the two partial
  softmaxes weighted by their log-sum-exps (a sigmoid of their difference).

Rows may also come *packed* (:class:`Packing`): laid end to end as one
sequence with no padding, so that the model's linear layers never compute
pads; only the small own part is unpacked to padded rows.

Every row attends to the whole prefix (the contract of a fork), except in a
sliding-window layer (Gemma 3's, Mistral's), where a query at position ``q``
sees the prefix keys after ``q - window`` (:func:`prefix_band`, from the
positions the model passes), and padded rows see their own keys inside it too
(:mod:`.sliding_window`). The mask the model builds is consulted only for the
own tokens of padded rows. Ordinary key tensors (a
``DynamicCache`` building a prefix, or no cache) go to transformers' SDPA path
unchanged. A :class:`SharedKV` reaching any other attention implementation
fails loudly instead of silently dropping the prefix.

The lean decoder (:mod:`prefixcache.model.lean`) calls :func:`shared_prefix_attention` from its own layers.
transformers is imported only when a transformers model is set to attend through it
(:func:`use_shared_prefix_attention`, which registers it once) or hands it plain tensors, so the lean path
never imports transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import functools

import torch

from .sliding_window import Window

NAME = "prefixcache"


@dataclass(frozen=True)
class Packing:
    """Rows of unequal length laid end to end as one sequence of ``N`` tokens (no padding).

    Linear layers, norms and the MLP then do no work on pads; only the rows' own attention
    is done padded (:meth:`unpack`, then :meth:`pack` back), and it is small.
    """

    lengths: tuple[int, ...]
    slots: torch.Tensor  # [N]: each packed token's place in the right-padded [B * T] layout
    offsets: torch.Tensor  # [N]: each packed token's position within its row
    last: torch.Tensor  # [B]: each row's last token in the packed sequence

    @classmethod
    def of(cls, lengths: Sequence[int], device, allow_empty: bool = False) -> Packing:
        """``allow_empty``: rows of zero tokens are allowed (they unpack to all-pad rows), as long as one row has
        a token; a step over a slot store places each row at its slot this way."""
        if not lengths or max(lengths) < 1 or (min(lengths) < 1 and not allow_empty):
            raise ValueError(f"packed rows need at least one token each, got lengths {list(lengths)}")
        width = max(lengths)
        offsets = torch.cat([torch.arange(n, device=device) for n in lengths])  # [N]
        row = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
        ends = torch.tensor(lengths, device=device).cumsum(0) - 1
        return cls(tuple(lengths), row * width + offsets, offsets, ends)

    @property
    def width(self) -> int:
        return max(self.lengths)

    @functools.cached_property
    def one_each(self) -> bool:
        """Every row has exactly one token (a decoding step): unpacking and packing are then views, no copies."""
        return min(self.lengths) == 1 == max(self.lengths)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, h, N, ...]`` -> right-padded ``[B, h, T, ...]`` (pads are zeros)."""
        tokens = x[0].transpose(0, 1)  # [N, h, ...]
        if self.one_each:
            return tokens.unsqueeze(2)  # [B, h, 1, ...]
        padded = tokens.new_zeros((len(self.lengths) * self.width, *tokens.shape[1:]))
        padded.index_copy_(0, self.slots, tokens)
        return padded.view(len(self.lengths), self.width, *tokens.shape[1:]).transpose(1, 2)

    def pack(self, y: torch.Tensor) -> torch.Tensor:
        """Right-padded ``[B, h, T, ...]`` -> ``[1, h, N, ...]`` (pads dropped)."""
        if self.one_each:
            return y.squeeze(2).transpose(0, 1)[None]
        tokens = y.transpose(1, 2).reshape(len(self.lengths) * self.width, *y.shape[1:2], *y.shape[3:])
        return tokens.index_select(0, self.slots).transpose(0, 1)[None]


@dataclass(frozen=True)
class SharedKV:
    """Keys (or values) of one layer for a batch: the shared prefix and the rows' own tokens.

    With ``packing``, ``own`` is ``[1, kv_heads, N, head_dim]``: the rows laid end to end. With ``packing`` and
    ``own_mask`` (a step over a slot store), the queries come packed but ``own`` holds each row's whole own
    tokens so far, ``[B, kv_heads, S, head_dim]`` (earlier steps' and this one's), and ``own_mask``
    ``[B, 1, T, S]`` says which of them each unpacked query sees.
    """

    prefix: torch.Tensor  # [1, kv_heads, P, head_dim], read-only
    own: torch.Tensor  # [B, kv_heads, S, head_dim]
    packing: Packing | None = None
    own_parts: tuple[OwnPart, ...] | None = None  # a slot step's rows, attended part by part (see OwnPart)
    own_positions: torch.Tensor | None = None  # [B|1, S] each own key's position, where the fork recorded them


class OwnPart:
    """Some rows of a step over a slot store whose own attention is done together (one kernel call per layer).

    A step packs rows that feed one token (decoding) beside rows that feed many (a prompt, or a chunk of one).
    Unpacked together, every row would be padded to the longest, so a step with one prompt among many
    decoding rows would attend ``rows x prompt length`` queries. A step's rows are therefore split into parts
    of like length, each unpacked to its own width. Every query of a part sees at least one own key (pads see
    the row's first token), so no log-sum-exp needs fixing.

    Attributes: ``tokens`` ``[n]``: the part's queries in the step's packed order (None: all of them, in that
    order); ``rows`` ``[Rp]``: the rows of ``SharedKV.own`` the part reads (None: all); ``packing``: the part's
    queries as rows of ``own``; ``mask`` ``[Rp, 1, T, S]`` bool: which own keys each unpacked query sees.
    """

    def __init__(self, tokens: torch.Tensor | None, rows: torch.Tensor | None, packing: Packing, mask: torch.Tensor):
        self.tokens, self.rows, self.packing, self.mask = tokens, rows, packing, mask
        self._bias: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def grouped_mask(self, groups: int) -> torch.Tensor:
        """``[Rp, 1, groups * T, S]`` bool: the mask for queries with the heads of a kv group folded."""
        return self.mask.repeat(1, 1, groups, 1)

    def bias(self, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`grouped_mask` as an additive mask in ``dtype`` (0 or -inf), made once per step, not per layer."""
        key = (groups, dtype)
        if key not in self._bias:
            mask = self.grouped_mask(groups)
            self._bias[key] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return self._bias[key]


def use_shared_prefix_attention(model: torch.nn.Module) -> None:
    """Make a transformers ``model`` attend through :func:`shared_prefix_attention` (idempotent, cheap).

    A model that chooses no attention implementation (the lean decoder, which calls the attention from
    its own layers) is left as it is.
    """
    if hasattr(model, "set_attn_implementation") and model.config._attn_implementation != NAME:
        _register()
        model.set_attn_implementation(NAME)


@functools.cache
def _register() -> None:
    """Register the attention (and its mask format) with transformers, once, on first use."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, shared_prefix_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | SharedKV,
    value: torch.Tensor | SharedKV,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function. Returns ``([B, T, heads, head_dim], None)``.

    Args:
        query: ``[B, heads, T, head_dim]``.
        key, value: a :class:`SharedKV`, or plain ``[B, kv_heads, K, head_dim]`` tensors (SDPA path).
        attention_mask: boolean ``[B, 1, T, P + S]`` (True = attend) or None (causal); not read for
            packed rows, whose own part is causal per row by construction.
    """
    if not isinstance(key, SharedKV):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    unsupported = sorted(k for k in ("softcap", "s_aux") if kwargs.get(k) is not None)
    if unsupported:
        raise NotImplementedError(f"prefix sharing does not support attention with {', '.join(unsupported)}")
    batch, heads, width, head_dim = query.shape
    prefix_len, own_len = key.prefix.shape[-2], key.own.shape[-2]
    groups = heads // key.own.shape[1]
    window = Window.of(kwargs, prefix_len, own_len, width, query.device)  # None: not a sliding-window layer
    scale = head_dim**-0.5 if scaling is None else scaling

    kv_heads = key.own.shape[1]
    if key.own_parts is not None:
        if window is not None:
            window.require_rows_inside()
        out, lse = _own_parts(query, key.own, value.own, key.own_parts, scale)  # [1, H, N, d], [1, H, N]
    elif key.packing is not None:
        own_mask = None if window is None else window.packed_own_mask(key.packing)  # [B, 1, T, T] or None: causal
        out, lse = _own_packed(query, key.own, value.own, key.packing, own_mask, scale)  # [1, H, N, d], [1, H, N]
    else:
        own_mask = _own_mask(attention_mask, prefix_len, width, own_len, query.device)  # [B|1, 1, T, S] or None: causal
        if window is not None:
            own_mask = window.own_mask(own_mask, key.own_positions)
        out, lse = _own_grouped(query, key.own, value.own, own_mask, scale)  # [B, H, T, d], [B, H, T]
    band = None if window is None else window.prefix_band()  # [B|1, T, P] or None
    if prefix_len:
        folded = query.view(batch, kv_heads, groups, width, head_dim).transpose(0, 1)  # [kv, B, g, T, d]
        folded = folded.reshape(1, kv_heads, batch * groups * width, head_dim)  # [1, kv, B*g*T, d]
        visible = None if band is None else band[:, None].expand(-1, groups, -1, -1).reshape(1, 1, -1, prefix_len)
        out_p, lse_p = _attend(folded, key.prefix, value.prefix, visible, scale)  # visible: [1, 1, B*g*T, P] or None
        if visible is not None:  # a query whose window holds no prefix key: lse -inf, weight 0, no NaN in the merge
            out_p = out_p.nan_to_num(0.0)
        out_p = out_p.view(kv_heads, batch, groups, width, head_dim).transpose(0, 1).reshape(query.shape)
        lse_p = lse_p.view(kv_heads, batch, groups, width).transpose(0, 1).reshape(batch, heads, width)
        out = _merge(out, lse, out_p, lse_p)
    if window is not None and window.furthest >= prefix_len - 1:  # a pad far past its window may see no key: 0, not NaN
        out = out.nan_to_num(0.0)
    return out.transpose(1, 2).contiguous(), None


def _own_grouped(query, keys, values, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row against its own keys ``[B, kv, S, d]`` under ``mask`` ``[B|1, 1, T, S]``; the heads of a kv
    group are folded into one query sequence, so keys are never copied per head. ``mask`` None means
    causal with T == S: then each head of a group is its own causal call, which lets the kernel skip
    the masked half instead of reading a mask. Returns ``([B, H, T, d], lse [B, H, T])``."""
    batch, heads, width, head_dim = query.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    if mask is None:
        parts = [_attend(q, keys, values, None, scale, causal=True) for q in query.view(batch, kv_heads, groups, width, head_dim).unbind(2)]
        out = torch.stack([part_out for part_out, _ in parts], dim=2)  # [B, kv, g, T, d]
        lse = torch.stack([part_lse for _, part_lse in parts], dim=2)  # [B, kv, g, T]
        return out.view(query.shape), lse.reshape(batch, heads, width)
    grouped = query.reshape(batch, kv_heads, groups * width, head_dim)  # [B, kv, g*T, d]
    out, lse = _attend(grouped, keys, values, mask.repeat(1, 1, groups, 1), scale)
    return out.view(query.shape), lse.reshape(batch, heads, width)


def _own_packed(query, keys, values, packing: Packing, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows ``[1, H, N, d]`` each against its own tokens ``[1, kv, N, d]``: unpacked to right-padded
    rows, where causality alone keeps every real query off the pads (they follow its row's last
    token), then packed back. ``mask`` ``[B, 1, T, T]`` (a sliding window's) narrows the causal one; None: causal.
    Returns ``([1, H, N, d], lse [1, H, N])``."""
    out, lse = _own_grouped(packing.unpack(query), packing.unpack(keys), packing.unpack(values), mask, scale)
    return packing.pack(out), packing.pack(lse[..., None])[..., 0]


def _own_parts(query, keys, values, parts: Sequence[OwnPart], scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed queries ``[1, H, N, d]`` against each row's own keys ``[R, kv, S, d]`` (held in slots), part by part:
    each part's queries unpacked to its own width, attended under its mask, packed back into place.
    Returns ``([1, H, N, d], lse [1, H, N])``."""
    if len(parts) == 1 and parts[0].tokens is None and parts[0].rows is None:
        return _own_part(query, keys, values, parts[0], scale)
    out = torch.empty_like(query)  # [1, H, N, d]
    lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)  # [1, H, N]
    for part in parts:
        k, v = (keys, values) if part.rows is None else (keys.index_select(0, part.rows), values.index_select(0, part.rows))
        part_out, part_lse = _own_part(query.index_select(2, part.tokens), k, v, part, scale)
        out.index_copy_(2, part.tokens, part_out)
        lse.index_copy_(2, part.tokens, part_lse.float())
    return out, lse


def _own_part(query, keys, values, part: OwnPart, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """One part's packed queries ``[1, H, n, d]`` against its rows' own keys ``[Rp, kv, S, d]``, the heads of a kv
    group folded into one query sequence. Returns ``([1, H, n, d], lse [1, H, n])``."""
    rows = part.packing.unpack(query)  # [Rp, H, T, d]
    batch, heads, width, head_dim = rows.shape
    groups = heads // keys.shape[1]
    grouped = rows.reshape(batch, keys.shape[1], groups * width, head_dim)  # [Rp, kv, g*T, d]
    if _has_cpu_flash(grouped):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_dense(grouped, keys, values), 0.0, False, attn_mask=part.bias(groups, grouped.dtype), scale=scale)
    else:
        out, lse = _attend_eager(grouped, keys, values, part.grouped_mask(groups), scale)
    out, lse = out.view(rows.shape), lse.reshape(batch, heads, width)
    return part.packing.pack(out), part.packing.pack(lse[..., None])[..., 0]


def _own_mask(mask: torch.Tensor | None, prefix_len: int, width: int, own_len: int, device) -> torch.Tensor | None:
    """The own-token columns of the model's mask, or a causal mask aligned to the last query. ``[B|1, 1, T, S]``;
    None for causal when the queries are all the own tokens (T == S)."""
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError("prefixcache attention expects a boolean mask (sdpa format)")
        return mask[..., prefix_len:]
    if width == own_len:
        return None
    query_pos = torch.arange(own_len - width, own_len, device=device)[:, None]  # [T, 1]
    return (torch.arange(own_len, device=device)[None, :] <= query_pos)[None, None]


def _attend(q, k, v, mask, scale, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning ``(out [.., L, d], lse [.., L] float32)``; rows with no visible key get lse -inf.
    ``causal``: query ``i`` sees keys ``0..i`` (``mask`` must be None)."""
    if causal:
        mask = None
    if _has_cpu_flash(q):
        return _attend_cpu_flash(q, k, v, mask, scale, causal)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return _attend_eager(q, k, v, mask, scale)


def _has_cpu_flash(q: torch.Tensor) -> bool:
    """Whether torch's fused CPU attention (which returns the log-sum-exp) serves ``q``'s device."""
    return q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _attend_cpu_flash(q, k, v, mask, scale, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused CPU kernel, which also returns the log-sum-exp (it needs an additive mask in q's dtype)."""
    additive = None
    if mask is not None:
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*_dense(q, k, v), 0.0, causal, attn_mask=additive,
                                                                          scale=scale)
    if mask is not None:  # the kernel reports lse 0 for a row with no visible key
        lse = lse.masked_fill(~mask.any(-1).expand(lse.shape), float("-inf"))
    return out, lse


def _dense(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor with a dense last dim (stride 1), copied only where it is not: torch's fused CPU kernel, called
    directly, reads its inputs' last dim as dense and returns garbage for a transposed view (torch 2.13)."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _attend_eager(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain matmul/softmax attention for other devices (materializes ``[.., L, K]`` scores in float32)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [.., L, K]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [.., L]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.matmul(probs.to(v.dtype), v), lse


def _merge(out_own, lse_own, out_prefix, lse_prefix) -> torch.Tensor:
    """Combine two partial softmax attentions over disjoint key sets. ``[B, H, T, d]`` in the query dtype.

    With both parts normalized, the whole is ``out_own + (out_prefix - out_own) * w`` where
    ``w = exp(lse_prefix) / (exp(lse_prefix) + exp(lse_own)) = sigmoid(lse_prefix - lse_own)``:
    one fused ``lerp``, no float32 temporaries of the output's size.
    """
    weight = torch.sigmoid(lse_prefix - lse_own).to(out_own.dtype)[..., None]  # [B, H, T, 1]
    return torch.lerp(out_own, out_prefix, weight)

