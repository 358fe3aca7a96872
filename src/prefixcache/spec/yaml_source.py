"""Reading a task file's YAML: a safe loader that refuses duplicate keys, one parse for both the data and
the node tree, and the line of a field in that tree (for errors that name the line).

Nothing here knows what a task is; :mod:`prefixcache.spec.task` validates the data.
"""

from __future__ import annotations

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


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def compose_and_construct(text: str) -> tuple[yaml.Node | None, object]:
    """The YAML node tree (for line numbers) and the data built from that same tree: the text is parsed once."""
    loader = UniqueKeyLoader(text)
    try:
        root = loader.get_single_node()
        return root, (loader.construct_document(root) if root is not None else None)
    finally:
        loader.dispose()


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
