"""Choosing each generated token: greedy or sampled, and the log-probs a client may ask for.

:class:`Sampling` says how (temperature 0 is greedy, the default); :class:`TokenPicker` picks one
token per live row of a decoding step. A seeded row draws from its own generator, so its tokens
do not depend on which other rows shared its pass. Log-probs are the model's own (a log-softmax of
the raw logits, before temperature and top-p), as vLLM reports them by default.

This module knows nothing about prefixes, rows' positions or text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


GREEDY_BELOW = 1e-5  # as vLLM: a lower temperature is greedy


@dataclass(frozen=True)
class Sampling:
    """How to choose tokens.

    Attributes:
        temperature: 0 (or under :data:`GREEDY_BELOW`) picks the most likely token (greedy); above 0 samples from ``softmax(logits / temperature)``.
        top_p: sample only from the smallest set of most likely tokens whose probabilities reach ``top_p``.
        seed: seeds each row's generator (the same seed gives the same tokens, whatever the batch).
        top_logprobs: ``None`` records no log-probs; ``k >= 0`` records the chosen token's log-prob and the ``k``
            most likely tokens' at every step.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be 0 or more")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise ValueError("top_logprobs must be 0 or more")

    @property
    def greedy(self) -> bool:
        """A temperature under :data:`GREEDY_BELOW` picks the most likely token (dividing by it would overflow)."""
        return self.temperature < GREEDY_BELOW


GREEDY = Sampling()


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-prob, and the most likely tokens' at that step (``(token id, log-prob)``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TokenPicker:
    """Picks the next token of every row; row ``i`` of the first call is row ``i`` of the batch.

    Contract: :meth:`pick` takes the live rows' logits ``[b, V]`` and ``rows`` (each live row's batch
    index, in the logits' order) and returns the chosen ids ``[b]`` and, when log-probs are recorded,
    one :class:`TokenLogprob` per live row (else ``None``).
    """

    def __init__(self, sampling: Sampling, batch: int, device: torch.device):
        self.sampling = sampling
        self._generators: list[torch.Generator | None] = [None] * batch
        if not sampling.greedy and sampling.seed is not None:
            self._generators = [torch.Generator(device=device).manual_seed(sampling.seed) for _ in range(batch)]

    def pick(self, logits: torch.Tensor, rows: Sequence[int]) -> tuple[torch.Tensor, list[TokenLogprob] | None]:
        if self.sampling.greedy:
            ids = logits.argmax(dim=-1)  # [b]
        else:
            probs = _nucleus(torch.softmax(logits.float() / self.sampling.temperature, dim=-1), self.sampling.top_p)
            ids = torch.stack([
                torch.multinomial(probs[i], 1, generator=self._generators[row])[0] for i, row in enumerate(rows)
            ])  # [b]
        if self.sampling.top_logprobs is None:
            return ids, None
        return ids, _logprobs(logits, ids, self.sampling.top_logprobs)


def pick_each(logits: torch.Tensor, pickers: Sequence[TokenPicker]) -> list[tuple[int, TokenLogprob | None]]:
    """Row ``i``'s next token by ``pickers[i]`` (each a one-row picker), from ``logits`` ``[b, V]``.

    What a row gets is what its picker alone gives it. Greedy rows are picked together: one argmax, and one
    log-softmax per number of top log-probs recorded; a sampling row draws alone, from its own generator.
    Returns ``(token id, its log-prob or None)`` per row, in order.
    """
    out: list[tuple[int, TokenLogprob | None]] = [(0, None)] * len(pickers)
    greedy = [i for i, picker in enumerate(pickers) if picker.sampling.greedy]
    if greedy:
        rows = logits if len(greedy) == len(pickers) else logits.index_select(0, torch.tensor(greedy, device=logits.device))
        ids = rows.argmax(dim=-1)  # [g]
        tokens = ids.tolist()
        by_k: dict[int | None, list[int]] = {}
        for j, i in enumerate(greedy):
            by_k.setdefault(pickers[i].sampling.top_logprobs, []).append(j)
        for k, members in by_k.items():
            if k is None:
                picked = [None] * len(members)
            else:
                index = torch.tensor(members, device=logits.device)
                picked = _logprobs(rows.index_select(0, index), ids.index_select(0, index), k)
            for j, logprob in zip(members, picked):
                out[greedy[j]] = (tokens[j], logprob)
    for i, picker in enumerate(pickers):
        if not picker.sampling.greedy:
            ids, logprobs = picker.pick(logits[i : i + 1], [0])
            out[i] = (int(ids[0]), logprobs[0] if logprobs else None)
    return out


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs [b, V]`` with everything outside each row's top-``top_p`` mass set to 0 (the most likely token is kept)."""
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [b, V]
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
    drop = before >= top_p
    drop[:, 0] = False  # a top_p below float32's smallest number still keeps the most likely token
    sorted_probs[drop] = 0
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def _logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> list[TokenLogprob]:
    """The chosen tokens' log-probs and the ``k`` most likely tokens' (``logits [b, V]``, ``ids [b]``)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [b, V]
    chosen = logprobs.gather(-1, ids[:, None])[:, 0].tolist()  # [b]
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], ids[:, None][:, :0])
    return [
        TokenLogprob(int(token), value, tuple(zip(map(int, tids), map(float, tvals))))
        for token, value, tids, tvals in zip(ids.tolist(), chosen, top_ids.tolist(), top_values.tolist())
    ]
