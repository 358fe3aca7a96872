"""Chat templates rendered with jinja2 as transformers renders them, without importing transformers.

A model's ``tokenizer_config.json`` (or ``chat_template.jinja``) holds a Jinja template that turns a list
of messages into the prompt text. Templates are written against transformers' environment, so this module
builds the same one: a sandbox whose values cannot be changed (``ImmutableSandboxedEnvironment``),
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``), a ``{% generation %}``
block that renders its body unchanged, the filter ``tojson`` (no HTML escaping, non-ASCII kept), and the
globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` (that refuses underscore names).
Messages reach the template as plain JSON data: keys whose value is ``None`` are dropped, pydantic models
and dataclasses become dicts, any other object becomes a placeholder naming its type, and a message's
reasoning is offered under the names templates read (``reasoning_content``, ``thinking``).

``tests/task/test_tokenizer.py`` holds the rendering equal to ``AutoTokenizer.apply_chat_template``'s on
random conversations. This module knows nothing about tokens: text in, text out.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's part in training templates;
    rendering keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace()`` without underscore-prefixed names (no path to interpreter internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's own signature trick, so ``namespace(self=...)`` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot store the underscore-prefixed name {name!r} on a namespace")


class _DictMaker:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without handing them the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in the chat-template environment (once per distinct template).

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictMaker()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def checked_template(source: str) -> str:
    """``source`` when it compiles as a chat template.

    Raises:
        ValueError: it does not (the message names the template's line).
    """
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"not a valid chat template: {exc.message} (line {exc.lineno} of the template)") from None
    return source


def render_chat(
    source: str,
    messages: Sequence[Any],
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping] | None = None,
    documents: Sequence[Mapping] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """``messages`` rendered by the chat template ``source``.

    ``variables`` are further names the template sees (the tokenizer's special tokens, ``bos_token`` and
    the like, and any caller keywords, which win). Tools must be JSON schemas (dicts).

    Raises:
        TypeError: a message, tool or document is not a mapping.
        jinja2.TemplateError: the template refuses the conversation (its ``raise_exception``) or fails.
    """
    chat = [_drop_none(message) for message in messages]
    chat = _with_reasoning_names(_plain(chat))
    for name, items in (("tool", tools), ("document", documents)):
        if items is not None and not all(isinstance(item, Mapping) for item in items):
            raise TypeError(f"every {name} must be a dict (a JSON schema for tools)")
    return compile_template(source).render(
        messages=chat,
        tools=_plain(list(tools)) if tools is not None else None,
        documents=_plain(list(documents)) if documents is not None else None,
        add_generation_prompt=add_generation_prompt,
        **_plain(dict(variables or {})),
    )


def _drop_none(message: Any) -> dict:
    """A message as a dict without its ``None`` values (``content=None`` from an API client, say)."""
    if callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    elif dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, dataclasses or pydantic models, not {message!r}")
    return {key: value for key, value in message.items() if value is not None}


def _with_reasoning_names(chat: list[dict]) -> list[dict]:
    """Each message's reasoning (under any of :data:`REASONING_FIELDS`) also as ``thinking`` and
    ``reasoning_content``, the names templates read."""
    named = []
    for message in chat:
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        named.append(message)
    return named


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types, so a template can reach no object's methods; anything
    else becomes ``"<TypeName>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, bool, int, float):  # subclasses (enums, numpy scalars) back to the base type
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    numpy = sys.modules.get("numpy")  # a numpy scalar can only come from a program that imported numpy
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"
