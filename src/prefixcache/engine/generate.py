"""Decoding that continues from a shared prefix, batched, with stop strings (greedy unless sampled).

:func:`generate_rows` feeds B token rows after a stored prefix in one forward
pass (right-padded, like :func:`~prefixcache.engine.forward.score_rows`), then decodes
greedily one token per row per step. Each row keeps its own next position
(``P + len(row) + step``) and its own attention mask, in which the padding
between its last real token and its generated tokens stays masked out, so a
row computes exactly what it would compute alone. Rows that finish are dropped
from the fork (``batch_select_indices``), so later steps only run live rows.

It is the static path: a batch runs until its last row ends, and no row joins it. The engine loop
(:mod:`prefixcache.scheduler.engine_loop`), which every CLI command and the server go through, refills
finished rows at the next step instead; this path stays as the benchmarks' ``batched-static`` lane.

Full re-encoding is the same call with an empty prefix and whole prompts as
rows: the cached and uncached paths share every line of decoding.

A row finishes on an end-of-sequence token (not part of its text), when its
decoded text contains a stop string (the text is cut before it), or after
``max_new_tokens`` tokens.

Under a ``constraint`` (:mod:`prefixcache.engine.constraint`: a JSON Schema), each step's logits are masked
to the tokens the row's grammar allows before the token is picked (greedy or sampled; recorded log-probs
are then those of the masked distribution), and a row also finishes when its grammar is complete (``stop``;
``length`` when the budget closed it early). Without one, nothing here changes.

This module knows nothing about tasks or records: only token ids, text and (through the constraint) schemas.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Sequence

import torch

from .constraint import ConstrainedRows, JsonConstraint
from .copy_constraint import CopyConstraint
from .detokenize import IncrementalText
from .rows import forward_rows, pad_rows
from .sampling import GREEDY, Sampling, TokenLogprob, TokenPicker
from ..cache.kv import PrefixKV

Finish = Literal["eos", "stop", "length"]


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode. ``eos_ids``: token ids that end a row (see :func:`eos_ids_of`)."""

    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass(frozen=True)
class Decoding:
    """How a row decodes: its budget, stop strings and end-of-sequence ids (``config``), how each token is picked
    (``sampling``: greedy unless it says otherwise), and the grammar its tokens follow (``constraint``: a schema,
    or one with copy fields bound to each row's source; None decodes freely)."""

    config: GenerationConfig
    sampling: Sampling = GREEDY
    constraint: JsonConstraint | CopyConstraint | None = None


@dataclass(frozen=True)
class Generation:
    """One row's output.

    Attributes:
        token_ids: every generated token, including the end-of-sequence token that ended it.
        text: the decoded text without end-of-sequence / special tokens, cut before the first stop string.
        finish: why it ended.
        logprobs: one per generated token when the sampling recorded log-probs, else empty.
        state: ``[H]``, the final layer's (normed) state at the row's last prompt token, from the prefill: what a
            fitted head with feature ``last`` reads, at no extra pass (None where a caller built it otherwise).
    """

    token_ids: tuple[int, ...]
    text: str
    finish: Finish
    logprobs: tuple[TokenLogprob, ...] = ()
    state: torch.Tensor | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class GenerationTiming:
    """Timing of one :func:`generate_rows` call.

    ``first_token_s``: from the call to the first generated token of every row (the prefill).
    ``steps``: forward passes (1 prefill + decode steps). ``tokens``: generated tokens over all rows.
    """

    first_token_s: float
    seconds: float
    steps: int
    tokens: int


def eos_ids_of(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    """End-of-sequence ids: the tokenizer's eos token, the model's generation config eos (int or list), and
    the ``generation_config.json`` eos ids a :class:`~prefixcache.task.tokenizer.LeanTokenizer` read (for a
    model that carries no generation config of its own)."""
    ids: set[int] = set(getattr(tokenizer, "generation_eos_ids", ()))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    return frozenset(ids)


def finish_of(
    tokenizer, token_ids: Sequence[int], config: GenerationConfig, grammar: Finish | None = None
) -> tuple[str, Finish | None]:
    """The text of a row's generated tokens so far and whether it is finished (``None``: not yet).

    ``token_ids`` is everything generated; an end-of-sequence token can only be the last one. ``grammar``:
    the row's constraint is complete (``"stop"``), or complete because its token budget closed it (``"length"``).
    """
    ended = bool(token_ids) and token_ids[-1] in config.eos_ids
    body = token_ids[:-1] if ended else token_ids
    text = tokenizer.decode(list(body), skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in config.stop) if i >= 0]
    if cuts:
        return text[: min(cuts)], "stop"
    if grammar == "length" or (grammar is not None and not ended):
        return text, grammar
    if ended:
        return text, "eos"
    if len(token_ids) >= config.max_new_tokens:
        return text, "length"
    return text, None


def _logits(model: torch.nn.Module, hidden: torch.Tensor, rules: ConstrainedRows | None, live: list[int]) -> torch.Tensor:
    """hidden ``[b, H]`` -> next-token logits ``[b, V]`` through the model's output head, masked by ``rules``
    (for input rows ``live``) when there are rules."""
    logits = model.get_output_embeddings()(hidden)
    return logits if rules is None else rules.mask_(logits, live)


@torch.inference_mode()
def generate_rows(
    model: torch.nn.Module,
    tokenizer,
    prefix: PrefixKV,
    rows: Sequence[Sequence[int]],
    decoding: Decoding,
    on_token: Callable[[int, int], None] | None = None,
) -> tuple[list[Generation], GenerationTiming]:
    """Decode a continuation of ``prefix + row`` for every row, as ``decoding`` says (greedy unless its sampling
    says otherwise; under its constraint when it has one: a copy constraint binds one source per row). In ``rows``
    order.

    ``on_token(row, token_id)`` is called for every generated token as soon as it is chosen (on the
    calling thread), so a caller can stream. The prefix is only read (each call uses its own fork),
    so concurrent calls are safe.

    Raises:
        ConstraintError: ``constraint`` cannot be applied with this tokenizer.
    """
    started = time.perf_counter()
    device = prefix.keys[0].device
    batch = len(rows)
    config, constraint = decoding.config, decoding.constraint
    picker = TokenPicker(decoding.sampling, batch, device)
    rules = None if constraint is None else constraint.start(tokenizer, batch, config.eos_ids, config.max_new_tokens)
    ids, mask, lengths = pad_rows(rows, device)  # [B, S], [B, S], [B]
    cache = prefix.fork(batch)
    past = torch.ones(batch, prefix.length, dtype=torch.bool, device=device)  # [B, P]
    start = torch.full((batch,), prefix.length, device=device)
    hidden = forward_rows(model, cache, ids, mask, start, past)  # [B, S, H]
    last = hidden[torch.arange(batch, device=device), lengths - 1]  # [B, H]
    live = list(range(batch))  # cache row -> input row
    next_ids, logprobs = picker.pick(_logits(model, last, rules, live), live)  # [B]
    first_token_s = time.perf_counter() - started

    attention = torch.cat([past, mask], dim=1)  # [B, P + S]: what each row's next token may see
    positions = lengths + prefix.length  # [B]: RoPE index of each row's next token
    rows_out = [RowOutput(tokenizer) for _ in rows]
    steps = 1
    while True:
        keep = [slot for slot, row in enumerate(live) if not rows_out[row].add(
            next_ids[slot].item(), logprobs[slot] if logprobs else None, tokenizer, config, on_token, row, rules)]
        if not keep:
            break
        if len(keep) < len(live):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            attention, positions, next_ids = attention[index], positions[index], next_ids[index]
            live = [live[k] for k in keep]
        step_mask = torch.ones(len(live), 1, dtype=torch.bool, device=device)  # [b, 1]
        hidden = forward_rows(model, cache, next_ids[:, None], step_mask, positions, attention)  # [b, 1, H]
        next_ids, logprobs = picker.pick(_logits(model, hidden[:, -1], rules, live), live)  # [b]
        attention = torch.cat([attention, step_mask], dim=1)
        positions = positions + 1
        steps += 1
    results = [replace(out.generation, state=last[row]) for row, out in enumerate(rows_out)]
    tokens = sum(len(g.token_ids) for g in results)
    return results, GenerationTiming(first_token_s, time.perf_counter() - started, steps, tokens)


class RowOutput:
    """One row's tokens so far; ``generation`` is set once the row has finished.

    The stop strings are looked for in the text the new token completes (:class:`IncrementalText`), so a
    step costs the same at the 500th token as at the first; the whole output is decoded once, when the row
    finishes (:func:`finish_of` then says how, exactly as before).
    """

    def __init__(self, tokenizer):
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.text = IncrementalText(tokenizer)
        self.generation: Generation | None = None

    def add(self, token: int, logprob: TokenLogprob | None, tokenizer, config: GenerationConfig, on_token, row: int,
            rules: ConstrainedRows | None) -> bool:
        """Append ``token`` (and advance the row's grammar by it); True when the row has finished with it."""
        self.token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if on_token is not None:
            on_token(row, token)
        grammar = None if rules is None else rules.accept(row, token)
        ended = token in config.eos_ids
        # stop strings are looked for only when there are some: no incremental decoding otherwise
        stopped = bool(config.stop) and not ended and self.text.ends_with_any(config.stop, self.text.add(token))
        if not (ended or stopped or grammar is not None or len(self.token_ids) >= config.max_new_tokens):
            return False
        text, finish = finish_of(tokenizer, self.token_ids, config, grammar)
        if finish is not None:
            self.generation = Generation(tuple(self.token_ids), text, finish, tuple(self.logprobs))
        return finish is not None
