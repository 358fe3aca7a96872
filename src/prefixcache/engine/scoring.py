"""Label scoring: turn hidden states into log-probabilities over a task's labels.

Two methods:

* ``first-token`` (the published recipe): the logit of each label's first
  token at the last position of the record. Only the label rows of the output
  head are multiplied, never the whole vocabulary.
* ``full``: the sum of log-probs of *all* of a label's tokens, each normalized
  over the full vocabulary. The tokens after the first are fed through the labels'
  trie (:mod:`prefixcache.engine.label_pass`); this module only does the arithmetic.

Either way the result is normalized over the label set: ``scores[b].exp().sum() == 1``.

This module knows nothing about caches or batching.
"""

from __future__ import annotations

import torch

from ..task.label_set import LabelSet
from ..types import LabelScores
from .label_trie import LabelTrie, TriePart

LOGIT_BYTES = 64 * 2**20  # the most full-vocabulary float32 logits held at once
SCORED_METHODS = ("first-token", "full")  # how the prompt's label tokens are scored (``auto`` resolved before)
LABEL_PASSES = ("trie", "per-label")  # how ``full`` scoring feeds label tokens: the trie, or the reference


class LabelScorer:
    """The output head restricted to what a task needs.

    Contract: ``first_token(h)`` and ``first_step(h)`` take ``h: [B, H]`` (hidden
    state at each row's last real token) and return ``[B, L]`` with L = number of labels.

    ``label_pass`` picks how ``full`` scoring feeds the label tokens after the first: ``"trie"``
    (each trie node once per record) or ``"per-label"`` (one continuation row per record and
    label: the reference the trie is tested and benchmarked against).

    Raises:
        ValueError: ``method`` is not ``first-token`` or ``full``, or ``label_pass`` is unknown.
    """

    def __init__(self, model: torch.nn.Module, prompt: LabelSet, method: str, label_pass: str = "trie"):
        if method not in SCORED_METHODS:  # ``auto`` is resolved by the prompt, a fitted head's method by the run
            raise ValueError(f"method must be one of {SCORED_METHODS}, got {method!r}")
        if label_pass not in LABEL_PASSES:
            raise ValueError(f"label_pass must be one of {LABEL_PASSES}, got {label_pass!r}")
        self.prompt = prompt
        self.method = method
        self.label_pass = label_pass
        self.labels = tuple(prompt.label_ids)
        self.trie = LabelTrie.build(list(prompt.label_ids.values()))
        head = model.get_output_embeddings()
        self._weight = head.weight  # [V, H]
        self._bias = getattr(head, "bias", None)
        first = torch.tensor(prompt.first_token_ids(), device=head.weight.device)
        self._first = first  # [L]
        self._label_rows = head.weight.index_select(0, first).float()  # [L, H]
        self._label_bias = self._bias.index_select(0, first).float() if self._bias is not None else None

    def first_token(self, hidden: torch.Tensor) -> torch.Tensor:
        """Label-set log-softmax of the label rows' logits. hidden: [B, H] -> [B, L]."""
        logits = hidden.float() @ self._label_rows.T  # [B, L]
        if self._label_bias is not None:
            logits = logits + self._label_bias
        return torch.log_softmax(logits, dim=-1)

    def vocab_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary log-softmax. hidden: [..., H] -> [..., V] (float32)."""
        logits = hidden.float() @ self._weight.float().T
        if self._bias is not None:
            logits = logits + self._bias.float()
        return torch.log_softmax(logits, dim=-1)

    @property
    def normalizer_rows(self) -> int:
        """Hidden states whose full-vocabulary logits fit :data:`LOGIT_BYTES` at once."""
        return max(1, LOGIT_BYTES // (4 * self._weight.shape[0]))

    def edge_logprobs(self, hidden: torch.Tensor, part: TriePart) -> torch.Tensor:
        """Vocab-normalized log-prob of each of ``part``'s edges. hidden: ``[B, 1 + N, H]`` (each row's
        last token, then the part's fed nodes) -> ``[B, E']`` float32.

        The logits of at most :attr:`normalizer_rows` hidden states exist at once; of each, only the
        normalizer and the edges' tokens are kept.
        """
        sources = torch.tensor(part.edge_sources, device=hidden.device)  # [E']
        tokens = torch.tensor(part.edge_tokens, device=hidden.device)  # [E']
        step = max(1, self.normalizer_rows // hidden.shape[1])
        out = []
        for rows in hidden.split(step):  # [b, 1 + N, H]
            logprobs = self.vocab_logprobs(rows)  # [b, 1 + N, V]
            out.append(logprobs[:, sources, tokens])  # [b, E']
        return torch.cat(out)

    def first_step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocab-normalized log-prob of each label's first token. hidden: [B, H] -> [B, L]."""
        return self.vocab_logprobs(hidden).index_select(-1, self._first)

    @staticmethod
    def normalize(logprobs: torch.Tensor) -> torch.Tensor:
        """Renormalize per-label sequence log-probs over the label set. [B, L] -> [B, L]."""
        return logprobs - torch.logsumexp(logprobs, dim=-1, keepdim=True)

    def to_scores(self, logprobs: torch.Tensor) -> list[LabelScores]:
        """[B, L] normalized log-probs -> one LabelScores per row."""
        return [LabelScores(self.labels, tuple(float(x) for x in row)) for row in logprobs.double().cpu()]
