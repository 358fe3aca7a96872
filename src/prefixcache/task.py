"""Task specs: what to classify, into which labels, with which examples.

A task is a YAML file validated by pydantic with unknown keys forbidden. Every
validation failure becomes a :class:`~prefixcache.errors.TaskError` whose
message names the file, the line (when YAML can tell) and the field path.

This module knows nothing about tokenizers or models.
"""

from __future__ import annotations

import string
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import TaskError

BUNDLED_PACKAGE = "prefixcache.tasks"


class Example(BaseModel):
    """One few-shot example: a record's text and its gold label."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = Field(min_length=1)
    label: str


class Task(BaseModel):
    """A classification task.

    Contract: ``labels`` is non-empty, names are non-blank and unique (YAML maps
    already force uniqueness; duplicate keys are rejected by the loader), every
    example's label is in ``labels``, and ``input_template`` names at least one
    record field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    kind: Literal["classify"] = "classify"
    instruction: str = Field(min_length=1)
    labels: dict[str, str] = Field(min_length=2)
    examples: list[Example] = Field(default_factory=list)
    input_template: str = "{text}"
    pin: bool = False

    @field_validator("labels")
    @classmethod
    def _label_names_are_clean(cls, labels: dict[str, str]) -> dict[str, str]:
        for name in labels:
            if not str(name).strip():
                raise ValueError("label names must not be empty")
            if str(name) != str(name).strip():
                raise ValueError(f"label name {name!r} has leading or trailing whitespace")
        return labels

    @field_validator("input_template")
    @classmethod
    def _template_names_fields(cls, template: str) -> str:
        try:
            fields = template_fields(template)
        except ValueError as exc:
            raise ValueError(f"not a valid template: {exc}") from None
        if not fields:
            raise ValueError("must name at least one record field, for example '{text}'")
        return template

    @model_validator(mode="after")
    def _examples_use_known_labels(self) -> Task:
        problems = example_label_problems(self.examples, self.labels)
        if problems:
            raise ValueError(problems[0][1])
        return self

    @property
    def label_names(self) -> list[str]:
        return list(self.labels)

    @property
    def fields(self) -> list[str]:
        """Record fields the input template reads, in order of first use."""
        return template_fields(self.input_template)


def example_label_problems(examples: list[Example], labels: dict[str, str]) -> list[tuple[tuple, str]]:
    """(location, message) for every example whose label is not in the taxonomy."""
    known = ", ".join(labels)
    return [
        (("examples", i, "label"), f"{example.label!r} is not one of the labels ({known})")
        for i, example in enumerate(examples)
        if example.label not in labels
    ]


def template_fields(template: str) -> list[str]:
    """Names of the ``{field}`` slots in a ``str.format`` template, in order, without repeats."""
    names: list[str] = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        if not field.isidentifier():
            raise ValueError(f"field {{{field}}} is not a plain name")
        if field not in names:
            names.append(field)
    return names


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate mapping keys instead of keeping the last one."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen[key] = True
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _line_of(root: yaml.Node | None, loc: tuple) -> int | None:
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


def parse_task(text: str, source: str = "<string>") -> Task:
    """Parse and validate a task from YAML (or JSON) text.

    Raises:
        TaskError: naming ``source``, the line and the field for the first problems found.
    """
    try:
        root = yaml.compose(text, Loader=_UniqueKeyLoader)
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context_mark", None)
        if getattr(exc, "context", None) and context is not None and context is not mark:
            problem += f" ({exc.context} at line {context.line + 1})"
        raise TaskError(f"{where}: invalid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise TaskError(f"{source}: a task file must be a mapping with keys name, instruction, labels, ...")
    try:
        return Task.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                message = "unknown key (allowed: " + ", ".join(_allowed_keys(loc)) + ")"
            if not loc:  # a whole-model check: re-derive the precise locations
                problems += _whole_task_problems(data) or [((), message)]
            else:
                problems.append((loc, message))
        lines = []
        for loc, message in problems:
            line = _line_of(root, loc)
            where = f"{source}:{line}" if line else source
            lines.append(f"{where}: field '{'.'.join(map(str, loc)) or '(task)'}': {message}")
        raise TaskError("invalid task file\n  " + "\n  ".join(lines)) from None


def _whole_task_problems(data: dict) -> list[tuple[tuple, str]]:
    try:
        examples = [Example.model_validate(e) for e in data.get("examples") or []]
    except ValidationError:
        return []
    return example_label_problems(examples, data.get("labels") or {})


def _allowed_keys(loc: tuple) -> list[str]:
    model = Example if "examples" in loc else Task
    return list(model.model_fields)


def bundled_task_names() -> list[str]:
    """Names of the tasks shipped inside the package."""
    root = resources.files(BUNDLED_PACKAGE)
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def load_task(spec: str | Path) -> Task:
    """Load a task by bundled name (``support-tickets``) or by path to a YAML file.

    Raises:
        TaskError: the file is missing or invalid, or the name is unknown.
    """
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.is_file():
            raise TaskError(f"{path}: no such task file")
        return parse_task(path.read_text(encoding="utf-8"), source=str(path))
    resource = resources.files(BUNDLED_PACKAGE) / f"{spec}.yaml"
    if not resource.is_file():
        names = ", ".join(bundled_task_names())
        raise TaskError(f"unknown task {spec!r}: pass a YAML path or one of the bundled tasks ({names})")
    return parse_task(resource.read_text(encoding="utf-8"), source=f"bundled:{spec}.yaml")
