"""Field kinds of an extraction task: what each declared field is, and what a value of it may be.

A field is declared in a task file either as a plain description (``order_id: "The order id ..."``),
which is a ``text`` field (free text or null, what every field was before kinds existed), or as a mapping::

    order_id: {kind: copy, description: "The order id as written in the ticket, else null."}
    sentiment: {kind: choice, values: [positive, neutral, negative], description: "The customer's mood."}

Kinds (:data:`FIELD_KINDS`):

* ``copy``: a span of the record's own text, or null. Decoding can only copy (see
  :mod:`prefixcache.engine.copy_constraint`), so a copied value is never invented.
* ``choice``: one of ``values`` (at least two, unique, non-blank). Scored like labels: the generated value
  is one of them, and a fitted head for the field replaces it (see ``extract --head FIELD=FILE``).
* ``text``: a string or null (the default).
* ``number``: a JSON number or null.
* ``date``: an ISO date ``YYYY-MM-DD`` or null.

:func:`value_schema` gives each kind's JSON Schema; :func:`example_value_problem` checks an example's value
against its field (a copied value must be in the example's text, a choice value one of the values).
This module knows nothing about tokens or models.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

FIELD_KINDS = ("copy", "choice", "text", "number", "date")
DEFAULT_KIND = "text"  # a field declared by its description alone
DATE_PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"
_DATE = re.compile(DATE_PATTERN)


class FieldDecl(BaseModel):
    """One declared field: its ``kind``, its ``description`` (shown to the model) and, for ``choice``, its ``values``.

    Contract: ``values`` is given exactly when ``kind`` is ``choice``, with at least two unique, non-blank
    values without surrounding whitespace.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["copy", "choice", "text", "number", "date"] = DEFAULT_KIND
    description: str = Field(min_length=1)
    values: tuple[str, ...] | None = None

    @model_validator(mode="before")
    @classmethod
    def _description_alone(cls, data):
        """A plain string is a ``text`` field with that description."""
        return {"description": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _values_fit_kind(self) -> FieldDecl:
        if self.kind != "choice":
            if self.values is not None:
                raise ValueError(f"'values' belongs to a choice field, not to a {self.kind} field (remove it or use kind: choice)")
            return self
        if self.values is None or len(self.values) < 2:
            raise ValueError("a choice field needs 'values': a list of at least two values")
        bad = [v for v in self.values if not v.strip() or v != v.strip()]
        if bad:
            raise ValueError(f"choice value {bad[0]!r} is empty or has leading or trailing whitespace")
        if len(set(self.values)) != len(self.values):
            twice = next(v for v in self.values if self.values.count(v) > 1)
            raise ValueError(f"choice value {twice!r} is listed twice")
        return self


def value_schema(decl: FieldDecl) -> dict:
    """The JSON Schema of one field's value."""
    if decl.kind == "choice":
        return {"enum": list(decl.values or ())}
    if decl.kind == "number":
        return {"type": ["number", "null"]}
    if decl.kind == "date":
        return {"anyOf": [{"type": "string", "pattern": DATE_PATTERN}, {"type": "null"}]}
    return {"type": ["string", "null"]}


def example_value_problem(decl: FieldDecl, value: object, text: str) -> str | None:
    """What is wrong with ``value`` as an example's answer for a field ``decl`` of a record ``text``; None if fine."""
    if value is None:
        return "is null, but a choice field takes one of its values" if decl.kind == "choice" else None
    if decl.kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"{value!r} is not a number"
    if not isinstance(value, str):
        return f"{value!r} is not a string (quote it)"
    if decl.kind == "choice" and value not in (decl.values or ()):
        return f"{value!r} is not one of the values ({', '.join(decl.values or ())})"
    if decl.kind == "copy" and value not in text:
        return f"{value!r} is a copy field's value, but it is not in the example's text"
    if decl.kind == "date" and not _DATE.match(value):
        return f"{value!r} is not a date written YYYY-MM-DD"
    return None


def example_value_problems(fields: dict[str, FieldDecl], examples) -> list[tuple[tuple, str]]:
    """(location, message) for every example value that does not fit its field (examples that give exactly the
    declared fields; others are reported elsewhere)."""
    problems = []
    for i, example in enumerate(examples):
        for name, decl in fields.items():
            problem = example_value_problem(decl, example.fields.get(name), example.text) if name in example.fields else None
            if problem is not None:
                problems.append((("examples", i, "fields", name), f"{name}: {problem}"))
    return problems


def located_value_problems(data: dict, example_model: type[BaseModel]) -> list[tuple[tuple, str]]:
    """:func:`example_value_problems` of a task file's raw ``data``, its examples read by ``example_model`` (empty
    when its fields or examples do not validate on their own: those problems are reported as they are)."""
    try:
        fields = {str(k): FieldDecl.model_validate(v) for k, v in (data.get("fields") or {}).items()}
        examples = [example_model.model_validate(e) for e in data.get("examples") or []]
    except (ValidationError, AttributeError):
        return []
    return example_value_problems(fields, examples)
