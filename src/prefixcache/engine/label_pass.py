"""Whole-label scoring through the labels' trie: each record's tokens once, then every fed node once.

A batch of records runs as one fork of the prefix, in two passes: the records' own tokens (right-
padded, causal), then the fed nodes of the labels' trie (:class:`~prefixcache.engine.label_trie.LabelTrie`)
for every record at once. So:

* the record's tokens are computed once and stay shared by all its labels (never copied per
  label), and every token reads the prefix through the same shared-prefix attention as any pass;
* a fed node attends to the prefix, its record's tokens and its own ancestors only (a tree mask),
  at the position it would have as the label's next token, so its hidden state is exactly the one
  a label-by-label continuation would compute;
* the full-vocabulary normalizer is taken once per trie node, in chunks, and only the log-probs
  of the trie's edges are kept (:meth:`LabelScorer.edge_logprobs`).

Memory is bounded whatever the label count and batch size: records go through in groups of at
most ``token_budget`` tokens, and a trie larger than a group (or than the normalizer's chunk) is
split into ancestor-closed parts (:meth:`LabelTrie.parts`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..cache.kv import PrefixKV
from .label_trie import TriePart
from .rows import forward_visible, run_padded
from .scoring import LabelScorer

TOKEN_BUDGET = 4096  # packed tokens (records + fed nodes) per forward pass


def score_whole_labels(
    model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]], head: LabelScorer, token_budget: int = TOKEN_BUDGET
) -> torch.Tensor:
    """Label-normalized log-probs ``[B, L]`` of every whole label after each row (``full`` scoring).

    Equal to scoring each label's tokens as a continuation of the row (float32: to rounding).
    ``rows`` continue ``prefix`` (empty for full re-encoding); the prefix is only read.
    """
    with torch.inference_mode():
        trie = head.trie
        edge_logprobs = torch.zeros(len(rows), trie.edges, device="cpu")  # [B, E], float32, gathered on the CPU
        max_fed = max(trie.max_depth - 1, min(token_budget, head.normalizer_rows) - 1)  # a label's path always fits
        for part in trie.parts(max_fed):
            columns = torch.tensor(part.edge_ids, device="cpu")[None, :]  # [1, E_part]: the part's edges, once
            for group in _groups([len(r) for r in rows], len(part), token_budget):
                hidden = _part_hidden(model, prefix, [rows[i] for i in group], part)  # [b, 1 + N, H]
                at_rows = torch.tensor(group, device="cpu")[:, None]  # [b, 1]
                edge_logprobs[at_rows, columns] = head.edge_logprobs(hidden, part).cpu()
        return head.normalize(trie.label_sums(edge_logprobs))


def _groups(lengths: Sequence[int], fed: int, token_budget: int) -> list[list[int]]:
    """Consecutive row indices whose rows plus ``fed`` nodes each fit ``token_budget`` (at least one row)."""
    groups, used = [[]], 0
    for i, length in enumerate(lengths):
        size = length + fed
        if groups[-1] and used + size > token_budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += size
    return groups


def _part_hidden(model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]], part: TriePart) -> torch.Tensor:
    """Hidden states ``[B, 1 + N, H]``: each row's last token, then each of ``part``'s N fed nodes after it.

    Two passes over one fork: the rows (right-padded, causal), then the fed nodes of every row at
    once, each attending to the prefix, its row's tokens and its own ancestors (``part.sees``).
    """
    device = prefix.keys[0].device
    first = run_padded(model, prefix, rows)
    batch, fed = len(rows), len(part)
    last = first.last[:, None]  # [B, 1, H]
    if not fed:
        return last
    seen = first.seen[:, None, None, :].expand(batch, 1, fed, -1)  # [B, 1, N, P + S]
    tree = part.sees(device)[None, None].expand(batch, 1, fed, fed)  # [B, 1, N, N]
    depths = torch.tensor(part.depths, device=device)  # [N]
    positions = (prefix.length + first.lengths - 1)[:, None] + depths[None, :]  # [B, N]: the label token's own position
    nodes = torch.tensor(part.tokens, dtype=torch.long, device=device).expand(batch, fed)  # [B, N]
    return torch.cat([last, forward_visible(model, first.cache, nodes, positions, torch.cat([seen, tree], dim=-1))], dim=1)
