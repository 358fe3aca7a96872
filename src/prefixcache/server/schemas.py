"""HTTP bodies (pydantic). Unknown fields are forbidden everywhere except inside an item.

An item is either a plain string (its ``text``) or an object with an optional
``id``, and the record fields the task's ``input_template`` reads (``text``
and any others). Items therefore allow extra keys, but only scalar values
(string or number): nothing nested, nothing that could smuggle structure.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from ..types import Record

Scalar = Union[str, int, float]


class Item(BaseModel):
    """One record: ``{"id": ..., "text": ..., <other template fields>: ...}``."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": {"type": ["string", "number"]}})

    id: str | int | None = Field(default=None, description="Echoed back; defaults to the item's 0-based position.")
    text: str | None = Field(default=None, description="The record's text (most tasks' template reads {text}).")

    @model_validator(mode="after")
    def _extra_fields_are_scalars(self) -> Item:
        for key, value in (self.model_extra or {}).items():
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError(f"field {key!r} must be a string or a number, not {type(value).__name__}")
        return self

    def to_record(self, position: int) -> Record:
        fields: dict[str, Any] = dict(self.model_extra or {})
        if self.text is not None:
            fields["text"] = self.text
        return Record(self.id if self.id is not None else position, fields)


def _item_kind(value: object) -> str:
    return "text" if isinstance(value, str) else "object"


AnyItem = Annotated[Union[Annotated[str, Tag("text")], Annotated[Item, Tag("object")]], Discriminator(_item_kind)]
"""A string or an :class:`Item`; validation errors point at ``items.<i>.text`` or ``items.<i>.object.<field>``."""


class ItemsRequest(BaseModel):
    """``POST /v1/classify`` and ``POST /v1/extract``."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field(min_length=1, description="A registered task's name (GET /v1/tasks).")
    items: list[AnyItem] = Field(min_length=1, description="Strings, or objects with id and fields.")

    def records(self) -> list[Record]:
        return [
            Record(i, {"text": item}) if isinstance(item, str) else item.to_record(i) for i, item in enumerate(self.items)
        ]


class UsageOut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefix_tokens_reused: int = Field(description="Stored-prefix tokens the request's items did not recompute.")
    suffix_tokens: int = Field(description="Tokens computed for the items themselves.")


class ClassifyResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | int
    label: str
    scores: dict[str, float] = Field(description="Probability of each label (they sum to 1).")
    margin: float = Field(description="Log-probability gap between the best and the second-best label.")
    warning: str | None = Field(
        default=None, description="Present when the item's text is empty or only whitespace: the label is the model's guess without it."
    )
    truncated: bool | None = Field(default=None, description="Present (true) when a field was cut to fit the model's context.")


class ClassifyResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    results: list[ClassifyResult]
    usage: UsageOut


class ExtractResult(BaseModel):
    """One item's extraction (:meth:`prefixcache.run.extract.Extraction.to_json`)."""

    model_config = ConfigDict(extra="forbid")

    id: str | int
    fields: dict[str, Any] | None = Field(
        description="The declared fields found in the output (possibly some of them); null when no JSON object was found."
    )
    raw: str | None = Field(description="The generated text (cut before a stop string).")
    error: str | None = Field(description="Why the output is not a JSON object with every declared field; null when it is.")


class ExtractResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    results: list[ExtractResult]
    usage: UsageOut


class TaskInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    kind: str = Field(description="classify (POST /v1/classify) or extract (POST /v1/extract).")
    labels: list[str] = Field(description="classify tasks: the labels; empty for extract tasks.")
    fields: list[str] | None = Field(default=None, description="extract tasks: the declared output fields.")
    input_fields: list[str]
    method: str | None = Field(description="classify tasks: the label scoring method.")
    head: dict | None = Field(default=None, description=(
        "classify tasks scored by a fitted label head: its feature, labels, training rows and cross-validated "
        "figures; null when the prompt's own label scores are used."))
    max_new_tokens: int | None = Field(default=None, description="extract tasks: most tokens generated per item.")
    prefix_tokens: int
    prefix_bytes: int


class TaskList(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: list[TaskInfo]


class Health(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: str
    tasks: int


class Stats(BaseModel):
    """The live figures of the web page."""

    model_config = ConfigDict(extra="forbid")

    items_total: int
    items_per_second: float
    requests_total: int
    batches_total: int
    mean_batch_size: float | None
    prefix_hit_rate: float | None
    queue_depth: int = Field(description="Items waiting for a pass.")
    in_progress: int = Field(description="Items admitted and not yet answered (the --max-queue bound).")
    tasks: int


class ErrorOut(BaseModel):
    """Every error answer: a message, or (a request that breaks the schema, status 422) FastAPI's list of
    the fields at fault."""

    model_config = ConfigDict(extra="forbid")

    detail: str | list[dict[str, Any]]
    item: int | None = Field(default=None, description="0-based index of the item at fault, when one is.")
