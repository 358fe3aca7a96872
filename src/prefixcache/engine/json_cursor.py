"""Where in a flat JSON object a decoder is: byte by byte, which key's value (if any) it is writing.

A :class:`JsonCursor` follows the bytes of an object of scalar fields (what an extraction answer is) and
says whether it is inside a string that is a value, of which key, and that value's bytes so far. It does
not validate: the grammar (:mod:`prefixcache.engine.constraint`) already keeps the bytes valid JSON.
:func:`value_tokens` maps each field of a finished answer to the generated tokens that wrote its value
(for per-field confidence).

This module knows nothing about models, tasks or logits: only bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

QUOTE, BACKSLASH, COLON, COMMA = ord('"'), ord("\\"), ord(":"), ord(",")
OPENERS, CLOSERS, BLANK = frozenset(b"{["), frozenset(b"}]"), frozenset(b" \t\r\n")


@dataclass
class JsonCursor:
    """The position in an object of scalars after the bytes fed so far.

    Attributes:
        depth: nesting depth (1 inside the answer object).
        in_string / is_key: inside a string, and whether that string is a key.
        key: the key whose value comes (or is being written) after the last key string closed.
        text: the bytes of the string being written (escapes as written).
        in_value: inside a value (a string, or a bare word such as ``null``/a number) of ``key``.
        closed: the ``(key, bytes)`` of every value string closed so far (for a caller that checks them).
    """

    depth: int = 0
    in_string: bool = False
    is_key: bool = False
    escape: bool = False
    key: str | None = None
    text: bytearray = field(default_factory=bytearray)
    in_value: bool = False
    expect_key: bool = False
    closed: list = field(default_factory=list)

    def copy(self) -> JsonCursor:
        return JsonCursor(self.depth, self.in_string, self.is_key, self.escape, self.key, bytearray(self.text),
                          self.in_value, self.expect_key, [])

    def feed(self, data: bytes) -> None:
        for byte in data:
            self._byte(byte)

    @property
    def value_string_of(self) -> str | None:
        """The key whose value string is being written now, else None."""
        return self.key if self.in_string and not self.is_key and self.depth == 1 else None

    def _byte(self, byte: int) -> str | None:
        """Advance by one byte; the key whose value this byte is part of, else None."""
        if self.in_string:
            return self._string_byte(byte)
        if byte == QUOTE:
            self.in_string, self.is_key, self.escape = True, self.depth == 1 and self.expect_key, False
            self.text = bytearray()
            self.in_value = not self.is_key
        elif byte in OPENERS:
            self.depth += 1
            self.expect_key = byte == ord("{")
        elif byte in CLOSERS:
            self.depth, self.in_value = self.depth - 1, False
        elif byte == COMMA:
            self.expect_key, self.in_value = self.depth == 1, False
        elif byte == COLON:
            self.expect_key = False
        elif byte not in BLANK and self.depth == 1 and not self.expect_key:
            self.in_value = True  # a bare word: null, a number, true/false
        return self.key if self.in_value else None

    def _string_byte(self, byte: int) -> str | None:
        owner = None if self.is_key else self.key
        if self.escape:
            self.escape = False
        elif byte == BACKSLASH:
            self.escape = True
        elif byte == QUOTE:
            self.in_string = False
            if self.is_key:
                self.key = self.text.decode("utf-8", "replace")
            else:
                self.closed.append((self.key, bytes(self.text)))
                self.in_value = False
            return owner
        self.text.append(byte)
        return owner


def value_tokens(token_bytes: Sequence[bytes], names: Sequence[str]) -> dict[str, list[int]]:
    """For each of ``names``, the indices of the tokens (given as their bytes, in order) that wrote any byte of
    that key's value (its quotes included). A field whose value was never written maps to ``[]``."""
    out: dict[str, list[int]] = {name: [] for name in names}
    cursor = JsonCursor()
    for index, data in enumerate(token_bytes):
        touched = {cursor._byte(byte) for byte in data} - {None}
        for key in touched:
            if key in out:
                out[key].append(index)
    return out
