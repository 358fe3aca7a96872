"""What an extraction keeps of each field: choice fields through their fitted heads, a confidence per field, and
fields left null and flagged when their confidence is under the field's threshold.

A :class:`FieldPolicy` turns one record's parsed answer and its :class:`~prefixcache.engine.generate.Generation`
into :class:`JudgedFields`:

* confidence of a generated value: the probability of the tokens that wrote it (its quotes included; ``null``
  is a value too), each under the decoding's masked distribution, so a copy field's confidence is its span's
  probability among the spans it could copy, and a choice field's is the probability of its value among the
  values;
* a ``choice`` field with a fitted head (``extract --head FIELD=FILE``): the head's best value over the hidden
  state at the record's last token, from the same prefill that fed the generation, and its probability as the
  confidence (the head's softmax, uncalibrated: no temperature is fitted);
* a copy field's empty string becomes null (an empty span copies nothing);
* a ``copy`` field with a fitted presence head (``fit --field`` on a copy field: absent / present): where the head
  says absent the field is null, with the head's probability as its confidence; where it says present the copied
  span stays, its confidence the head's probability times the span's;
* a field whose confidence is under ``min_confidence[field]`` is set to null and named in ``flagged``, for a
  person to review.

This module knows nothing about files or batches: only a task's fields, heads and one generation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from ..engine.generate import Generation
from ..engine.head import FittedHead
from ..engine.json_cursor import value_tokens
from ..errors import InputError, setting
from .field_features import PRESENCE
from ..task.definition import ExtractTask


@dataclass(frozen=True)
class JudgedFields:
    """One record's fields after the policy, the confidence of each (None where none was recorded), and the
    fields set to null for being under their threshold."""

    fields: dict | None
    confidence: dict[str, float | None]
    flagged: tuple[str, ...] = ()


@dataclass(frozen=True)
class FieldPolicy:
    """Heads of choice fields and per-field thresholds of an extraction ``task``.

    Raises (on construction):
        InputError: a head for a field that is not a choice field, whose labels are not the field's values, or
            that reads other features than ``last``; a threshold for an undeclared field or outside [0, 1].
    """

    task: ExtractTask
    heads: Mapping[str, FittedHead] = field(default_factory=dict)
    min_confidence: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        for name, head in self.heads.items():
            decl = self.task.fields.get(name)
            if decl is None or decl.kind not in ("choice", "copy"):
                raise InputError(f"{setting('head', name + '=...')}: {name!r} is not a choice or copy field of task {self.task.name!r}")
            wanted = set(decl.values or ()) if decl.kind == "choice" else set(PRESENCE)
            if set(head.labels) != wanted:
                raise InputError(f"{setting('head', name + '=...')}: the head's labels {list(head.labels)} are not "
                                 f"{sorted(wanted)}; fit it with `prefixcache fit` and {setting('field', name)}")
            if head.feature != "last":
                raise InputError(f"{setting('head', name + '=...')}: a field head reads feature 'last' (the prefill's "
                                 f"state), this one reads {head.feature!r}; fit it with {setting('feature', 'last')}")
        for name, threshold in self.min_confidence.items():
            if name not in self.task.fields or not 0.0 <= threshold <= 1.0:
                raise InputError(f"{setting('min_confidence', f'{name}={threshold}')}: name a declared field "
                                 f"({', '.join(self.task.fields)}) and a probability in [0, 1]")

    def judge(self, fields: dict | None, generation: Generation, token_bytes: Sequence[bytes] | None) -> JudgedFields:
        """``fields`` (parsed from ``generation``; None when nothing parsed) under this policy. ``token_bytes``: the
        vocabulary's tokens as bytes (None: generated values get no confidence)."""
        names = list(self.task.fields)
        confidence = generated_confidence(generation, token_bytes, names)
        if fields is None:
            return JudgedFields(None, confidence)
        fields = dict(fields)
        for name in self.task.names_of_kind("copy"):
            if fields.get(name) == "":
                fields[name] = None
        for name, head in self.heads.items():
            if generation.state is None:
                continue
            value, probability = head_choice(head, generation.state)
            if self.task.kind_of(name) == "choice":
                fields[name], confidence[name] = value, probability
            elif value == PRESENCE[0]:  # a copy field the head says the record does not hold
                fields[name], confidence[name] = None, probability
            elif fields.get(name) is not None:
                confidence[name] = probability * (confidence.get(name) or 0.0)
        flagged = tuple(n for n, t in self.min_confidence.items() if n in fields and (confidence.get(n) or 0.0) < t)
        for name in flagged:
            fields[name] = None
        return JudgedFields(fields, confidence, flagged)


def generated_confidence(generation: Generation, token_bytes: Sequence[bytes] | None, names: Sequence[str]) -> dict:
    """Per field, the probability of the generated tokens that wrote its value (None without recorded log-probs
    or ``token_bytes``, or for a field never written)."""
    if not generation.logprobs or token_bytes is None:
        return {name: None for name in names}
    spans = value_tokens([token_bytes[t] for t in generation.token_ids], names)
    logprobs = [lp.logprob for lp in generation.logprobs]
    return {name: (math.exp(sum(logprobs[i] for i in spans[name])) if spans[name] else None) for name in names}


def head_choice(head: FittedHead, state: torch.Tensor) -> tuple[str, float]:
    """A choice field's value by its head over ``state`` ``[H]``, and the head's probability of it."""
    logprobs = head.log_probs(state[None].float())[0]  # [L]
    best = int(logprobs.argmax())
    return head.labels[best], float(logprobs[best].exp())
