"""Where a prompt's tokenization can restart, so a record is tokenized without re-tokenizing the prefix.

Invariant 3 needs every record's exact tokens: those of the whole prompt, ``prefix_text + suffix``,
which is what full re-encoding feeds the model. Tokenizing the whole text again for every record
costs ~0.6 ms with a 600-token prefix, over ten times the record's own part.

A fast (Rust) Hugging Face tokenizer first cuts the text at its added tokens (``<|im_start|>`` and
the like), then normalizes, pre-tokenizes and runs the model on each piece alone. So at a place in
``prefix_text`` just after an added token, where no added-token match can reach across from
before it, the tokens before that place never depend on what follows, and

    tokenize(prefix_text + suffix) == head_ids + tokenize(prefix_text[cut:] + suffix)

exactly, for every suffix. :meth:`Restart.find` looks for the last such place and proves it on the
prefix and on probe suffixes; where there is none (a slow tokenizer, no added token in the prefix,
an added token that could reach across), records are tokenized whole, as before.

This module knows nothing about models or tasks: only text, tokenizers and token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Record openings the proof runs on besides the real ones: letters, digits, spaces, punctuation,
# non-ASCII, and pieces of chat-template markup.
PROBES = ("a", "The", " x", "  y", "\n", "\t", "42", "?", "'s", "\u00e9t\u00e9", "\u65e5\u672c", "<", "<|", "|>", "<|im_end|>")


@dataclass(frozen=True)
class Restart:
    """``tokenize(prefix_text + s) == head_ids + tokenize(prefix_text[cut:] + s)`` for every ``s``."""

    cut: int  # characters of prefix_text whose tokens (head_ids) never change
    head_ids: tuple[int, ...]

    @classmethod
    def find(cls, tokenizer, prefix_text: str) -> Restart | None:
        """The last safe restart point in ``prefix_text`` for ``tokenizer``, or None if there is none.

        A place qualifies when it follows an added token that is split out before normalization
        (``normalized=False``), does not strip the whitespace after it, and ends in a character that
        is not whitespace; when no added token could begin before the place and end after it; and when
        no added token needs word boundaries (``single_word``). The place is then checked on the
        prefix itself and on :data:`PROBES`.
        """
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not prefix_text:
            return None
        added = list(backend.get_added_tokens_decoder().values())
        if not added or any(token.single_word for token in added):
            return None
        probes = ("", *PROBES)  # "" is the prefix itself
        expected = _tokenize(tokenizer, [prefix_text + p for p in probes])
        for end in sorted(_token_ends(prefix_text, added), reverse=True):
            if _reaches_across(prefix_text[:end], added):
                continue
            restart = cls(end, _tokenize(tokenizer, [prefix_text[:end]])[0])
            if restart.tokenize(tokenizer, prefix_text, probes) == expected:
                return restart
        return None

    def tokenize(self, tokenizer, prefix_text: str, suffixes: Sequence[str]) -> list[tuple[int, ...]]:
        """Token ids of ``prefix_text + s`` for each suffix, tokenizing only ``prefix_text[cut:] + s``."""
        tail = prefix_text[self.cut :]
        return [self.head_ids + ids for ids in _tokenize(tokenizer, [tail + s for s in suffixes])]


def tokenize_prompts(tokenizer, prefix_text: str, restart: Restart | None, suffixes: Sequence[str]) -> list[tuple[int, ...]]:
    """Token ids of ``prefix_text + s`` for each suffix: from the restart point when there is one."""
    if restart is not None:
        return restart.tokenize(tokenizer, prefix_text, suffixes)
    return _tokenize(tokenizer, [prefix_text + s for s in suffixes])


def _tokenize(tokenizer, texts: Sequence[str]) -> list[tuple[int, ...]]:
    if not texts:
        return []
    return [tuple(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def _token_ends(text: str, added) -> set[int]:
    """End offsets of every occurrence in ``text`` of an added token that may start a restart."""
    ends = set()
    for token in added:
        content = token.content
        if not content or token.normalized or token.rstrip or content[-1].isspace():
            continue
        start = text.find(content)
        while start != -1:
            ends.add(start + len(content))
            start = text.find(content, start + 1)
    return ends


def _reaches_across(head: str, added) -> bool:
    """Whether some added token could begin inside ``head`` and end after it: a proper prefix of the
    token is a suffix of ``head``."""
    return any(head.endswith(token.content[:k]) for token in added for k in range(1, len(token.content)))
