"""The labels' tokens as a trie: what a record must be fed, once, to score every whole label.

Under ``full`` scoring a label's log-prob is the sum of its tokens' log-probs, each one after the
record and the label's earlier tokens. Labels that share leading tokens share those terms, so the
work follows the trie of the labels' token sequences, not labels x tokens:

* the *root* stands for the record's last token, whose hidden state predicts every first token;
* every other node that has children is *fed*: its token is appended after the record at the
  position its depth gives, and attends to the record and to its own ancestors, never to a
  sibling; its hidden state predicts each of its children's tokens;
* each *edge* (parent, token) is one log-prob term, and a label's log-prob is the sum of the
  edges on its path from the root.

Leaves are never fed: nothing follows them. A label that is a prefix of another ends at an inner
node, and its path simply stops there.

This module is pure bookkeeping (token ids and indices); :mod:`prefixcache.engine.label_pass`
runs it through the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class TriePart:
    """Fed nodes closed under ancestry, and the edges whose log-probs this part computes.

    Indices are local to the part: a node's ``parents`` entry is -1 for the root or an index into
    this part's nodes; an edge's ``edge_sources`` entry is 0 for the root, ``k + 1`` for node ``k``.
    """

    tokens: tuple[int, ...]  # [N] fed nodes' tokens, every parent before its children
    parents: tuple[int, ...]  # [N]
    depths: tuple[int, ...]  # [N] 1 for a child of the root
    edge_sources: tuple[int, ...]  # [E'] where each edge's log-prob is read
    edge_tokens: tuple[int, ...]  # [E'] the token each edge predicts
    edge_ids: tuple[int, ...]  # [E'] each edge's index in the whole trie

    def __len__(self) -> int:
        return len(self.tokens)

    def sees(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[N, N]`` bool: fed node ``i`` attends to fed node ``j`` (``j`` is ``i`` or one of its ancestors)."""
        sees = torch.eye(len(self.tokens), dtype=torch.bool, device="cpu")  # built on the CPU whatever the default
        for i, parent in enumerate(self.parents):  # parents come first, so their rows are complete
            if parent >= 0:
                sees[i] |= sees[parent]
        return sees.to(device)


@dataclass(frozen=True)
class LabelTrie:
    """The trie of the labels' token sequences (see the module docstring).

    ``whole`` holds every fed node and every edge; ``paths[l]`` lists label ``l``'s edges, root first.
    """

    whole: TriePart
    paths: tuple[tuple[int, ...], ...]  # [L] edge ids
    max_depth: int  # tokens in the longest label

    @classmethod
    def build(cls, label_ids: Sequence[Sequence[int]]) -> LabelTrie:
        """The trie of ``label_ids`` (one token sequence per label, in label order).

        Raises:
            ValueError: a label has no tokens.
        """
        empty = [k for k, ids in enumerate(label_ids) if len(ids) == 0]
        if empty:
            raise ValueError(f"every label needs at least one token; label {empty[0]} (0-based) has none")
        children: dict[tuple[int, ...], dict[int, tuple[int, ...]]] = {(): {}}
        for ids in label_ids:
            for depth in range(len(ids)):
                node = tuple(ids[: depth + 1])
                children[node[:-1]].setdefault(node[-1], node)
                children.setdefault(node, {})
        fed = [node for node in _depth_first(children) if node and children[node]]
        index = {node: k for k, node in enumerate(fed)}
        edges = [(parent, token) for parent in [(), *fed] for token in children[parent]]
        edge_of = {parent + (token,): e for e, (parent, token) in enumerate(edges)}
        whole = TriePart(
            tokens=tuple(node[-1] for node in fed),
            parents=tuple(index.get(node[:-1], -1) for node in fed),
            depths=tuple(len(node) for node in fed),
            edge_sources=tuple(index[parent] + 1 if parent else 0 for parent, _ in edges),
            edge_tokens=tuple(token for _, token in edges),
            edge_ids=tuple(range(len(edges))),
        )
        paths = tuple(tuple(edge_of[tuple(ids[: d + 1])] for d in range(len(ids))) for ids in label_ids)
        return cls(whole, paths, max(len(ids) for ids in label_ids))

    @property
    def edges(self) -> int:
        return len(self.whole.edge_ids)

    def parts(self, max_fed: int) -> list[TriePart]:
        """Split the fed nodes into parts of at most ``max_fed`` nodes each, each closed under ancestry.

        Every edge is computed by exactly one part (a node's outgoing edges by the part that owns the
        node; the root's by the first part). A node's ancestors may be repeated in a later part, which
        costs a few fed tokens and keeps each part's memory bounded however many labels there are.

        Raises:
            ValueError: ``max_fed`` is below the deepest fed node's depth (a path would not fit).
        """
        whole = self.whole
        if len(whole) <= max_fed:
            return [whole]
        if max_fed < self.max_depth - 1:
            raise ValueError(f"a part of {max_fed} fed nodes cannot hold a label path of {self.max_depth - 1}")
        groups: list[tuple[list[int], list[int]]] = []  # (nodes, owned nodes)
        nodes: list[int] = []
        for k in range(len(whole)):
            chain = _ancestry(whole.parents, k)  # root side first, ending at k
            missing = [n for n in chain if n not in nodes]
            if nodes and len(nodes) + len(missing) > max_fed:
                nodes = [n for n in chain]
                groups.append((nodes, [k]))
            elif not groups:
                nodes.extend(missing)
                groups.append((nodes, [k]))
            else:
                nodes.extend(missing)
                groups[-1][1].append(k)
        return [self._part(nodes, owned, first=g == 0) for g, (nodes, owned) in enumerate(groups)]

    def _part(self, nodes: list[int], owned: list[int], first: bool) -> TriePart:
        whole = self.whole
        local = {node: i for i, node in enumerate(nodes)}  # nodes are in depth-first order, parents first
        sources = {0: 0} if first else {}
        sources.update({k + 1: local[k] + 1 for k in owned})
        edges = [e for e, src in enumerate(whole.edge_sources) if src in sources]
        return TriePart(
            tokens=tuple(whole.tokens[n] for n in nodes),
            parents=tuple(local.get(whole.parents[n], -1) for n in nodes),
            depths=tuple(whole.depths[n] for n in nodes),
            edge_sources=tuple(sources[whole.edge_sources[e]] for e in edges),
            edge_tokens=tuple(whole.edge_tokens[e] for e in edges),
            edge_ids=tuple(edges),
        )

    def label_sums(self, edge_logprobs: torch.Tensor) -> torch.Tensor:
        """Each label's log-prob, the sum of its path's edges. ``[B, E]`` -> ``[B, L]``."""
        width = self.max_depth
        index = torch.tensor([list(p) + [self.edges] * (width - len(p)) for p in self.paths], device=edge_logprobs.device)
        padded = torch.cat([edge_logprobs, edge_logprobs.new_zeros(edge_logprobs.shape[0], 1)], dim=1)  # [B, E + 1]
        return padded[:, index].sum(dim=-1)  # [B, L, D] -> [B, L]


def _depth_first(children: dict[tuple[int, ...], dict[int, tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """Every node, each parent before its children, siblings in label order."""
    order, stack = [], [()]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(list(children[node].values())))
    return order


def _ancestry(parents: Sequence[int], node: int) -> list[int]:
    """``node``'s fed ancestors, root side first, then ``node``."""
    chain = [node]
    while parents[chain[-1]] >= 0:
        chain.append(parents[chain[-1]])
    return chain[::-1]
