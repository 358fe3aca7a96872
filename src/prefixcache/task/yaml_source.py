"""Reading a task file's YAML: a safe loader that refuses duplicate keys, one parse for both the data and
the node tree, and the line of a field in that tree (for errors that name the line).

Scalars that YAML reads but Python cannot hold are refused as YAML errors naming the field and its line,
never let through as a bare ``ValueError`` or into the tokenizer: an integer over Python's digit limit
(``sys.get_int_max_str_digits()``, 4,300 by default), an impossible date or time (``2024-13-45``, a UTC
offset of 99 hours) and text holding a lone surrogate (the escape ``"\\ud800"``, which UTF-8 cannot carry).

Where PyYAML has libyaml (``yaml.__with_libyaml__``), a file is read by :class:`UniqueKeyCLoader`, the same
loader over libyaml's C parser (about 30 times faster on a large file; the constructors above are Python either
way). A file it refuses is read again by the pure-Python :class:`UniqueKeyLoader`, so an error names the line and
field exactly as it always has (libyaml words its errors otherwise, and refuses a lone-surrogate escape outright).
The one exception is libyaml's nesting limit ("exceeded maximum nesting depth", with its line): that error stands,
since the pure-Python loader would recurse for seconds (2.4 s for 5,000 levels) only to report less.

Nothing here knows what a task is; :mod:`prefixcache.task.definition` validates the data.
"""

from __future__ import annotations

import datetime
import sys

import yaml


class UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate mapping keys instead of keeping the last one."""


def _construct_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain name, not {type(key).__name__}", key_node.start_mark
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen[key] = True
    return loader.construct_mapping(node, deep=deep)


class ScalarValueError(yaml.constructor.ConstructorError):
    """A scalar Python cannot hold (see the module docstring). ``node`` is the scalar's node."""

    def __init__(self, problem: str, node: yaml.Node):
        super().__init__(None, None, problem, node.start_mark)
        self.node = node


def _construct_text(loader: UniqueKeyLoader, node: yaml.Node):
    value = yaml.constructor.SafeConstructor.construct_scalar(loader, node)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ScalarValueError(
                f"text with a lone surrogate ({_escaped(value[exc.start])}) at character {exc.start}, which is not "
                "valid Unicode; write the character itself, or a surrogate pair", node
            ) from None
    return value


def _construct_int(loader: UniqueKeyLoader, node: yaml.Node) -> int:
    try:
        return yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)
    except ValueError:
        digits = sum(c.isdigit() for c in str(node.value))
        raise ScalarValueError(
            f"an integer of {digits} digits, over Python's limit of {sys.get_int_max_str_digits()} digits; "
            "quote it to keep it as text", node
        ) from None


def _construct_timestamp(loader: UniqueKeyLoader, node: yaml.Node) -> datetime.date:
    try:
        return yaml.constructor.SafeConstructor.construct_yaml_timestamp(loader, node)
    except (ValueError, OverflowError) as exc:
        raise ScalarValueError(f"{str(node.value)!r} is not a valid date or time ({exc}); quote it to keep it as text",
                               node) from None


def _checked(loader_type: type) -> type:
    """``loader_type`` with the checks above: duplicate keys, scalars Python cannot hold."""
    loader_type.construct_scalar = _construct_text  # every scalar's text (keys and values) passes through it
    loader_type.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
    loader_type.add_constructor("tag:yaml.org,2002:int", _construct_int)
    loader_type.add_constructor("tag:yaml.org,2002:timestamp", _construct_timestamp)
    return loader_type


_checked(UniqueKeyLoader)

if yaml.__with_libyaml__:
    @_checked
    class UniqueKeyCLoader(yaml.CSafeLoader):
        """:class:`UniqueKeyLoader` over libyaml's C parser: the same constructors, nodes with the same marks."""

FAST_LOADER: type | None = UniqueKeyCLoader if yaml.__with_libyaml__ else None
_NESTING = "exceeded maximum nesting depth"  # libyaml's problem text when a document nests too deeply
"""The loader tried first (None without libyaml); :class:`UniqueKeyLoader` reads what it refuses."""


def compose_and_construct(text: str) -> tuple[yaml.Node | None, object]:
    """The YAML node tree (for line numbers) and the data built from that same tree: the text is parsed once
    (twice when the C loader refuses it, see the module docstring).

    Raises yaml.YAMLError; a scalar Python cannot hold raises one whose ``problem`` names its field first
    (``field 'labels.account': ...``).
    """
    if FAST_LOADER is not None:
        try:
            return _compose(FAST_LOADER, text)
        except yaml.YAMLError as exc:
            if _NESTING in str(getattr(exc, "problem", "") or ""):
                raise  # libyaml's own depth limit, with its line; the pure-Python loader would recurse for seconds
        except (UnicodeError, RecursionError):
            pass  # not swallowed: the pure-Python loader reads it again below and raises its own, exact error
    return _compose(UniqueKeyLoader, text)


def _compose(loader_type: type, text: str) -> tuple[yaml.Node | None, object]:
    loader = loader_type(text)
    try:
        root = loader.get_single_node()
        return root, (loader.construct_document(root) if root is not None else None)
    except ScalarValueError as exc:
        path = path_of(root, exc.node)
        if path:
            exc.problem = f"field '{'.'.join(path)}': {exc.problem}"
        raise
    finally:
        loader.dispose()


def path_of(root: yaml.Node | None, target: yaml.Node) -> list[str]:
    """The keys and indices from ``root`` down to ``target`` (a key's own node ends at that key), as text
    that is always valid Unicode (a lone surrogate is written as its escape); [] when not found."""
    stack: list[tuple[yaml.Node, list[str]]] = [(root, [])] if root is not None else []
    while stack:  # iterative: a deeply nested tree must not overflow the stack
        node, path = stack.pop()
        if node is target:
            return path
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = _escaped(str(getattr(key, "value", "?")))
                if key is target:
                    return path + [name]
                stack.append((value, path + [name]))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, path + [str(i)]) for i, item in enumerate(node.value))
    return []


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def line_of(root: yaml.Node | None, loc: tuple) -> int | None:
    """1-based line of the node at pydantic location ``loc``, or of its nearest parent."""
    node, line = root, (root.start_mark.line + 1 if root is not None else None)
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = [v for k, v in node.value if getattr(k, "value", None) == str(part)]
            if not match:
                break
            key_line = [k for k, _ in node.value if getattr(k, "value", None) == str(part)][0].start_mark.line
            node, line = match[0], key_line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line
