"""Schema-constrained decoding: a JSON Schema compiled to a grammar, and per row the tokens it allows next.

:func:`json_constraint` compiles a JSON Schema once (by llguidance; cached by the schema's text) into a
:class:`JsonConstraint`. It holds no tokenizer, so a request thread can compile and check a schema before
anything runs on the model thread. :class:`ConstrainedRows` holds one grammar matcher per row of a
:func:`~prefixcache.engine.generate.generate_rows` call: :meth:`~ConstrainedRows.mask_` sets every token the
grammar does not allow next to ``-inf`` (greedy and sampled picks then only see allowed tokens), and
:meth:`~ConstrainedRows.accept` advances a row's matcher by the token picked and says when its grammar is
complete. Bytes the grammar forces (keys, separators) are offered as their canonical tokens only.

Whitespace is not free: a value is written as ``json.dumps`` writes it (``", "`` and ``": "`` between items,
no other whitespace), unless the schema's own ``x-guidance`` options say otherwise. A small model left free
to add whitespace may add it until its token budget runs out.

Closing within the budget (``close_within_budget``): a row that nears ``max_new_tokens`` is closed rather
than cut. A *closing path* completes a row's grammar from where it is: forced bytes, else the first allowed
of ``"``, ``}``, ``]``, ``null``, ``0``, ``false``, else the lowest allowed token (probed on a copy of the
row's matcher). Its length is measured from the start once per call, then every :data:`REFRESH` tokens of
a row, and at every token once fewer than that length plus :data:`WATCH` tokens are left; once the path needs all but :data:`SLACK` of the tokens
left, the row follows it. So a row whose model would have run out of tokens mid-value ends with a shorter
value instead, and its output parses; such a row finishes ``"length"``. Rows that end well before their
budget are never touched. For an object of scalar fields (what an extraction task derives) one free token
never lengthens the closing path by more than :data:`SLACK` tokens, so the output always parses when
``max_new_tokens`` leaves room for the shortest answer; for deeper schemas the closing is a best effort.

Vocabulary sizes: logits past the tokenizer's vocabulary (a model head padded to a multiple of 64, say) are
always masked out.

This module knows nothing about prefixes, forward passes, tasks or HTTP: only schemas, token ids and logits.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from ..errors import ConstraintError

if TYPE_CHECKING:  # annotations only: llguidance itself loads where a grammar is built
    import llguidance

DEFAULT_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # json.dumps' layout
ANY_OBJECT: dict = {"type": "object"}  # OpenAI's ``json_object``: any JSON object
CLOSERS = ('"', "}", "]", "null", "0", "false")  # what a closing path tries, in order (first tokens of each)
SLACK = 4  # the most one free token can lengthen the closing path of an object of scalar fields (an escape, UTF-8)
REFRESH = 8  # a row's closing path is measured every this many tokens
WATCH = 2 * SLACK  # ... and at every token once fewer than its last length plus this many are left
_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit i of a 32-bit mask word is token 32 * word + i


@dataclass(frozen=True)
class JsonConstraint:
    """A JSON Schema compiled for decoding; equal (and hashed) by the schema's text and the closing rule.

    Attributes:
        schema_text: the schema as compact JSON text (its key order kept: it is the order of generated properties).
        grammar: the llguidance grammar compiled from it (tokenizer-free).
        close_within_budget: close a row that nears its token budget rather than cut it (see the module notes).
    """

    schema_text: str
    grammar: str = field(repr=False, compare=False)
    close_within_budget: bool = True

    def start(self, tokenizer, batch: int, eos_ids: frozenset[int], max_new_tokens: int) -> ConstrainedRows:
        """The per-call grammar state of ``batch`` rows (see :class:`ConstrainedRows`); a constraint that binds
        more than a schema (:class:`~prefixcache.engine.copy_constraint.CopyConstraint`) has its own ``start``."""
        return ConstrainedRows(self, tokenizer, batch, eos_ids, max_new_tokens)


def json_constraint(schema: dict | bool, close_within_budget: bool = True) -> JsonConstraint:
    """Compile ``schema`` (a JSON Schema object, or ``True`` for any JSON value). Cached by the schema's text.

    Raises:
        ConstraintError: the schema is not valid JSON Schema, is unsatisfiable, or uses a keyword the grammar
            engine does not implement; the message says which.
    """
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConstraintError(f"the JSON Schema cannot be written as JSON: {exc}") from None
    return _compile(text, close_within_budget)


@functools.lru_cache(maxsize=256)
def _compile(text: str, close_within_budget: bool) -> JsonConstraint:
    import llguidance  # here, not at the top: a command that never constrains decoding does not load it

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=DEFAULT_LAYOUT)
    except ValueError as exc:
        raise ConstraintError(f"the JSON Schema is not a JSON object or boolean: {exc}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise ConstraintError(f"the JSON Schema cannot constrain decoding: {messages[0]}")
    return JsonConstraint(text, grammar, close_within_budget)


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {eos ids: LLTokenizer}
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer, eos_ids: frozenset[int]) -> llguidance.LLTokenizer:
    """The grammar engine's view of ``tokenizer`` with ``eos_ids`` as its end tokens; built once (about a
    second for a 50k vocabulary) and kept while ``tokenizer`` lives. Thread-safe.

    The grammar engine reads the tokenizer's ``tokenizers`` serialization (``backend_tokenizer``: a
    transformers fast tokenizer's or :class:`~prefixcache.task.tokenizer.LeanTokenizer`'s), as
    ``llguidance.hf.from_tokenizer`` does, without importing transformers.

    Raises:
        ConstraintError: ``tokenizer`` has no ``tokenizers`` backend (a slow, Python-only tokenizer), or one
            the grammar engine cannot read.
    """
    key = tuple(sorted(eos_ids)) or None
    with _TOKENIZERS_LOCK:
        kept = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in kept:
            kept[key] = _grammar_view(tokenizer, list(key) if key else getattr(tokenizer, "eos_token_id", None))
        return kept[key]


def _grammar_view(tokenizer, eos) -> llguidance.LLTokenizer:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConstraintError("decoding can only be constrained with a fast tokenizer (one with a tokenizers backend)")
    backend = copy.copy(backend)  # the copy serializes without padding or truncation; the tokenizer keeps its own
    backend.no_padding()
    backend.no_truncation()
    import llguidance

    try:
        return llguidance.LLTokenizer(backend.to_str(), eos_token=eos)
    except ValueError as exc:  # a pipeline the grammar engine cannot invert (a WordPiece decoder, say)
        raise ConstraintError(f"decoding cannot be constrained with this tokenizer: {exc}") from None


class ConstrainedRows:
    """The grammar state of every row of one decoding call (rows are numbered as the call's input rows).

    Contract: for each step, call :meth:`mask_` once with the live rows' logits, pick the tokens, then
    :meth:`accept` each live row's token once. Not thread-safe; one instance per call.

    Raises (on construction):
        ConstraintError: the tokenizer cannot be constrained, or the grammar does not compile for it.
    """

    def __init__(self, constraint: JsonConstraint, tokenizer, batch: int, eos_ids: frozenset[int], max_new_tokens: int):
        import llguidance

        self._tokenizer = grammar_tokenizer(tokenizer, eos_ids)
        start = llguidance.LLMatcher(self._tokenizer, constraint.grammar, log_level=0)
        if start.is_error():
            raise ConstraintError(f"the JSON Schema does not compile for this tokenizer: {start.get_error()}")
        self._matchers = [start.deep_copy() for _ in range(batch)]
        self._vocab = self._tokenizer.vocab_size
        self._bits = torch.empty(batch, (self._vocab + 31) // 32, dtype=torch.int32)  # [B, W]: one bit per token
        self._eos = min(eos_ids) if eos_ids else None
        self._closers = [ids[0] for ids in (self._tokenizer.tokenize_str(text) for text in CLOSERS) if ids]
        self._generated = [0] * batch
        self._closing = [False] * batch  # rows following their closing path
        self._budget = max_new_tokens if constraint.close_within_budget else None
        shortest = self._closing_path(start.deep_copy(), max_new_tokens) if self._budget else []
        self._closing_length = [max_new_tokens if shortest is None else len(shortest)] * batch  # as last measured
        self._measured_at = [0] * batch  # tokens the row had generated when its closing path was last measured
        self.shortest = shortest  # the shortest complete answer's tokens (None: none within the budget; [] unmeasured)

    def check_answerable(self) -> None:
        """Raise ConstraintError when no answer of at least one token but the end token fits the budget: the
        grammar admits no finite value (a required recursion), or only the empty text (which is no JSON).
        Needs ``close_within_budget`` (else nothing was measured and nothing is checked)."""
        if self._budget is None:
            return
        if self.shortest is None:
            raise ConstraintError(f"the JSON Schema admits no value of at most {self._budget} tokens (a required "
                                  "recursion has none at all)")
        if not [token for token in self.shortest if token != self._eos]:
            raise ConstraintError("the JSON Schema admits only the empty text, which is not JSON")

    def mask_(self, logits: torch.Tensor, live: Sequence[int]) -> torch.Tensor:
        """Set the logits ``[b, V]`` of tokens that row ``live[i]`` may not generate next to ``-inf``, in place;
        returns ``logits``. Tokens ``>=`` the tokenizer's vocabulary are always masked.

        Raises:
            ConstraintError: a row's matcher failed (it cannot happen when only masked picks are accepted).
        """
        b = len(live)
        forced: dict[int, int] = {}
        for slot, row in enumerate(live):
            matcher = self._matchers[row]
            if matcher.is_error():
                raise ConstraintError(f"the grammar matcher of row {row} failed: {matcher.get_error()}")
            token = self._forced(row)
            if token is None:
                bits = self._bits[slot]
                matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * bits.element_size())
            else:
                forced[slot] = token
        allowed = ((self._bits[:b, :, None] >> _SHIFTS) & 1).view(b, -1).bool()  # [b, 32 * W]
        for slot, token in forced.items():
            allowed[slot] = False
            allowed[slot, token] = True
        known = min(logits.shape[-1], self._vocab)
        logits[:, :known].masked_fill_(~allowed[:, :known].to(logits.device), float("-inf"))
        logits[:, known:] = float("-inf")
        return logits

    def accept(self, row: int, token: int) -> str | None:
        """Advance row ``row``'s grammar by ``token``. Returns ``"stop"`` when its grammar is now complete,
        ``"length"`` when it is complete because the budget closed it, else ``None``.

        Raises:
            ConstraintError: the grammar does not allow ``token`` (it was not picked from masked logits).
        """
        matcher = self._matchers[row]
        if not matcher.consume_token(token):
            raise ConstraintError(f"the grammar of row {row} does not allow token {token}: {matcher.get_error()}")
        self._generated[row] += 1
        if not matcher.is_stopped():
            return None
        return "length" if self._closing[row] else "stop"

    def next_forced(self, row: int) -> int | None:
        """The token the grammar alone decides for ``row`` next, or None: the model must be asked.

        That is the next canonical token of the bytes the grammar forces (keys, separators, the rest of an enum
        value), or the end token once the grammar is complete and allows nothing else. Masked decoding would pick
        exactly this token (it is the only one allowed), so a caller may append it without a forward pass and feed
        it with the row's next tokens (a sampling row then draws only for the tokens it picks). None while the row
        follows its closing path or has one token of budget left (those stay with :meth:`mask_`). Call
        :meth:`accept` with it before asking again.
        """
        if self._closing[row] or (self._budget is not None and self._generated[row] >= self._budget - 1):
            return None
        matcher = self._matchers[row]
        if matcher.is_stopped() or matcher.is_error():
            return None
        forced = matcher.compute_ff_tokens()
        if forced:
            return forced[0]
        if self._eos is None or not matcher.is_accepting():
            return None
        return self._eos if self._allowed(matcher).tolist() == [self._eos] else None

    def _allowed(self, matcher: llguidance.LLMatcher) -> torch.Tensor:
        """The token ids ``matcher`` allows next, ascending ``[n]`` (its mask computed into a buffer of its own)."""
        bits = torch.empty(1, self._bits.shape[1], dtype=torch.int32)  # [1, W]
        matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * bits.element_size())
        return ((bits[:, :, None] >> _SHIFTS) & 1).view(-1)[: self._vocab].nonzero()[:, 0]

    def _forced(self, row: int) -> int | None:
        """The token the budget forces on ``row`` now (the next of its closing path), or None: the model picks."""
        if self._budget is None:
            return None
        generated = self._generated[row]
        left = self._budget - generated  # tokens the row may still generate, this one included
        due = generated - self._measured_at[row] >= REFRESH or left <= self._closing_length[row] + WATCH
        if not (due or self._closing[row]):
            return None
        path = self._closing_path(self._matchers[row].deep_copy(), left)
        self._closing_length[row], self._measured_at[row] = left if path is None else len(path), generated
        if not path or not (self._closing[row] or len(path) >= left - SLACK):
            return None
        self._closing[row] = True
        return path[0]

    def _closing_path(self, probe: llguidance.LLMatcher, limit: int) -> list[int] | None:
        """The tokens that complete ``probe``'s grammar (ending with an end token when one is still needed),
        or None when there are more than ``limit`` or the path is stuck. Advances ``probe``."""
        path: list[int] = []
        while not probe.is_stopped():
            if probe.is_accepting():  # complete once an end token is generated (none configured: complete now)
                return path if self._eos is None else path + [self._eos] if len(path) < limit else None
            token = self._closing_token(probe)
            if len(path) >= limit or token is None or not probe.consume_token(token):
                return None
            path.append(token)
        return path

    def _closing_token(self, probe: llguidance.LLMatcher) -> int | None:
        forced = probe.compute_ff_tokens()
        if forced:
            return forced[0]
        for token in self._closers:
            if probe.validate_tokens([token]) == 1:
                return token
        allowed = self._allowed(probe)  # [n]
        return int(allowed[0]) if len(allowed) else None
