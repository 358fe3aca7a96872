"""A task's ``input_template``: how a record's fields are written into the prompt, as ``str.format`` slots."""

from __future__ import annotations

import string


def template_fields(template: str) -> list[str]:
    """Names of the ``{field}`` slots in a ``str.format`` template, in order, without repeats.

    Raises:
        ValueError: a slot is not a plain name, or carries a format spec or a conversion (``{text:>9}``,
            ``{text!r}``): a spec such as ``{text:x>200000}`` would pad every record to any width.
    """
    names: list[str] = []
    for _, field, spec, conversion in string.Formatter().parse(template):
        if field is None:
            continue
        if not field.isidentifier():
            raise ValueError(f"field {{{field}}} is not a plain name")
        if spec or conversion:
            written = "{" + field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(f"field {written} has a format spec or conversion; write it as {{{field}}}")
        if field not in names:
            names.append(field)
    return names


def checked_input_template(template: str) -> str:
    """``template`` when its slots are plain field names and it names at least one.

    Raises:
        ValueError: it does not (the message says how to write it).
    """
    try:
        fields = template_fields(template)
    except ValueError as exc:
        raise ValueError(f"not a valid template: {exc}") from None
    if not fields:
        raise ValueError("must name at least one record field, for example '{text}'")
    return template
