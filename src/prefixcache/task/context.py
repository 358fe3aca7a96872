"""Fitting records to the model: the context-window policy, and flags for blank text.

A record's prompt (the prefix, the record's suffix, and for ``full`` scoring
the label tokens fed after it) must fit the model's context window, read from
its config (``max_position_embeddings``). Past it a RoPE model returns numbers
it was never trained for and an absolute-position model crashes, so a record
that does not fit is never run as it is. The policies (:data:`OVERFLOW`):

* ``error``: the record fails with a message naming it, its longest field, the
  tokens it needs and the model's context;
* ``truncate``: that field is cut, in characters, to the longest start that
  fits; the prompt is re-rendered and re-tokenized, and the record is flagged.
  The cut happens to the text before tokenization, so full re-encoding and the
  cached path see the same shortened record (invariants 1 and 3 still hold).

This module knows nothing about caches, batches or files: only prompts, token
counts and record fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..errors import ContextOverflowError, InputError, setting
from ..types import OVERFLOW
from .prompt import Encoded, Prompt

FIRST_PROBE_CHARS_PER_TOKEN = 8  # the first cut tried is this many characters per context token




def label_overhang(prompt: Prompt, method: str) -> int:
    """Positions used after the record while scoring: the longest label's tokens but one for ``full``, else 0."""
    if method != "full":
        return 0
    return max(len(ids) for ids in prompt.label_ids.values()) - 1


def blank_warning(fields: Mapping[str, object], names: list[str]) -> str | None:
    """A note for the record's output line when a template field is empty or only whitespace, else None."""
    for name in names:
        value = fields.get(name)
        if isinstance(value, str) and not value.strip():
            return f"field {name!r} is empty or only whitespace; the label is the model's guess without it"
    return None


@dataclass(frozen=True)
class Fitted:
    """A record shortened to fit: its tokens and the note for its output line."""

    encoded: Encoded
    warning: str


class ContextFit:
    """Checks records against the model's context and applies the overflow policy.

    ``limit`` None (the config does not say) means every record fits.
    """

    def __init__(self, prompt: Prompt, tokenizer, limit: int | None, overhang: int):
        self.prompt = prompt
        self.tokenizer = tokenizer
        self.limit = limit
        self.overhang = overhang

    def overflows(self, encoded: Encoded) -> bool:
        """True when feeding ``encoded`` (plus the label overhang) needs more positions than the model has."""
        return self.limit is not None and self.needed(encoded) > self.limit

    def needed(self, encoded: Encoded) -> int:
        return len(encoded.full_ids) + self.overhang

    def fit(self, fields: Mapping[str, object], record_id: object, encoded: Encoded, policy: str) -> Fitted:
        """Apply ``policy`` to a record that :meth:`overflows`.

        Raises:
            ContextOverflowError: under ``error``. InputError: under ``truncate``, when not even one
                character of the field fits (the task's prefix leaves no room). Both name the record and the field.
        """
        if policy not in OVERFLOW:
            raise ValueError(f"overflow policy must be one of {OVERFLOW}, not {policy!r}")
        name = max(self.prompt.task.fields, key=lambda f: len(str(fields[f])))
        if policy == "error":
            raise ContextOverflowError(
                f"record {record_id!r}: field {name!r} is too long: the prompt needs {self.needed(encoded)} tokens "
                f"but the model's context is {self.limit}; shorten it, or have it cut to fit "
                f"({setting('overflow', 'truncate')})"
            )
        text = str(fields[name])
        keep, fitted = self._longest_start(fields, record_id, name, text)
        if keep == 0:
            raise InputError(
                f"record {record_id!r}: field {name!r} cannot fit: the task's prompt alone fills the model's "
                f"context of {self.limit} tokens; use a shorter task or a model with a longer context"
            )
        return Fitted(fitted, f"field {name!r} truncated from {len(text)} to {keep} characters to fit the model's "
                              f"context of {self.limit} tokens")

    def _longest_start(self, fields, record_id, name: str, text: str) -> tuple[int, Encoded]:
        """The largest k (found by bisection) such that ``text[:k]`` fits, with its tokens. k may be 0.

        Invariant: ``text[:lo]`` fits (checked) and ``text[:hi]`` does not. Token counts are
        monotone in k up to merges at the cut, so k is the longest fitting start within a token.
        """
        lo, hi = 0, len(text)
        best = self._encode(fields, record_id, name, "")
        if self.overflows(best):
            return 0, best
        probe = min(FIRST_PROBE_CHARS_PER_TOKEN * self.limit, (lo + hi) // 2)
        while hi - lo > 1:
            encoded = self._encode(fields, record_id, name, text[:probe])
            if self.overflows(encoded):
                hi = probe
            else:
                lo, best = probe, encoded
            probe = (lo + hi) // 2
        return lo, best

    def _encode(self, fields, record_id, name: str, text: str) -> Encoded:
        trial = {**fields, name: text}
        return self.prompt.encode(self.tokenizer, [self.prompt.suffix_text(trial, record_id)])[0]
