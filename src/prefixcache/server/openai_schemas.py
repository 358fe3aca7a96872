"""Request and response bodies of the OpenAI-compatible routes, as pydantic models.

Requests forbid unknown fields: a field this server does not support is a 400 naming it, never
silently ignored (:func:`parse_request`). Fields OpenAI defines but this server cannot honour are
accepted only at their neutral value (``n: 1``, penalties 0, ``echo: false``). vLLM's guided decoding
arrives as extra body fields: ``guided_choice`` and the newer ``structured_outputs: {"choice": [...]}``.
``response_format`` is OpenAI's: ``text``, ``json_object``, or ``json_schema`` with ``{name, schema, strict}``.

Responses follow OpenAI's shapes, plus two fields vLLM-style servers add: ``choice_logprobs`` (each
choice's log-prob under guided choice) and ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import RequestFieldError


StopText = Annotated[str, Field(min_length=1, max_length=256)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


ChoiceList = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=2, max_length=256, json_schema_extra={"uniqueItems": True})]


class StructuredOutputs(_Strict):
    choice: ChoiceList


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``. ``strict`` is accepted either way: the schema is always enforced."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self


class _Common(_Strict):
    """Fields both routes share."""

    model: str = Field(max_length=256)
    stop: StopText | Annotated[list[StopText], Field(max_length=4)] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    n: Literal[1] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Literal[0] | None = None
    frequency_penalty: Literal[0] | None = None
    user: str | None = Field(default=None, max_length=256)  # the caller's end user: accepted, not used
    guided_choice: ChoiceList | None = None
    structured_outputs: StructuredOutputs | None = None

    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def choices(self) -> tuple[str, list[str]] | None:
        """The guided choices and the field they came in (``None``: free generation)."""
        if self.guided_choice is not None and self.structured_outputs is not None:
            raise RequestFieldError("send guided_choice or structured_outputs, not both", param="structured_outputs")
        if self.guided_choice is not None:
            return "guided_choice", self.guided_choice
        if self.structured_outputs is not None:
            return "structured_outputs.choice", self.structured_outputs.choice
        return None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=512)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] | None = None


# --- responses ---------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


FinishReason = Literal["stop", "length"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None
    choice_logprobs: dict[str, float] | None = None
    confidence: float | None = None  # guided choice: the chosen option's probability among the options


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None = None
    choice_logprobs: dict[str, float] | None = None
    confidence: float | None = None  # guided choice: the chosen option's probability among the options


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prefixcache"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    error: OpenAIErrorBody


# --- parsing -----------------------------------------------------------------------------------------------


def parse_request(kind: type[_Common], body: bytes) -> _Common:
    """``body`` as a ``kind`` request.

    Raises:
        RequestFieldError: the body is not a JSON object (NaN and infinities included), or a field is
            unknown, missing or out of range; ``param`` names the first such field (``messages[1].role``).
    """
    try:
        return _parse(kind, body)
    except RecursionError:  # json, the text check or pydantic ran out of stack on a deeply nested body
        raise RequestFieldError(f"the body is nested deeper than this server parses (at most about {MAX_DEPTH} "
                                "levels); flatten it") from None


def _parse(kind: type[_Common], body: bytes) -> _Common:
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestFieldError(f"the body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise RequestFieldError("the body must be a JSON object")
    if _depth(data) > MAX_DEPTH:
        raise RequestFieldError(f"the body is nested deeper than {MAX_DEPTH} levels; flatten it")
    _check_text(data, "")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        param = _param(first["loc"])
        if first["type"] == "extra_forbidden":
            raise RequestFieldError(f"unsupported field {param!r}: this server does not implement it", param=param) from None
        raise RequestFieldError(f"field {param!r}: {first['msg']}", param=param) from None


MAX_DEPTH = 64  # the deepest nesting a body may have (a schema in response_format is the deepest real one)


def _depth(value) -> int:
    """How deeply ``value`` nests lists and objects (iterative: a hostile depth cannot exhaust the stack here)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _check_text(value, path: str) -> None:
    """Refuse a string that is not valid Unicode text (a lone surrogate such as ``\\ud800``), naming where it is."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestFieldError(f"field {path or 'body'!r} is not valid Unicode text (a lone surrogate)", param=path) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path)
            _check_text(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{path}[{i}]")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _param(loc: tuple) -> str:
    """``("messages", 1, "role")`` -> ``messages[1].role`` (pydantic's union branch names dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not any(ch in part for ch in "[]()-") and part not in ("str", "int"):
            out += ("." if out else "") + part
    return out or "body"


def finite(value: float) -> float:
    """A log-prob as JSON can carry it (``-inf`` becomes the most negative float)."""
    return value if math.isfinite(value) else -3.4e38
