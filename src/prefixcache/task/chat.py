"""Prompts that arrive whole: OpenAI-style chat messages or a completion prompt, as token ids.

A task file's prompt is split at a sentinel (:mod:`prefixcache.task.prompt`); a request's prompt has no
sentinel, so :func:`chat_prompt` and :func:`text_prompt` decide how much of it is *reusable*: the leading
tokens worth storing as a prefix, which the next request with the same system prompt and few-shot turns
shares. Invariant 3 holds by construction: the row fed after the stored prefix is ``ids[reusable:]``,
the very tokens full re-encoding feeds, only split in two.

* chat: the reusable part ends where the last message begins (everything before it renders the same
  for every request of a conversation shape), when that is a token boundary of the whole prompt;
* otherwise (a one-message chat, a completion prompt): the last whole block of :data:`BLOCK` tokens
  before the final token.

:class:`Choices` are a request's allowed answers as labels (``guided_choice``): each choice's tokens as
they follow the prompt.

This module knows nothing about models or caches: only text and token ids.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from ..errors import PromptError, RequestFieldError
from .label_set import LabelSet
from .restart import Restart, tokenize_prompts

BLOCK = 16  # a reusable part that is not a message boundary ends on a multiple of this many tokens


@dataclass(frozen=True)
class WholePrompt:
    """A request's whole prompt. ``ids`` is exactly what full re-encoding feeds; ``reusable < len(ids)``."""

    text: str
    ids: tuple[int, ...]
    reusable: int
    special_tokens: bool = False  # whether ``text`` was tokenized with the tokenizer's special tokens (BOS)
    restart: Restart | None = None  # where ``text + s`` may start being tokenized, for any ``s`` (a choice)


@dataclass(frozen=True)
class Choices(LabelSet):
    """A request's choices as labels: ``label_ids[choice]`` are the tokens that follow the prompt."""

    label_ids: dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class _Earlier:
    """The messages before the last one: their text, its tokens, and a restart point (once worth finding)."""

    text: str
    ids: tuple[int, ...]
    restart: Restart | None
    seen: int  # requests that shared these messages


class EarlierMessages:
    """The :class:`_Earlier` of recently seen leading messages (LRU, ``size`` entries; thread-safe), so a request
    whose system prompt and few-shot turns were seen before tokenizes only its last message.

    The restart point (:class:`~prefixcache.task.restart.Restart`, which proves that tokenizing from it gives
    the whole text's tokens) is looked for on the second request that shares the messages, not the first.
    """

    def __init__(self, size: int = 256):
        self.size = size
        self._entries: OrderedDict[tuple, _Earlier] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, tokenizer, messages: Sequence[dict[str, str]]) -> _Earlier:
        key = tuple((m["role"], m["content"]) for m in messages)
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=False)
            entry = _Earlier(text, _encode(tokenizer, text), None, 1)
        elif entry.restart is None and entry.seen == 1:
            entry = _Earlier(entry.text, entry.ids, Restart.find(tokenizer, entry.text), 2)
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return entry


def chat_prompt(tokenizer, messages: Sequence[dict[str, str]], earlier: EarlierMessages | None = None) -> WholePrompt:
    """``messages`` rendered with the tokenizer's chat template and its generation prompt, tokenized
    (the leading messages through ``earlier``, when given, so that only the last one is tokenized anew).

    Raises:
        PromptError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("this model's tokenizer has no chat template; use /v1/completions with a prompt")
    messages = [dict(m) for m in messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if len(messages) > 1:
        head = (earlier or EarlierMessages(1)).get(tokenizer, messages[:-1])
        if text.startswith(head.text):
            ids = tokenize_prompts(tokenizer, head.text, head.restart, [text[len(head.text):]])[0]
            reusable = len(head.ids) if ids[: len(head.ids)] == head.ids and len(head.ids) < len(ids) else _block_boundary(len(ids))
            return WholePrompt(text, ids, reusable, restart=head.restart)
    ids = _encode(tokenizer, text)
    return WholePrompt(text, ids, _block_boundary(len(ids)))


def text_prompt(tokenizer, prompt: str | Sequence[int]) -> WholePrompt:
    """A completion prompt: text (tokenized with the tokenizer's special tokens, as vLLM does) or token ids."""
    if isinstance(prompt, str):
        ids = _encode(tokenizer, prompt, special_tokens=True)
        text = prompt
    else:
        ids = tuple(int(t) for t in prompt)
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < len(tokenizer)), None)
        if bad is not None:
            raise RequestFieldError(f"prompt[{bad}] = {ids[bad]} is not a token id of this model (0 to {len(tokenizer) - 1})",
                                    param=f"prompt[{bad}]")
        text = tokenizer.decode(list(ids))
    if not ids:
        raise RequestFieldError("the prompt is empty; send at least one token", param="prompt")
    return WholePrompt(text, ids, _block_boundary(len(ids)), special_tokens=True)


def choices_after(tokenizer, prompt: WholePrompt, choices: Sequence[str], param: str) -> Choices:
    """Each choice's tokens as they follow ``prompt`` (``tokenize(prompt.text + choice)`` minus the prompt's).

    Raises:
        RequestFieldError: naming ``param``: fewer than two or repeated choices, an empty one, or one whose
            tokens merge with the prompt's last token (it could not be scored exactly).
    """
    if len(choices) < 2 or len(set(choices)) != len(choices):
        raise RequestFieldError(f"{param} needs at least two different choices, got {len(choices)}", param=param)
    label_ids = {}
    if prompt.special_tokens:
        wholes = [_encode(tokenizer, prompt.text + choice, True) for choice in choices]
    else:
        wholes = tokenize_prompts(tokenizer, prompt.text, prompt.restart, list(choices))
    for i, (choice, whole) in enumerate(zip(choices, wholes)):
        if not choice or whole[: len(prompt.ids)] != prompt.ids or len(whole) == len(prompt.ids):
            raise RequestFieldError(
                f"{param}[{i}] ({choice!r}) cannot follow the prompt as whole tokens (it is empty, or it merges "
                "with the prompt's last token); end the prompt with a space or a newline, or change the choice",
                param=f"{param}[{i}]",
            )
        label_ids[choice] = whole[len(prompt.ids):]
    return Choices(label_ids)


def _encode(tokenizer, text: str, special_tokens: bool = False) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])


def _block_boundary(length: int) -> int:
    """The last multiple of :data:`BLOCK` that leaves at least one token after it."""
    return ((length - 1) // BLOCK) * BLOCK
