"""Label scoring: turn hidden states into log-probabilities over a task's labels.

Two methods:

* ``first-token`` (the published recipe): the logit of each label's first
  token at the last position of the record. Only the label rows of the output
  head are multiplied, never the whole vocabulary.
* ``full``: the sum of log-probs of *all* of a label's tokens, each normalized
  over the full vocabulary. Needs one extra batched pass over the label
  continuations (done by the classifier); this module only does the arithmetic.

Either way the result is normalized over the label set: ``scores[b].exp().sum() == 1``.

This module knows nothing about caches or batching.
"""

from __future__ import annotations

import torch

from ..spec.prompt import Prompt
from ..types import LabelScores


class LabelHead:
    """The output head restricted to what a task needs.

    Contract: ``first_token(h)`` and ``first_step(h)`` take ``h: [B, H]`` (hidden
    state at each row's last real token) and return ``[B, L]`` with L = number of labels.
    """

    def __init__(self, model: torch.nn.Module, prompt: Prompt, method: str):
        self.prompt = prompt
        self.method = method
        self.labels = tuple(prompt.label_ids)
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
