"""Prompt: render a task with the model's chat template and split it at a checked token boundary.

The task is rendered once with a sentinel in place of the record. Everything
before the sentinel (instruction, taxonomy, few-shot turns, and the static
lead of the input template such as ``"Ticket: "``) is the *prefix*; the
record's own text plus the template's closing tokens is the *suffix*.

Invariant 3: a record is only ever fed as ``prefix_ids + suffix_ids`` where
``tokenize(prefix_text + suffix_text) == prefix_ids + suffix_ids``. When the
tokenizer merges across the boundary (a trailing space, a split mid-word), the
stored prefix is *healed*: its last token(s) move into every suffix. Records
are still checked one by one; one that breaks the boundary anyway is reported
(``Encoded.suffix_ids is None``) so the record loop can re-encode it in full.

Few-shot examples: the prompt always shows
:func:`prefixcache.task.selection.resolve_examples` of the task (its fixed
``examples`` plus what its ``select`` picks from ``example_pool``), whatever
the caller (classify, verify, bench, serve, ray, eval). Data flows one way:
task file -> resolved examples -> rendered prompt; ``Prompt.task`` is the
resolved task. Selection is seeded, so one task file always gives the same
prefix text and tokens (and so the same prefix-cache keys).

This module knows nothing about models or caches: only text and token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from jinja2 import TemplateError

from ..errors import InputError, PromptError
from .label_set import LabelSet
from .restart import Restart, tokenize_prompts
from .selection import resolve_examples
from .definition import Task

SENTINEL = "\u27e6RECORD\u27e7"
MAX_HEAL = 8
# Suffix openings that stress the boundary: letters, case, digits, spaces, punctuation, non-ASCII.
BOUNDARY_PROBES = ("a", "A", "the", "The", " x", "  y", "1", "42", "?", "!", ".", ",", "-", "'s", '"q', "\u00e9t\u00e9", "\u65e5\u672c", "\n", "\t")


@dataclass(frozen=True)
class Encoded:
    """One record, tokenized.

    ``full_ids`` is exactly what full re-encoding feeds the model. ``suffix_ids``
    is ``full_ids[len(prefix_ids):]`` when the record respects the boundary, else ``None``.
    """

    full_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...] | None


class RecordSlot:
    """Where a record goes in a rendered prompt: filling it in, and tokenizing the whole prompt.

    Shared by :class:`Prompt` and the extraction prompt. A subclass provides ``task``
    (with ``input_template``), ``prefix_text``, ``lead``, ``tail_text``, ``prefix_ids``,
    ``restart`` (where tokenizing a record's prompt may start, or None) and ``input_names``,
    the record fields the template uses.
    """

    def suffix_text(self, record: Mapping[str, object], record_id: object = None) -> str:
        """The record's part of the prompt: the filled template (minus its lead) plus the tail.

        Raises:
            InputError: a template field is missing or not text; names the record and the field.
        """
        values = {}
        for field in self.input_names:
            if record.get(field) is None:
                raise InputError(f"record {record_id!r}: missing field {field!r} (the task's input_template needs it)")
            value = record[field]
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise InputError(f"record {record_id!r}: field {field!r} must be text, not {type(value).__name__}")
            values[field] = str(value)
        filled = self.task.input_template.format(**values)
        return filled[len(self.lead):] + self.tail_text

    def encode(self, tokenizer, texts: Sequence[str]) -> list[Encoded]:
        """Tokenize full prompts (``prefix_text + suffix``) and check each against the stored prefix;
        ``suffix_ids`` is None where the tokens cross the boundary.

        ``full_ids`` are exactly ``tokenizer(prefix_text + suffix)``'s; with a ``restart`` only the text
        after it is tokenized (:mod:`prefixcache.task.restart` says why that is exact).
        """
        n = len(self.prefix_ids)
        out = []
        for ids in tokenize_prompts(tokenizer, self.prefix_text, self.restart, texts):
            out.append(Encoded(ids, ids[n:] if ids[:n] == self.prefix_ids else None))
        return out


@dataclass(frozen=True)
class Prompt(RecordSlot, LabelSet):
    """A task rendered for one tokenizer.

    Attributes:
        task: the task with its examples resolved (no pool, no ``select``): ``task.examples``
            are exactly the examples the prompt shows, in order.
        prefix_text: the static text before the record (including the input template's lead).
        lead: static text of the input template before its first field (already in ``prefix_text``).
        tail_text: the chat template's text after the record (end of turn, assistant header).
        prefix_ids: tokens stored in the prefix cache (healed: may omit the last ``heal`` tokens
            of ``tokenize(prefix_text)``, which then start every suffix).
        heal: how many trailing prefix tokens were moved into the suffix.
        label_ids: per label, the tokens of the answer as they follow ``tail_text``.
        restart: where a record's prompt may start being tokenized (None: from the start).
    """

    task: Task
    prefix_text: str
    lead: str
    tail_text: str
    prefix_ids: tuple[int, ...]
    heal: int
    label_ids: dict[str, tuple[int, ...]]
    restart: Restart | None = None

    @property
    def input_names(self) -> list[str]:
        return self.task.fields

    def full_text(self, record: Mapping[str, object], record_id: object = None) -> str:
        return self.prefix_text + self.suffix_text(record, record_id)


def render_messages(task: Task) -> list[dict[str, str]]:
    """Chat messages for ``task`` with :data:`SENTINEL` in place of the record.

    The few-shot turns are the task's resolved examples (:func:`~prefixcache.task.selection.resolve_examples`).
    """
    task = resolve_examples(task)
    taxonomy = "\n".join(f"- {name}: {description}" for name, description in task.labels.items())
    system = (
        f"{task.instruction.strip()}\n\nCategories:\n{taxonomy}\n\n"
        f"Answer with exactly one category name: {', '.join(task.labels)}."
    )
    messages = [{"role": "system", "content": system}]
    fields = task.fields
    for example in task.examples:
        filled = task.input_template.format(**{f: example.text for f in fields})
        messages += [{"role": "user", "content": filled}, {"role": "assistant", "content": example.label}]
    lead = input_lead(task)
    messages.append({"role": "user", "content": lead + SENTINEL})
    return messages


def input_lead(task: Task) -> str:
    """The static text of the input template before its first field (``"Ticket: "`` for ``"Ticket: {text}"``)."""
    return template_lead(task.input_template, task.fields[0])


def template_lead(template: str, first_field: str) -> str:
    """The literal text of a format ``template`` before ``{first_field}``, braces unescaped."""
    first = template.index("{" + first_field + "}")
    return template[:first].replace("{{", "{").replace("}}", "}")


@dataclass(frozen=True)
class SentinelSplit:
    """A chat prompt rendered around :data:`SENTINEL` and split there, boundary healed.

    ``prefix_ids`` are the prefix's tokens minus the last ``heal``, which every
    record re-encodes as the start of its suffix.
    """

    prefix_text: str
    tail_text: str
    prefix_ids: tuple[int, ...]
    heal: int
    restart: Restart | None


def split_at_sentinel(tokenizer, messages: list[dict[str, str]], template: str | None = None) -> SentinelSplit:
    """Render ``messages`` with ``template`` (the task's ``chat_template``), else the tokenizer's chat template, plus
    the generation prompt, and split at the sentinel.

    Raises:
        PromptError: no chat template, one that fails on the messages, the sentinel not kept exactly once, or an
            unhealable boundary.
    """
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise PromptError("this tokenizer has no chat template; use an instruction-tuned (chat) model, or give the "
                          "task one (chat_template:)")
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 chat_template=template)
    except TemplateError as exc:
        which = "the task's chat template" if template is not None else "the tokenizer's chat template"
        raise PromptError(f"{which} cannot render the prompt: {exc}") from None
    if rendered.count(SENTINEL) != 1:
        raise PromptError("the chat template did not keep the record placeholder exactly once")
    prefix_text, tail_text = rendered.split(SENTINEL)
    encode = token_encoder(tokenizer)
    raw_prefix = encode(prefix_text)
    heal = _healing_depth(encode, prefix_text, raw_prefix, tail_text)
    return SentinelSplit(prefix_text, tail_text, raw_prefix[: len(raw_prefix) - heal], heal, Restart.find(tokenizer, prefix_text))


def token_encoder(tokenizer) -> Callable[[str], tuple[int, ...]]:
    """``text -> token ids`` without special tokens."""
    return lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_prompt(task: Task, tokenizer) -> Prompt:
    """Render ``task`` with ``tokenizer``'s chat template, heal the boundary, and tokenize the labels.

    Raises:
        PromptError: no chat template, a sentinel problem, an unhealable boundary, or a label whose
            tokens are not stable after the template's tail.
    """
    task = resolve_examples(task)  # the Prompt keeps the task whose examples it shows
    split = split_at_sentinel(tokenizer, render_messages(task), task.chat_template)
    encode = token_encoder(tokenizer)
    label_ids = {label: _label_tokens(encode, split.tail_text, label) for label in task.labels}
    return Prompt(task, split.prefix_text, input_lead(task), split.tail_text, split.prefix_ids, split.heal, label_ids, split.restart)


def _healing_depth(encode, prefix_text: str, raw_prefix: tuple[int, ...], tail_text: str) -> int:
    """Fewest trailing prefix tokens to move into the suffix so every probe respects the boundary."""
    probes = [encode(prefix_text + probe + tail_text) for probe in BOUNDARY_PROBES]
    for heal in range(0, min(MAX_HEAL, len(raw_prefix) - 1) + 1):
        kept = raw_prefix[: len(raw_prefix) - heal]
        if all(ids[: len(kept)] == kept for ids in probes):
            return heal
    raise PromptError(
        f"the prefix's last {MAX_HEAL} tokens merge with what follows; end the input template's lead "
        "with a newline or a special token"
    )


def _label_tokens(encode, tail_text: str, label: str) -> tuple[int, ...]:
    tail = encode(tail_text)
    whole = encode(tail_text + label)
    if whole[: len(tail)] != tail or len(whole) == len(tail):
        raise PromptError(f"label {label!r} merges with the chat template's answer header; it cannot be scored exactly")
    return whole[len(tail):]
