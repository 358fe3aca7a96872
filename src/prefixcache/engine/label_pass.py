"""Whole-label scoring in one pass per record: the record's tokens, then the label trie's fed nodes.

Each record's row is laid out as its own tokens followed by the fed nodes of the labels' trie
(:class:`~prefixcache.engine.label_trie.LabelTrie`), and rows are packed end to end, so:

* the record's tokens are computed once and shared by all its labels (never copied per label),
  and every token reads the prefix through the same shared-prefix attention as any packed pass;
* a fed node attends to the prefix, its record's tokens and its own ancestors only (a tree mask),
  at the position it would have as the label's next token, so its hidden state is exactly the one
  a label-by-label continuation would compute;
* the full-vocabulary normalizer is taken once per trie node, in chunks, and only the log-probs
  of the trie's edges are kept (:meth:`LabelHead.edge_logprobs`).

Memory is bounded whatever the label count and batch size: records go through in groups of at
most ``token_budget`` tokens, and a trie larger than a group (or than the normalizer's chunk) is
split into ancestor-closed parts (:meth:`LabelTrie.parts`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..cache.attention import Packing, use_shared_prefix_attention
from ..cache.kv import PrefixKV
from .label_trie import TriePart
from .scoring import LabelHead

TOKEN_BUDGET = 4096  # packed tokens (records + fed nodes) per forward pass


@torch.inference_mode()
def score_whole_labels(
    model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]], head: LabelHead, token_budget: int = TOKEN_BUDGET
) -> torch.Tensor:
    """Label-normalized log-probs ``[B, L]`` of every whole label after each row (``full`` scoring).

    Equal to scoring each label's tokens as a continuation of the row (float32: to rounding).
    ``rows`` continue ``prefix`` (empty for full re-encoding); the prefix is only read.
    """
    trie = head.trie
    edge_logprobs = torch.zeros(len(rows), trie.edges)  # [B, E], float32
    max_fed = max(trie.max_depth - 1, min(token_budget, head.normalizer_rows) - 1)  # a label's path always fits
    for part in trie.parts(max_fed):
        for group in _groups([len(r) for r in rows], len(part), token_budget):
            hidden = _part_hidden(model, prefix, [rows[i] for i in group], part)  # [b, 1 + N, H]
            edge_logprobs[torch.tensor(group)[:, None], torch.tensor(part.edge_ids)[None, :]] = head.edge_logprobs(hidden, part).cpu()
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
    """Hidden states ``[B, 1 + N, H]``: each row's last token, then each of ``part``'s N fed nodes after it."""
    use_shared_prefix_attention(model)
    device = prefix.keys[0].device
    fed = len(part)
    own = torch.tensor([len(r) for r in rows], device=device)  # [B]
    layout = _RowLayout(own, fed, device)
    packing = Packing.of([len(r) + fed for r in rows], device, layout.tree_mask(part.sees(device)))
    ids = torch.tensor([t for row in rows for t in (*row, *part.tokens)], dtype=torch.long, device=device)[None]  # [1, N]
    positions = layout.steps(torch.tensor(part.depths, device=device)).reshape(-1)[packing.slots]  # [N]
    cache = prefix.fork(1, packing)
    out = model.base_model(input_ids=ids, position_ids=(prefix.length + positions)[None], cache=cache, use_cache=True)
    starts = packing.last - (own + fed - 1)  # [B]: each row's first packed token
    picks = (starts + own - 1)[:, None] + torch.arange(fed + 1, device=device)[None, :]  # [B, 1 + N]
    return out.last_hidden_state[0, picks]


class _RowLayout:
    """Right-padded rows of ``own[b]`` record tokens followed by ``fed`` trie nodes: ``[B, T]``."""

    def __init__(self, own: torch.Tensor, fed: int, device):
        self.own, self.fed = own, fed  # [B], n
        self.columns = torch.arange(int(own.max()) + fed, device=device)  # [T]
        node = self.columns[None, :] - own[:, None]  # [B, T]: index among the fed nodes, when in range
        self.is_node = (node >= 0) & (node < fed)  # [B, T]
        self.slot = torch.where(self.is_node, node, fed)  # [B, T]: n is a spare slot for everything else

    def steps(self, depths: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` each token's step after the prefix: a record token its own index, a fed node
        the step its label's token would have (the record's length - 1 + its depth)."""
        depth = torch.cat([depths, depths.new_zeros(1)])[self.slot]  # [B, T]
        return torch.where(self.is_node, self.own[:, None] - 1 + depth, self.columns[None, :])

    def tree_mask(self, sees: torch.Tensor) -> torch.Tensor:
        """``[B, 1, T, T]`` bool: record tokens (and pads) attend causally; a fed node attends to its
        row's record tokens and to the nodes ``sees`` (``[n, n]``) names: itself and its ancestors."""
        sees = torch.nn.functional.pad(sees, (0, 1, 0, 1))  # [n + 1, n + 1]: the spare slot sees nothing
        record = self.columns[None, None, :] < self.own[:, None, None]  # [B, 1, T]
        tree = sees[self.slot[:, :, None], self.slot[:, None, :]] | record  # [B, T, T]
        causal = self.columns[None, :, None] >= self.columns[None, None, :]  # [1, T, T]
        return torch.where(self.is_node[:, :, None], tree, causal)[:, None]
