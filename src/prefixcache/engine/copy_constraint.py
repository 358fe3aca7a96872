"""Copy fields: while a field declared ``copy`` is decoded, only spans of the row's own source text may be written.

A :class:`CopyConstraint` is a JSON answer schema (:class:`~prefixcache.engine.constraint.JsonConstraint`)
plus the names of its copy fields and, per row, the text those fields may copy from (the record's own
text). :class:`CopyRows` is its per-call state: it masks each row's logits exactly as
:class:`~prefixcache.engine.constraint.ConstrainedRows` does (the schema), then intersects that mask with
what copying allows:

* inside a copy field's string, with content ``c`` so far (bytes): a token may follow when ``c + token``
  is a substring of the source (all its occurrences are followed, as the end positions of ``c``), or when the
  token closes the string (its bytes start with ``"``); the first token of a value may not begin with
  whitespace, and no token may leave the value in the middle of a UTF-8 character;
* elsewhere, a token the schema allows that contains a ``"`` is simulated on a copy of the row's
  :class:`~prefixcache.engine.json_cursor.JsonCursor`: one that would open a copy field's string with content
  that is not a span (``"INV``), or close one that is not, is masked. A copy field's ``null`` stays allowed.

Any tokenization of a span is reachable: a row's *position table* lists, for every byte offset of its source,
every vocabulary token whose bytes match there (leading-space tokens, a word split any way, case as
written), so the model is not held to the record's own tokenization. Tokens holding ``"``, ``\\`` or control
bytes never enter a span, so a copied value needs no JSON escapes and its decoded string is exactly the
source's bytes: every copied value is a substring of its source, or null (``tests/test_copy_constraint.py``
checks this on random texts and a tiny model).

Cost: the vocabulary's token bytes are read once per tokenizer (:func:`token_table`); a row's position table
is built the first time the row enters a copy field (about ``len(source) x longest token`` dictionary
look-ups); a step inside a span takes the union of the table at the span's end positions.

This module knows nothing about tasks or records: only token bytes, source texts and logits.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .constraint import ConstrainedRows, JsonConstraint, grammar_tokenizer
from .json_cursor import BLANK, QUOTE, JsonCursor

_FORBIDDEN = frozenset(range(0x20)) | {QUOTE, ord("\\")}  # bytes a span never holds (they need JSON escapes)
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TokenTable:
    """A vocabulary as bytes: ``by_bytes`` maps a span-safe token's bytes to its ids; ``quoted`` lists every token
    holding a ``"`` (those the cursor simulates); ``token_bytes[i]`` is token i's bytes (b"" for special tokens)."""

    token_bytes: tuple[bytes, ...]
    by_bytes: dict[bytes, tuple[int, ...]]
    quoted: torch.Tensor  # [V] bool
    longest: int


def token_table(tokenizer, eos_ids: frozenset[int]) -> TokenTable:
    """The :class:`TokenTable` of ``tokenizer`` (built once per tokenizer, in about a second for 50k tokens)."""
    kept = _TABLES.get(tokenizer)
    if kept is None:
        kept = _TABLES[tokenizer] = _build_table(grammar_tokenizer(tokenizer, eos_ids))
    return kept


def _build_table(lltok) -> TokenTable:
    vocab = lltok.vocab_size
    data = tuple(b"" if lltok.is_special_token(t) else lltok.decode_bytes([t]) for t in range(vocab))
    by_bytes: dict[bytes, list[int]] = {}
    for token, raw in enumerate(data):
        if raw and not _FORBIDDEN.intersection(raw):
            by_bytes.setdefault(raw, []).append(token)
    quoted = torch.tensor([QUOTE in raw for raw in data], dtype=torch.bool)
    longest = max((len(raw) for raw in by_bytes), default=1)
    return TokenTable(data, {k: tuple(v) for k, v in by_bytes.items()}, quoted, longest)


@dataclass(frozen=True)
class CopyConstraint:
    """The answer schema ``json``, with ``fields`` copied from ``sources[row]`` (one text per row of the call)."""

    json: JsonConstraint
    fields: tuple[str, ...]
    sources: tuple[str, ...] = field(repr=False)

    def start(self, tokenizer, batch: int, eos_ids: frozenset[int], max_new_tokens: int) -> CopyRows:
        """The per-call state for ``batch`` rows (``batch == len(sources)``)."""
        if batch != len(self.sources):
            raise ValueError(f"a copy constraint over {len(self.sources)} sources was started for {batch} rows")
        return CopyRows(self, tokenizer, eos_ids, max_new_tokens)


class SourceSpans:
    """One row's source as bytes, and which tokens match at each byte offset."""

    def __init__(self, text: str, table: TokenTable):
        self.source = text.encode("utf-8")
        n, longest = len(self.source), table.longest
        self.at: list[tuple[int, ...]] = []
        for start in range(n + 1):
            ids: list[int] = []
            for end in range(start + 1, min(n, start + longest) + 1):
                ids += table.by_bytes.get(self.source[start:end], ())
            self.at.append(tuple(ids))
        self.opening = torch.tensor(sorted({t for p in range(n) for t in self.at[p]
                                            if table.token_bytes[t][0] not in BLANK
                                            and _whole_characters(table.token_bytes[t])}), dtype=torch.long)

    def ends(self, content: bytes) -> list[int]:
        """Every offset where an occurrence of ``content`` ends (content non-empty)."""
        ends, start = [], self.source.find(content)
        while start >= 0:
            ends.append(start + len(content))
            start = self.source.find(content, start + 1)
        return ends

    def allows(self, content: bytes) -> bool:
        """A value string with these bytes is a span (and does not begin with whitespace)."""
        return not content or (content in self.source and content[0] not in BLANK)


class CopyRows(ConstrainedRows):
    """The schema's rows (:class:`~prefixcache.engine.constraint.ConstrainedRows`) with copy fields held to spans.

    Contract: as the parent's (``mask_`` once per step, then ``accept`` each live row's token once).
    """

    def __init__(self, constraint: CopyConstraint, tokenizer, eos_ids: frozenset[int], max_new_tokens: int):
        super().__init__(constraint.json, tokenizer, len(constraint.sources), eos_ids, max_new_tokens)
        self._table = token_table(tokenizer, eos_ids)
        self._copied = frozenset(constraint.fields)
        self._texts = constraint.sources
        self._spans: dict[int, SourceSpans] = {}
        self._cursors = [JsonCursor() for _ in constraint.sources]
        self._quote_closers = torch.tensor([t for t, raw in enumerate(self._table.token_bytes) if raw[:1] == b'"'], dtype=torch.long)

    def mask_(self, logits: torch.Tensor, live: Sequence[int]) -> torch.Tensor:
        """The schema's mask (see the parent), then each row's copy mask (see the module notes)."""
        super().mask_(logits, live)
        for slot, row in enumerate(live):
            cursor = self._cursors[row]
            if cursor.value_string_of in self._copied:
                keep = self._inside_span(row, bytes(cursor.text))
            elif self._far_from_copy(cursor):
                continue
            else:
                keep = self._structural(row, logits[slot])
            if keep is not None:
                kept = logits[slot, keep].clone()
                logits[slot] = float("-inf")
                logits[slot, keep] = kept
        return logits

    def _far_from_copy(self, cursor: JsonCursor) -> bool:
        """No token from here can write into a copy field's value: inside another value (a string or a bare
        word), or between a value of another field and its end."""
        if (cursor.in_string and not cursor.is_key) or cursor.in_value:
            return True
        return not cursor.in_string and cursor.depth == 1 and not cursor.expect_key and cursor.key not in self._copied

    def accept(self, row: int, token: int) -> str | None:
        self._cursors[row].feed(self._table.token_bytes[token])
        return super().accept(row, token)

    def next_forced(self, row: int) -> int | None:
        """The schema's forced token (see the parent), unless it holds a ``"`` that would write a non-span copy value
        (then None: the row's next step masks, and the copy mask decides)."""
        token = super().next_forced(row)
        if token is not None and token < len(self._table.quoted) and self._table.quoted[token]:
            return token if self._token_copies(row, token) else None
        return token

    def _row_spans(self, row: int) -> SourceSpans:
        if row not in self._spans:
            self._spans[row] = SourceSpans(self._texts[row], self._table)
        return self._spans[row]

    def _inside_span(self, row: int, content: bytes) -> torch.Tensor:
        """Token ids that continue the span ``content`` or close it (``[k]``)."""
        spans = self._row_spans(row)
        if not content:
            return torch.cat([spans.opening, self._quote_closers])
        table = self._table.token_bytes
        ids = sorted({t for end in spans.ends(content) for t in spans.at[end] if _whole_characters(content + table[t])})
        return torch.cat([torch.tensor(ids, dtype=torch.long), self._quote_closers])

    def _structural(self, row: int, logits: torch.Tensor) -> torch.Tensor | None:
        """Outside any string: the allowed tokens minus quote tokens that would write a non-span copy value."""
        allowed = torch.isfinite(logits[: len(self._table.quoted)])
        risky = (allowed & self._table.quoted).nonzero()[:, 0].tolist()
        bad = [t for t in risky if not self._token_copies(row, t)]
        if not bad:
            return None
        allowed[bad] = False
        return allowed.nonzero()[:, 0]

    def _token_copies(self, row: int, token: int) -> bool:
        """Whether ``token`` fed to row ``row``'s cursor writes only spans into copy fields."""
        probe = self._cursors[row].copy()
        probe.feed(self._table.token_bytes[token])
        spans = self._row_spans(row)
        written = [text for key, text in probe.closed if key in self._copied]
        if probe.value_string_of in self._copied:
            written.append(bytes(probe.text))
        return all(spans.allows(text) and not _FORBIDDEN.intersection(text) for text in written)


def _whole_characters(content: bytes) -> bool:
    """Whether a copy value's bytes end on a character boundary. A value is never left in the middle of a UTF-8
    character: there the grammar may allow only a byte the source does not continue with (its closing path, when
    the token budget runs out, picks the first continuation byte it finds), and no token would be left."""
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
