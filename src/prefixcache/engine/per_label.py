"""Whole-label scoring label by label: the reference that the label trie is measured against.

Each (row, multi-token label) pair becomes one row of a second pass over a copy of the row's own
tokens, and the full-vocabulary log-softmax is materialized for every label token. Its cost and
memory grow with rows x labels, which is why :mod:`prefixcache.engine.label_pass` replaced it;
it stays as the independent path the trie's property test and ``bench``'s "before" lane run.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..cache.kv import ForkedCache, PrefixKV
from .rows import forward_rows, pad_rows, run_padded
from .scoring import LabelScorer


@torch.inference_mode()
def score_per_label(model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]], head: LabelScorer) -> torch.Tensor:
    """Label-normalized log-probs ``[B, L]`` of every whole label after each row (``full`` scoring)."""
    first = run_padded(model, prefix, rows)
    logprobs = head.first_step(first.last)  # [B, L]
    logprobs = logprobs + _continuations(model, first.cache, first.seen, first.lengths + prefix.length, head)
    return head.normalize(logprobs)


def _continuations(
    model: torch.nn.Module, cache: ForkedCache, past_mask: torch.Tensor, next_pos: torch.Tensor, head: LabelScorer
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
