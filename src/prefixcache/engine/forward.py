"""Engine: one batched forward pass of token rows over a shared prefix, scored against the labels.

``score_rows`` is the only place that calls the model for classification. The
three runner modes differ only in what they give it:

* ``full``: an empty prefix, and each row is the whole prompt (re-encoding);
* ``cached``: the task's prefix, one row per call (the published recipe);
* ``batched``: the task's prefix, B rows per call.

So every mode shares one scoring path, and the only thing the cache changes is
which tokens are recomputed.

This module knows nothing about records, files or tasks: only token ids.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..cache.attention import Packing, use_shared_prefix_attention
from ..cache.kv import ForkedCache, PrefixKV
from .scoring import LabelHead


def empty_prefix(model: torch.nn.Module) -> PrefixKV:
    """A zero-length prefix: forking it and feeding whole prompts is full re-encoding."""
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    param = next(model.parameters())
    empty = torch.zeros(1, cfg.num_key_value_heads, 0, head_dim, dtype=param.dtype, device=param.device)
    layers = cfg.num_hidden_layers
    return PrefixKV((), (empty,) * layers, (empty,) * layers)


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


@torch.inference_mode()
def last_hidden_packed(model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Run ``rows`` after ``prefix`` laid end to end as one sequence (no padding); return each row's
    hidden state at its last token, ``[B, H]``.

    Same contract as :func:`forward_rows` (rows never see each other, every row sees the whole
    prefix), but the linear layers compute only real tokens: with rows of unequal length that is
    the padding's share of the work saved. The fork is used for this one pass.
    """
    use_shared_prefix_attention(model)
    device = prefix.keys[0].device
    packing = Packing.of([len(r) for r in rows], device)
    ids = torch.tensor([token for row in rows for token in row], dtype=torch.long, device=device)[None]  # [1, N]
    positions = (prefix.length + packing.offsets)[None]  # [1, N]: each row counts on from the prefix
    out = model.base_model(input_ids=ids, position_ids=positions, cache=prefix.fork(1, packing), use_cache=True)
    return out.last_hidden_state[0, packing.last]  # [B, H]


@torch.inference_mode()
def score_rows(model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]], head: LabelHead) -> torch.Tensor:
    """Score each row as the continuation of ``prefix``. Returns label-normalized log-probs ``[B, L]``.

    First-token scoring of rows of unequal length runs them packed (:func:`last_hidden_packed`);
    rows of one length (a single row, say) have no padding to save and run as they are, and scoring
    whole labels runs them right-padded, since its second pass continues each row's own tokens.
    The prefix is only read. Each call uses its own fork, so concurrent calls are safe.
    """
    if head.method == "first-token" and len({len(r) for r in rows}) > 1:
        return head.first_token(last_hidden_packed(model, prefix, rows))
    device = prefix.keys[0].device
    ids, mask, lengths = pad_rows(rows, device)  # [B, S], [B, S], [B]
    batch = len(rows)
    cache = prefix.fork(batch)
    prefix_mask = torch.ones(batch, prefix.length, dtype=torch.bool, device=device)  # [B, P]
    start = torch.full((batch,), prefix.length, device=device)
    hidden = forward_rows(model, cache, ids, mask, start, prefix_mask)  # [B, S, H]
    last = hidden[torch.arange(batch, device=device), lengths - 1]  # [B, H]
    if head.method == "first-token":
        return head.first_token(last)
    logprobs = head.first_step(last)  # [B, L]
    logprobs = logprobs + _continuations(model, cache, torch.cat([prefix_mask, mask], dim=1), lengths + prefix.length, head)
    return head.normalize(logprobs)


def _continuations(
    model: torch.nn.Module, cache: ForkedCache, past_mask: torch.Tensor, next_pos: torch.Tensor, head: LabelHead
) -> torch.Tensor:
    """Log-probs of every label's tokens after its first, for every row. Returns ``[B, L]``.

    Each (row, multi-token label) pair becomes one row of a second pass over a
    copy of the row's own tokens (the prefix is still shared, not copied).
    """
    batch, n_labels = past_mask.shape[0], len(head.labels)
    label_ids = list(head.prompt.label_ids.values())
    multi = [j for j, ids in enumerate(label_ids) if len(ids) > 1]
    extra = torch.zeros(batch, n_labels, device=past_mask.device)
    if not multi:
        return extra
    cache.batch_repeat_interleave(len(multi))  # own tokens: [B * M, ...]
    inputs = [label_ids[j][:-1] for _ in range(batch) for j in multi]  # label tokens fed
    targets = [label_ids[j][1:] for _ in range(batch) for j in multi]  # label tokens predicted
    ids, mask, _ = pad_rows(inputs, past_mask.device)  # [B*M, T]
    hidden = forward_rows(
        model, cache, ids, mask, next_pos.repeat_interleave(len(multi)), past_mask.repeat_interleave(len(multi), dim=0)
    )
    vocab = head.vocab_logprobs(hidden)  # [B*M, T, V]
    target_ids, _, _ = pad_rows(targets, past_mask.device)
    picked = vocab.gather(-1, target_ids[..., None]).squeeze(-1) * mask  # [B*M, T]
    sums = picked.sum(dim=1).view(batch, len(multi))  # [B, M]
    extra[:, multi] = sums
    return extra
