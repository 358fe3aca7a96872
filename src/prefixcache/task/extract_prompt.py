"""The extraction prompt: an :class:`~prefixcache.task.definition.ExtractTask` rendered for one tokenizer.

It is rendered like a classification prompt (chat template, sentinel, checked token boundary), with
the declared fields in the system message and each example's answer as a JSON object
(:func:`~prefixcache.task.answer.answer_json`). This module knows nothing about caches or generation.
"""

from __future__ import annotations

from dataclasses import dataclass

from .answer import answer_json
from .prompt import SENTINEL, RecordSlot, split_at_sentinel, template_lead
from .restart import Restart
from .definition import ExtractTask
from .fields import FieldDecl


@dataclass(frozen=True)
class ExtractPrompt(RecordSlot):
    """An extraction task rendered for one tokenizer (see :class:`prefixcache.task.prompt.Prompt` for the fields)."""

    task: ExtractTask
    prefix_text: str
    lead: str
    tail_text: str
    prefix_ids: tuple[int, ...]
    heal: int
    restart: Restart | None = None

    @property
    def input_names(self) -> list[str]:
        return self.task.input_fields


def render_extract_messages(task: ExtractTask) -> list[dict[str, str]]:
    """Chat messages for ``task`` with :data:`~prefixcache.task.prompt.SENTINEL` in place of the record."""
    declared = "\n".join(f"- {name}: {_described(decl)}" for name, decl in task.fields.items())
    system = (
        f"{task.instruction.strip()}\n\nFields:\n{declared}\n\n"
        f"Answer with one JSON object with exactly these keys: {', '.join(task.fields)}. "
        "Use null for a field the text does not give."
    )
    messages = [{"role": "system", "content": system}]
    for example in task.examples:
        filled = task.input_template.format(**{f: example.text for f in task.input_fields})
        answer = answer_json(task, example.fields)
        messages += [{"role": "user", "content": filled}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": _lead(task) + SENTINEL})
    return messages


def _described(decl: FieldDecl) -> str:
    """A field's line in the system message: its description, and a choice field's values."""
    if decl.kind != "choice":
        return decl.description
    return f"{decl.description} (one of: {', '.join(decl.values or ())})"


def _lead(task: ExtractTask) -> str:
    return template_lead(task.input_template, task.input_fields[0])


def build_extract_prompt(task: ExtractTask, tokenizer) -> ExtractPrompt:
    """Render ``task`` with ``tokenizer``'s chat template and heal the prefix boundary.

    Raises:
        PromptError: no chat template, a sentinel problem, or an unhealable boundary.
    """
    split = split_at_sentinel(tokenizer, render_extract_messages(task), task.chat_template)
    return ExtractPrompt(task, split.prefix_text, _lead(task), split.tail_text, split.prefix_ids, split.heal, split.restart)
