"""Engine: the forward passes of token rows over a shared prefix, and nothing about labels.

* :func:`forward_rows` appends right-padded rows to a fork (each row may continue later), causally;
  :func:`forward_visible` appends tokens that attend as a given mask says (a tree of label tokens);
* :func:`last_hidden_packed` runs rows laid end to end in one pass (no pads computed) and returns
  each row's last hidden state (:func:`packed_states_at`: the states at chosen positions of each row);
* :func:`empty_prefix` is the zero-length prefix under which a row is the whole prompt.

Rows never see each other, and every row sees the whole prefix (the fork's contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..attention.shared_prefix import Packing, use_shared_prefix_attention
from ..cache.kv import ForkedCache, KVShape, PrefixKV


def empty_prefix(model: torch.nn.Module) -> PrefixKV:
    """A zero-length prefix: forking it and feeding whole prompts is full re-encoding."""
    shape = KVShape.of(model.config)
    param = next(model.parameters())
    empty = torch.zeros(1, shape.kv_heads, 0, shape.head_dim, dtype=param.dtype, device=param.device)
    return PrefixKV((), (empty,) * shape.layers, (empty,) * shape.layers)


def pad_rows(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad token rows.

    Returns ``ids [B, S]`` (pads are token 0), ``mask [B, S]`` (True on real tokens) and ``lengths [B]``.
    """
    lengths = torch.tensor([len(r) for r in rows], device=device)
    width = int(lengths.max())
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long, device=device)
    mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
    return ids, mask, lengths


def forward_rows(
    model: torch.nn.Module,
    cache: ForkedCache,
    ids: torch.Tensor,
    mask: torch.Tensor,
    start: torch.Tensor,
    past_mask: torch.Tensor,
) -> torch.Tensor:
    """Append ``ids`` to every row of ``cache`` and return the decoder's hidden states.

    Args:
        ids: ``[B, T]`` new tokens, right-padded; ``mask`` ``[B, T]`` marks real ones.
        start: ``[B]`` position (RoPE index) of each row's first new token.
        past_mask: ``[B, K]`` which of the cache's K = prefix + own tokens each row may attend to.

    Returns:
        hidden ``[B, T, H]``. Rows never see each other; pads are never attended to by real tokens.
    """
    use_shared_prefix_attention(model)
    width = ids.shape[1]
    positions = start[:, None] + torch.arange(width, device=ids.device)[None, :]  # [B, T]
    attention = torch.cat([past_mask, mask], dim=1)  # [B, K + T]
    out = model.base_model(input_ids=ids, attention_mask=attention, position_ids=positions, cache=cache, use_cache=True)
    return out.last_hidden_state


def forward_visible(
    model: torch.nn.Module, cache: ForkedCache, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Append ``ids`` ``[B, T]`` to every row of ``cache``, each new token attending as ``visible`` says.

    Args:
        positions: ``[B, T]`` each new token's position (RoPE index).
        visible: ``[B, 1, T, K + T]`` bool over the cache's K = prefix + own tokens, then the new ones;
            its prefix columns must be all true (the fork's contract).

    Returns:
        hidden ``[B, T, H]``.
    """
    use_shared_prefix_attention(model)
    out = model.base_model(input_ids=ids, attention_mask=visible, position_ids=positions, cache=cache, use_cache=True)
    return out.last_hidden_state


@dataclass(frozen=True)
class PaddedPass:
    """Right-padded rows run over a fork of a prefix (:func:`run_padded`); the fork may be continued.

    ``seen`` ``[B, P + S]`` is what each row's next token may attend to: the whole prefix and its row's
    real tokens.
    """

    cache: ForkedCache
    seen: torch.Tensor  # [B, P + S] bool
    lengths: torch.Tensor  # [B]
    last: torch.Tensor  # [B, H]: each row's hidden state at its last real token


def run_padded(model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]]) -> PaddedPass:
    """Run ``rows`` right-padded after ``prefix`` in a new fork (one pass, causal)."""
    device = prefix.keys[0].device
    ids, mask, lengths = pad_rows(rows, device)  # [B, S], [B, S], [B]
    batch = len(rows)
    cache = prefix.fork(batch)
    past = torch.ones(batch, prefix.length, dtype=torch.bool, device=device)  # [B, P]
    hidden = forward_rows(model, cache, ids, mask, torch.full((batch,), prefix.length, device=device), past)  # [B, S, H]
    last = hidden[torch.arange(batch, device=device), lengths - 1]  # [B, H]
    return PaddedPass(cache, torch.cat([past, mask], dim=1), lengths, last)


def last_hidden_packed(model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Run ``rows`` after ``prefix`` laid end to end as one sequence (no padding); return each row's
    hidden state at its last token, ``[B, H]``.

    Same contract as :func:`forward_rows` (rows never see each other, every row sees the whole
    prefix), but the linear layers compute only real tokens: with rows of unequal length that is
    the padding's share of the work saved. The fork is used for this one pass.
    """
    with torch.inference_mode():
        return packed_last_states(model, prefix, rows)


def packed_last_states(model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """:func:`last_hidden_packed` under whatever grad mode the caller runs: the same pass, differentiable in
    the prefix's keys and values when they require grad (prefix tuning trains through it). ``[B, H]``."""
    hidden, packing = _packed_pass(model, prefix, rows)
    return hidden[packing.last]  # [B, H]


def packed_states_at(
    model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]], at: Sequence[Sequence[int]]
) -> torch.Tensor:
    """The same packed pass as :func:`packed_last_states` (under the caller's grad mode), returning the hidden
    states at positions ``at[b]`` (offsets within row ``b``) of every row, row after row: ``[sum(len(at[b])), H]``.
    Teacher forcing reads an answer's every position this way (the model's output head then gives its logits)."""
    hidden, packing = _packed_pass(model, prefix, rows)
    starts = [0]
    for length in packing.lengths[:-1]:
        starts.append(starts[-1] + length)
    index = torch.tensor([start + int(o) for start, offsets in zip(starts, at) for o in offsets],
                         dtype=torch.long, device=hidden.device)  # [M]
    return hidden[index]  # [M, H]


def _packed_pass(model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, Packing]:
    """Rows laid end to end after ``prefix`` in one pass: every token's hidden state ``[N, H]`` and the packing."""
    hidden, packing, _ = packed_pass_kv(model, prefix, rows)
    return hidden, packing


def packed_pass_kv(model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]]):
    """The packed pass of :func:`packed_last_states` (rows end to end after ``prefix``, under the caller's grad
    mode), returning every token's hidden state ``[N, H]``, the packing, and the fork whose layers hold the rows' own
    keys and values (``cache.layers[l].keys``: ``[1, kv_heads, N, head_dim]``, row after row)."""
    use_shared_prefix_attention(model)
    device = prefix.keys[0].device
    packing = Packing.of([len(r) for r in rows], device)
    ids = torch.tensor([token for row in rows for token in row], dtype=torch.long, device=device)[None]  # [1, N]
    positions = (prefix.length + packing.offsets)[None]  # [1, N]: each row counts on from the prefix
    cache = prefix.fork(1, packing)
    out = model.base_model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
    return out.last_hidden_state[0], packing, cache  # [N, H]
