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

from ..cache.kv import PrefixKV
from .label_pass import score_whole_labels
from .per_label import score_per_label
from .rows import last_hidden_packed, run_padded
from .scoring import LabelScorer

__all__ = ["score_rows"]


def score_rows(model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]], head: LabelScorer) -> torch.Tensor:
    """Score each row as the continuation of ``prefix``. Returns label-normalized log-probs ``[B, L]``.

    First-token scoring reads each row's last hidden state: rows of unequal length run packed
    (:func:`last_hidden_packed`), rows of one length (a single row, say) have no padding to save
    and run as they are. Whole labels (``full``) go through the labels' trie: the record's tokens,
    then the trie's nodes, over one fork (:func:`~prefixcache.engine.label_pass.score_whole_labels`),
    or label by label where the head asks for the reference (``label_pass="per-label"``).
    The prefix is only read. Each call uses its own fork, so concurrent calls are safe.
    """
    with torch.inference_mode():
        if head.method != "first-token":
            score = score_whole_labels if head.label_pass == "trie" else score_per_label
            return score(model, prefix, rows, head)
        if len({len(r) for r in rows}) > 1:
            return head.first_token(last_hidden_packed(model, prefix, rows))
        return head.first_token(run_padded(model, prefix, rows).last)
