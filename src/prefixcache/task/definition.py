"""Task specs: what to classify, into which labels, with which examples.

A task is a YAML file validated by pydantic with unknown keys forbidden. Every
validation failure becomes a :class:`~prefixcache.errors.TaskError` whose
message names the file, the line (when YAML can tell) and the field path.

This module knows nothing about tokenizers or models.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Callable, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import TaskError
from .chat_template import checked_template
from .input_template import checked_input_template, template_fields
from .fields import FieldDecl, example_value_problems, located_value_problems
from .yaml_source import compose_and_construct, line_of

BUNDLED_PACKAGE = "prefixcache.tasks"


class Example(BaseModel):
    """One few-shot example: a record's text and its gold label."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = Field(min_length=1)
    label: str


class Selection(BaseModel):
    """How to pick few-shot examples from a task's ``example_pool``.

    ``per_label`` pool examples of every label are added to the task's own
    ``examples``, drawn in an order shuffled by ``seed`` (see
    :mod:`prefixcache.task.selection`, which does the picking).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    per_label: int = Field(ge=0)
    seed: int = 0


# a Jinja chat template to lay a task's prompt out with, in place of the tokenizer's (a pretrained model has none)
ChatTemplate = Annotated[str, Field(min_length=1), AfterValidator(checked_template)]
# a record's text as the model sees it: ``str.format`` slots naming the record's fields, at least one
InputTemplate = Annotated[str, AfterValidator(checked_input_template)]


class Task(BaseModel):
    """A classification task.

    Contract: ``labels`` is non-empty, names are non-blank and unique (YAML maps
    already force uniqueness; duplicate keys are rejected by the loader), every
    example's label is in ``labels``, and ``input_template`` names at least one
    record field.

    ``example_pool`` holds extra labelled examples that are not shown as they
    are: ``select`` picks some of them per label (and ``prefixcache eval
    --sweep-examples`` draws growing numbers from ``examples`` + pool). When
    ``select`` is set the pool holds at least ``select.per_label`` examples of
    every label. :func:`prefixcache.task.selection.resolve_examples` turns such a
    task into one whose ``examples`` are exactly the prompt's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    kind: Literal["classify"] = "classify"
    instruction: str = Field(min_length=1)
    labels: dict[str, str] = Field(min_length=2)
    examples: list[Example] = Field(default_factory=list)
    example_pool: list[Example] = Field(default_factory=list)
    select: Selection | None = None
    input_template: InputTemplate = "{text}"
    pin: bool = False
    head: str | None = Field(default=None, min_length=1)  # a fitted label head file; relative to the task file
    # a prompt-only calibration file (`prefixcache fit --prompt-only`); relative to the task file
    calibration: str | None = Field(default=None, min_length=1)
    min_confidence: float | None = Field(default=None, ge=0.0, le=1.0)  # abstain under this confidence
    target_accuracy: float | None = Field(default=None, gt=0.0, le=1.0)  # abstain so that accepted rows reach it
    chat_template: ChatTemplate | None = None

    @field_validator("labels")
    @classmethod
    def _label_names_are_clean(cls, labels: dict[str, str]) -> dict[str, str]:
        for name in labels:
            if not str(name).strip():
                raise ValueError("label names must not be empty")
            if str(name) != str(name).strip():
                raise ValueError(f"label name {name!r} has leading or trailing whitespace")
        return labels

    @model_validator(mode="after")
    def _one_threshold(self) -> Task:
        if self.min_confidence is not None and self.target_accuracy is not None:
            raise ValueError("give min_confidence or target_accuracy, not both")
        return self

    @model_validator(mode="after")
    def _examples_use_known_labels(self) -> Task:
        problems = example_label_problems(self.examples, self.labels) + pool_problems(
            self.example_pool, self.select, self.labels
        )
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


def example_label_problems(
    examples: list[Example], labels: dict[str, str], key: str = "examples"
) -> list[tuple[tuple, str]]:
    """(location, message) for every example whose label is not in the taxonomy."""
    known = ", ".join(labels)
    return [
        ((key, i, "label"), f"{example.label!r} is not one of the labels ({known})")
        for i, example in enumerate(examples)
        if example.label not in labels
    ]


def pool_problems(pool: list[Example], select: Selection | None, labels: dict[str, str]) -> list[tuple[tuple, str]]:
    """(location, message) for an example pool with unknown labels, or too small for ``select``."""
    problems = example_label_problems(pool, labels, key="example_pool")
    if select is None or problems:
        return problems
    if not pool:
        return [(("select",), "needs an example_pool to select from (or remove select)")]
    counts = {label: sum(e.label == label for e in pool) for label in labels}
    short = {label: n for label, n in counts.items() if n < select.per_label}
    if short:
        have = ", ".join(f"{label} {n}" for label, n in short.items())
        problems.append(
            (
                ("select", "per_label"),
                f"asks for {select.per_label} examples per label but example_pool has only: {have}",
            )
        )
    return problems


class FieldExample(BaseModel):
    """One few-shot example of an extraction task: a record's text and the field values to extract from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = Field(min_length=1)
    fields: dict[str, str | int | float | bool | None]


class ExtractTask(BaseModel):
    """An extraction task (``kind: extract``): the model answers with one JSON object of the declared ``fields``.

    Contract: ``fields`` (name -> :class:`~prefixcache.task.fields.FieldDecl`; a plain description declares a
    ``text`` field) is non-empty with clean names; every example gives a value (possibly null) for exactly the
    declared fields, each fitting its kind; ``input_template`` names a record field; ``stop`` strings are non-empty.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    kind: Literal["extract"]
    instruction: str = Field(min_length=1)
    fields: dict[str, FieldDecl] = Field(min_length=1)
    examples: list[FieldExample] = Field(default_factory=list)
    input_template: InputTemplate = "{text}"
    max_new_tokens: int = Field(default=64, ge=1, le=4096)
    stop: list[str] = Field(default_factory=list)
    pin: bool = False
    chat_template: ChatTemplate | None = None

    @field_validator("fields")
    @classmethod
    def _field_names_are_clean(cls, fields: dict[str, FieldDecl]) -> dict[str, FieldDecl]:
        for name in (n for n in fields if not str(n).strip() or str(n) != str(n).strip()):
            raise ValueError(f"field name {name!r} is empty or has leading or trailing whitespace")
        return fields

    @field_validator("stop")
    @classmethod
    def _stops_are_not_empty(cls, stop: list[str]) -> list[str]:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("examples")
    @classmethod
    def _examples_give_declared_fields(cls, examples: list[FieldExample], info) -> list[FieldExample]:
        declared = list(info.data.get("fields") or {})
        for i, example in enumerate(examples):
            missing = [f for f in declared if f not in example.fields]
            extra = [f for f in example.fields if f not in declared]
            if missing or extra:
                raise ValueError(f"example {i} {f'lacks {missing}' if missing else f'has undeclared {extra}'} "
                                 f"(declared fields: {', '.join(declared)})")
        for _, problem in example_value_problems(info.data.get("fields") or {}, examples)[:1]:
            raise ValueError(problem)
        return examples

    def kind_of(self, name: str) -> str:
        """The kind of declared field ``name``."""
        return self.fields[name].kind

    def names_of_kind(self, kind: str) -> list[str]:
        """Declared fields of ``kind``, in declared order."""
        return [name for name, decl in self.fields.items() if decl.kind == kind]

    @property
    def input_fields(self) -> list[str]:
        """Record fields the input template reads, in order of first use."""
        return template_fields(self.input_template)


TASK_KINDS: dict[str, type[BaseModel]] = {"classify": Task, "extract": ExtractTask}
"""``kind:`` in a task file -> the model that validates it."""


MAX_REPORTED_PROBLEMS = 20  # a task file's problems named in one error; the rest are counted


def parse_task(
    text: str, source: str = "<string>", kinds: tuple[str, ...] = ("classify",),
    check: Callable[[dict], None] | None = None,
) -> Task:
    """Parse and validate a task from YAML (or JSON) text. ``kinds``: the task kinds the caller accepts.

    ``check(data)``, when given, sees the parsed mapping before it is validated (a caller's own limits,
    such as the server's caps on labels and examples); what it raises propagates unchanged.

    Raises:
        TaskError: naming ``source``, the line and the field for the first problems found,
            or saying which command runs a task of another kind.
    """
    try:
        root, data = compose_and_construct(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context_mark", None)
        if getattr(exc, "context", None) and context is not None and context is not mark:
            problem += f" ({exc.context} at line {context.line + 1})"
        raise TaskError(f"{where}: invalid YAML: {problem}") from None
    except RecursionError:
        raise TaskError(f"{source}: invalid YAML: nested too deeply") from None
    if not isinstance(data, dict):
        raise TaskError(f"{source}: a task file must be a mapping with keys name, instruction, labels, ...")
    if check is not None:
        check(data)
    model = _task_model(data, source, kinds)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                message = "unknown key (allowed: " + ", ".join(_allowed_keys(loc, model)) + ")"
            if not loc:  # a whole-model check: re-derive the precise locations
                problems += _whole_task_problems(data) or [((), message)]
            elif model is ExtractTask and loc == ("examples",):  # the same, for example values of the wrong kind
                problems += located_value_problems(data, FieldExample) or [(loc, message)]
            else:
                problems.append((loc, message))
        lines = []
        for loc, message in problems[:MAX_REPORTED_PROBLEMS]:  # each is located by a walk of the file's nodes
            line = line_of(root, loc)
            where = f"{source}:{line}" if line else source
            lines.append(f"{where}: field '{'.'.join(map(str, loc)) or '(task)'}': {message}")
        if len(problems) > MAX_REPORTED_PROBLEMS:
            lines.append(f"... and {len(problems) - MAX_REPORTED_PROBLEMS} more problems")
        raise TaskError("invalid task file\n  " + "\n  ".join(lines)) from None


def _whole_task_problems(data: dict) -> list[tuple[tuple, str]]:
    try:
        examples = [Example.model_validate(e) for e in data.get("examples") or []]
        pool = [Example.model_validate(e) for e in data.get("example_pool") or []]
        select = Selection.model_validate(data["select"]) if data.get("select") is not None else None
    except ValidationError:
        return []
    labels = data.get("labels") or {}
    return example_label_problems(examples, labels) + pool_problems(pool, select, labels)


def _task_model(data: dict, source: str, kinds: tuple[str, ...]) -> type[BaseModel]:
    """The model for ``data``'s ``kind`` (default ``classify``); unknown kinds fall to Task, which names them."""
    kind = data.get("kind", "classify")
    if not isinstance(kind, str):
        return Task  # its `kind` field names the problem
    if kind in TASK_KINDS and kind not in kinds:
        raise TaskError(f"{source}: task {data.get('name')!r} has kind: {kind}; run it with `prefixcache {kind}`")
    return TASK_KINDS.get(kind, Task)


def _allowed_keys(loc: tuple, model: type[BaseModel] = Task) -> list[str]:
    if model is not Task:
        if "examples" in loc:
            return list(FieldExample.model_fields)
        return list((FieldDecl if "fields" in loc else model).model_fields)
    if "examples" in loc or "example_pool" in loc:
        model = Example
    elif "select" in loc:
        model = Selection
    else:
        model = Task
    return list(model.model_fields)


def bundled_task_names(kinds: tuple[str, ...] = ("classify",)) -> list[str]:
    """Names of the tasks of ``kinds`` shipped inside the package (the kind is read from each file's ``kind:`` line)."""
    root = resources.files(BUNDLED_PACKAGE)
    files = [p for p in root.iterdir() if p.name.endswith(".yaml")]
    return sorted(p.name.removesuffix(".yaml") for p in files if _declared_kind(p.read_text(encoding="utf-8")) in kinds)


def _declared_kind(text: str) -> str:
    match = re.search(r"^kind:\s*['\"]?([A-Za-z_]+)", text, flags=re.MULTILINE)
    return match.group(1) if match else "classify"


def load_any_task(spec: str | Path) -> Task | ExtractTask:
    """Like :func:`load_task`, for a task of any kind (classify or extract)."""
    return load_task(spec, kinds=tuple(TASK_KINDS))


def load_task(spec: str | Path, kinds: tuple[str, ...] = ("classify",)) -> Task:
    """Load a task by bundled name (``support-tickets``) or by path to a YAML file.

    Raises:
        TaskError: the file is missing or invalid, or the name is unknown.
    """
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.is_file():
            raise TaskError(f"{path}: no such task file")
        return _head_beside(parse_task(path.read_text(encoding="utf-8"), source=str(path), kinds=kinds), path.parent)
    resource = resources.files(BUNDLED_PACKAGE) / f"{spec}.yaml"
    if not resource.is_file():
        names = ", ".join(bundled_task_names(kinds))
        raise TaskError(f"unknown task {spec!r}: pass a YAML path or one of the bundled tasks ({names})")
    task = parse_task(resource.read_text(encoding="utf-8"), source=f"bundled:{spec}.yaml", kinds=kinds)
    return _head_beside(task, Path(str(resources.files(BUNDLED_PACKAGE))))


def _head_beside(task, folder: Path):
    """``task`` with relative ``head:`` and ``calibration:`` paths resolved against the task file's ``folder``."""
    calibration = getattr(task, "calibration", None)
    if calibration is not None and not Path(calibration).is_absolute():
        task = task.model_copy(update={"calibration": str(folder / calibration)})
    head = getattr(task, "head", None)
    if head is None or Path(head).is_absolute():
        return task
    return task.model_copy(update={"head": str(folder / head)})
