"""HTTP bodies (pydantic). Unknown fields are forbidden everywhere except inside an item.

An item is either a plain string (its ``text``) or an object with an optional
``id``, and the record fields the task's ``input_template`` reads (``text``
and any others). Items therefore allow extra keys, but only scalar values
(string or number): nothing nested, nothing that could smuggle structure.

Every text must be valid Unicode (a lone surrogate, JSON's ``"\\ud800"``, is refused: UTF-8 cannot carry
it back and the tokenizer cannot take it), and every number finite (Python's JSON reader takes ``NaN`` and
``Infinity``; JSON itself has neither). Such values answer 422 naming the field, never 500.

A 422 for a body that breaks the schema is FastAPI's list of errors made safe to send
(:func:`validation_error_body`): each keeps ``type``, ``loc`` and ``msg`` and gains ``field``
(``items[2].text``); the echoed ``input`` and ``ctx`` are left out.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Sequence, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, PlainValidator, Tag, WithJsonSchema, model_serializer

from ..types import Record

Scalar = Union[str, int, float]


def _valid_text(value: str) -> str:
    """``value``, if UTF-8 can carry it. Raises ValueError naming the first lone surrogate."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"is not valid Unicode: a lone surrogate ({safe_text(value[exc.start])}) at character {exc.start}; "
            "send the character itself, or a surrogate pair"
        ) from None
    return value


def _valid_id(value: object) -> str | int | None:
    """An item's id: valid text, an integer (an integral float such as 3.0 reads as 3), or null."""
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"must be a string or an integer, not {_kind(value)}")
    return _valid_text(value) if isinstance(value, str) else value


def _valid_field(value: object) -> str | int | float:
    """A record field beside ``text``: valid text, an integer or a finite number."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"must be a string or a number, not {_kind(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number, not {value}")
    return _valid_text(value) if isinstance(value, str) else value


def _kind(value: object) -> str:
    return {float: "a number that is not finite or whole", type(None): "null"}.get(type(value), type(value).__name__)


Text = Annotated[str, AfterValidator(_valid_text)]
ItemId = Annotated[
    Union[str, int, None], PlainValidator(_valid_id),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}),
]
FieldValue = Annotated[Scalar, PlainValidator(_valid_field)]


class Item(BaseModel):
    """One record: ``{"id": ..., "text": ..., <other template fields>: ...}``."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": {"type": ["string", "number"]}})

    __pydantic_extra__: dict[str, FieldValue]  # each extra field is checked under its own name (loc); pydantic
    # itself refuses a field name that is not valid Unicode

    id: ItemId = Field(default=None, description="Echoed back; defaults to the item's 0-based position.")
    text: Text | None = Field(default=None, description="The record's text (most tasks' template reads {text}).")

    def to_record(self, position: int) -> Record:
        fields: dict[str, Any] = dict(self.model_extra or {})
        if self.text is not None:
            fields["text"] = self.text
        return Record(self.id if self.id is not None else position, fields)


def _item_kind(value: object) -> str:
    return "text" if isinstance(value, str) else "object"


AnyItem = Annotated[Union[Annotated[Text, Tag("text")], Annotated[Item, Tag("object")]], Discriminator(_item_kind)]
"""A string or an :class:`Item`; validation errors point at ``items.<i>.text`` or ``items.<i>.object.<field>``."""


class ItemsRequest(BaseModel):
    """``POST /v1/classify`` and ``POST /v1/extract``."""

    model_config = ConfigDict(extra="forbid")

    task: Text = Field(min_length=1, description="A registered task's name (GET /v1/tasks).")
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
    label: str | None = Field(description="The label; null when the item abstained (see abstained).")
    confidence: float = Field(description="Probability of the best label, calibrated when the task's head or "
                              "calibration file carries a calibration.")
    scores: dict[str, float] = Field(description="Probability of each label (they sum to 1).")
    abstained: bool | None = Field(default=None, description="Present (true) when the confidence is under the task's "
                                   "threshold: label is null and best_guess holds the best label.")
    best_guess: str | None = Field(default=None, description="Present with abstained: the best label.")
    margin: float = Field(description="Log-probability gap between the best and the second-best label.")
    warning: str | None = Field(
        default=None, description="Present when the item's text is empty or only whitespace: the label is the model's guess without it."
    )
    truncated: bool | None = Field(default=None, description="Present (true) when a field was cut to fit the model's context.")

    @model_serializer(mode="wrap")
    def _label_always(self, handler):
        """``label`` stays in the answer as null when the item abstained (the route drops other absent keys)."""
        document = handler(self)
        document.setdefault("label", None)
        return document


class ClassifyResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    results: list[ClassifyResult]
    usage: UsageOut


class ExtractResult(BaseModel):
    """One item's extraction (:meth:`prefixcache.scheduler.extract.Extraction.to_json`)."""

    model_config = ConfigDict(extra="forbid")

    id: str | int
    fields: dict[str, Any] | None = Field(
        description="The declared fields found in the output (possibly some of them); null when no JSON object was found."
    )
    raw: str | None = Field(description="The generated text (cut before a stop string).")
    error: str | None = Field(description="Why the output is not a JSON object with every declared field; null when it is.")
    confidence: dict[str, float | None] | None = Field(
        default=None, description="Per field, the probability of its value (a choice field's head's, when it has one)."
    )
    flagged: list[str] = Field(default_factory=list, description="Fields left null for being under their threshold.")


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


LOCATIONS = ("body", "query", "path", "header", "cookie")


def validation_error_body(errors: Sequence[dict]) -> dict:
    """The 422 body for FastAPI's ``RequestValidationError.errors()``, safe to encode whatever was sent.

    Each error keeps ``type``, ``loc`` and ``msg`` and gains ``field`` (:func:`field_name`). The echoed
    ``input`` and ``ctx`` are dropped: they may hold NaN (which JSON cannot carry), a lone surrogate (which
    UTF-8 cannot) or most of a large body. Strings in ``loc`` and ``msg`` are made valid text (:func:`safe_text`).
    """
    detail = []
    for error in errors:
        loc = [part if isinstance(part, int) else safe_text(str(part)) for part in error.get("loc", ())]
        field = "body" if error.get("type") == "json_invalid" else field_name(loc)
        detail.append({"type": error.get("type"), "loc": loc, "msg": safe_text(str(error.get("msg", ""))), "field": field})
    return {"detail": detail}


def field_name(loc: Sequence[str | int]) -> str:
    """``("body", "items", 2, "object", "text")`` -> ``items[2].text``: the place (``body``, ``path``, ...) and
    the tag that says an item was read as an object are left out; indices are bracketed."""
    parts = list(loc[1:] if loc and loc[0] in LOCATIONS else loc)
    name = ""
    for i, part in enumerate(parts):
        if isinstance(part, int):
            name += f"[{part}]"
        elif part == "object" and i >= 2 and isinstance(parts[i - 1], int) and parts[i - 2] == "items":
            continue
        else:
            name += f".{part}" if name else str(part)
    return name or (str(loc[0]) if loc else "body")


def safe_text(text: str) -> str:
    """``text`` with any lone surrogate written as its escape (``\\ud800``), so that UTF-8 can carry it."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
