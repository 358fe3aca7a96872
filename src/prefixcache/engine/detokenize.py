"""Incremental detokenization: the text of a growing token sequence at a cost per token, not per sequence.

Decoding the whole output again after every token (what a naive stop-string check does) costs
O(n) per token and O(n²) per row. :class:`IncrementalText` hands each new token to the tokenizer
library's own streaming decoder (``tokenizers.decoders.DecodeStream``), which keeps a few tokens of
context and returns only the text they complete. Its text after any token equals
``tokenizer.decode(ids, skip_special_tokens=True)`` with an incomplete trailing character held back
(the streaming decoder returns nothing until a multi-byte character is whole); the tests check this.

A tokenizer without a fast backend (no ``backend_tokenizer``) falls back to decoding the whole
sequence on each token: the same text, at the old cost.
"""

from __future__ import annotations


class IncrementalText:
    """The decoded text of the tokens added so far (special tokens skipped).

    ``text`` grows by what :meth:`add` returns; it never changes what it already holds.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = _stream() if self._backend is not None else None
        self._ids: list[int] = []  # only kept by the fallback
        self.text = ""

    def add(self, token: int) -> str:
        """Append ``token``; return the text it completes ("" when it completes none yet)."""
        if self._stream is not None:
            piece = self._stream.step(self._backend, int(token)) or ""
        else:
            self._ids.append(int(token))
            whole = self._tokenizer.decode(self._ids, skip_special_tokens=True).rstrip("\ufffd")
            piece = whole[len(self.text):] if whole.startswith(self.text) else ""
        self.text += piece
        return piece

    def ends_with_any(self, stops: tuple[str, ...], piece: str) -> bool:
        """Whether one of ``stops`` occurs in the text and overlaps ``piece``, the text just added (so a
        stop string is seen on the token that completes it, looking only at the text it can touch)."""
        if not piece:
            return False
        return any(stop in self.text[-(len(piece) + len(stop) - 1):] for stop in stops)


def _stream():
    from tokenizers.decoders import DecodeStream

    return DecodeStream(skip_special_tokens=True)
