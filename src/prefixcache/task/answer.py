"""The extraction answer format: how an example's answer is written, its JSON Schema, and how a generated
answer is read back.

An answer is one JSON object with the task's declared fields, in declared order, each valued as its kind
says (:mod:`prefixcache.task.fields`: a string or null for ``text`` and ``copy``, one of the values for
``choice``, a number or null, an ISO date or null; :func:`answer_schema` says so as a JSON Schema, which
constrained decoding follows). This module knows
nothing about models or tokens: only the declared field names and text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

from .definition import ExtractTask
from .fields import value_schema


def answer_json(task: ExtractTask, values: Mapping[str, object]) -> str:
    """The JSON an example answers with: the declared fields in declared order."""
    return json.dumps({name: values.get(name) for name in task.fields}, ensure_ascii=False)


def answer_schema(task: ExtractTask) -> dict:
    """The JSON Schema of an answer: an object with exactly the declared fields, in declared order, each valued
    as its kind says. Every output decoded under it parses (:func:`parse_fields`) with every field present."""
    return {
        "type": "object",
        "properties": {name: value_schema(decl) for name, decl in task.fields.items()},
        "required": list(task.fields),
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class ParsedFields:
    """The declared fields found in an output (``None`` when no JSON object was found) and what went wrong."""

    fields: dict | None
    error: str | None = None


def parse_fields(raw: str, declared: list[str]) -> ParsedFields:
    """Parse the first JSON object in ``raw`` and keep the declared fields (other keys are dropped).

    Never raises: a missing object, invalid JSON or a missing field is reported in ``error``.
    """
    start = raw.find("{")
    if start < 0:
        return ParsedFields(None, f"no JSON object in the output: {_excerpt(raw)}")
    try:
        value, _ = json.JSONDecoder().raw_decode(raw[start:])
    except json.JSONDecodeError as exc:
        where = f"{exc.msg} at character {start + exc.pos}"
        return ParsedFields(None, f"output is not valid JSON ({where}): {_excerpt(raw)}")
    if not isinstance(value, dict):
        return ParsedFields(None, f"output is JSON but not an object: {_excerpt(raw)}")
    fields = {name: value[name] for name in declared if name in value}
    missing = [name for name in declared if name not in value]
    if missing:
        return ParsedFields(fields, f"output lacks field(s) {', '.join(missing)}")
    return ParsedFields(fields)


def _excerpt(text: str, limit: int = 80) -> str:
    return json.dumps(text if len(text) <= limit else text[:limit] + "...", ensure_ascii=False)
