"""From a parsed OpenAI-style request to a runner and an item (on a prep thread), and from a result to a response.

:func:`plan` renders and tokenizes the prompt with the prep thread's tokenizer, checks it against the
model's context and the server's limits (a 400 naming the field), and picks the runner: guided choice
when the request names choices, else generation with its decoding settings and, for a ``response_format``
of ``json_object`` or ``json_schema``, its schema compiled as a decoding constraint (an invalid schema is a
400 naming ``response_format``). The response builders turn a runner's result into OpenAI's shapes.
Nothing here runs the model.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from ..engine.constraint import ANY_OBJECT, ConstrainedRows, JsonConstraint, json_constraint
from ..engine.generate import GenerationConfig, eos_ids_of
from ..engine.sampling import Sampling, TokenLogprob
from ..errors import ConstraintError, RequestFieldError
from ..task.chat import WholePrompt, chat_prompt, choices_after, text_prompt
from ..model.context_window import context_limit
from .openai_runners import OpenAIRunners, PromptItem
from .openai_schemas import (
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionRequest, ChoiceLogprobs, Completion, CompletionChoice,
    CompletionLogprobs, CompletionRequest, PromptTokensDetails, TokenLogprobOut, TopLogprob, Usage, finite,
)
from .settings import ServerSettings

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request names none
DEFAULT_CHAT_TOKENS = 256  # a chat request without max_tokens generates at most this many (and never past the context)


@dataclass(frozen=True)
class Plan:
    """What one request runs: ``runner`` (shared with requests of the same key) and its ``item``."""

    runner: object
    item: PromptItem
    guided: bool
    stops: tuple[str, ...]


def plan(runners: OpenAIRunners, settings: ServerSettings, tokenizer, request: ChatCompletionRequest | CompletionRequest) -> Plan:
    """The runner and item for ``request``. Call on a prep thread with a tokenizer it holds alone.

    Raises:
        RequestFieldError: naming the field: a prompt or output that does not fit the model's context or the
            server's limits, bad choices, or a field combination this server does not support.
        RequestTooLargeError: naming the prompt's field: a generation whose prompt and ``max_tokens`` need more
            keys/values than the cache budget can hold for one request.
        LabelCollisionError: the server's method is ``first-token`` and two choices share a first token.
    """
    _refuse_unsupported(request)
    if isinstance(request, ChatCompletionRequest):
        prompt = chat_prompt(tokenizer, [{"role": m.role, "content": m.text()} for m in request.messages], runners.earlier)
        field = "messages"
    else:
        prompt = text_prompt(tokenizer, request.prompt)
        field = "prompt"
    _check_prompt(prompt, field, settings)
    choices = request.choices()
    constraint = response_constraint(request)
    if choices is not None:
        param, options = choices
        if constraint is not None:
            raise RequestFieldError(f"send {param} or a JSON response_format, not both", param="response_format")
        runner = runners.choice(prompt, _capped_choices(tokenizer, prompt, options, param, settings))
        return Plan(runner, PromptItem(prompt), True, ())
    config = GenerationConfig(
        max_new_tokens=_token_limit(request, prompt, runners), stop=request.stops(),
        eos_ids=eos_ids_of(runners.loaded.model, tokenizer),
    )
    runners.kv_room.check_prompt(len(prompt.ids), config.max_new_tokens, field)  # 413 before any work
    if constraint is not None:
        _check_answerable(constraint, tokenizer, config)
    runner = runners.generate(prompt, config, _sampling(request), constraint)
    return Plan(runner, PromptItem(prompt), False, config.stop)


def _check_answerable(constraint: JsonConstraint, tokenizer, config: GenerationConfig) -> None:
    """Refuse, before any decoding, a schema whose grammar has no complete answer within ``max_tokens``.

    Raises:
        RequestFieldError: naming ``response_format`` (and ``max_tokens`` when a longer budget would do).
    """
    try:
        ConstrainedRows(constraint, tokenizer, 1, config.eos_ids, config.max_new_tokens).check_answerable()
    except ConstraintError as exc:
        raise RequestFieldError(f"response_format: {exc}", param="response_format") from None


def _capped_choices(tokenizer, prompt: WholePrompt, options, param: str, settings: ServerSettings):
    """The choices' tokens after ``prompt``, within ``max_choice_chars`` each and ``max_choice_tokens`` together.

    Raises:
        RequestFieldError: naming the choice (or ``param``) and the setting it breaks.
    """
    for i, option in enumerate(options):
        if len(option) > settings.max_choice_chars:
            raise RequestFieldError(f"{param}[{i}] has {len(option)} characters, more than this server's "
                                    f"max_choice_chars={settings.max_choice_chars}; shorten it", param=f"{param}[{i}]")
    choices = choices_after(tokenizer, prompt, options, param)
    total = sum(len(ids) for ids in choices.label_ids.values())
    if total > settings.max_choice_tokens:
        raise RequestFieldError(f"the {param} take {total} tokens together, more than this server's "
                                f"max_choice_tokens={settings.max_choice_tokens}; send fewer or shorter choices", param=param)
    return choices


def response_constraint(request: ChatCompletionRequest | CompletionRequest) -> JsonConstraint | None:
    """The decoding constraint ``response_format`` asks for (None: free text). Compiled schemas are cached.

    Raises:
        RequestFieldError: naming ``response_format``: the schema is invalid, unsatisfiable or unsupported.
    """
    form = request.response_format if isinstance(request, ChatCompletionRequest) else None
    if form is None or form.type == "text":
        return None
    schema = ANY_OBJECT if form.type == "json_object" else form.json_schema.schema_
    try:
        return json_constraint(schema)
    except ConstraintError as exc:
        raise RequestFieldError(f"response_format: {exc}", param="response_format") from None


def _refuse_unsupported(request: ChatCompletionRequest | CompletionRequest) -> None:
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise RequestFieldError("top_logprobs needs logprobs: true", param="top_logprobs")
    wants_logprobs = bool(request.logprobs) or (isinstance(request, CompletionRequest) and request.logprobs is not None)
    if request.stream and wants_logprobs:
        raise RequestFieldError("logprobs are not supported with stream: true; drop one", param="logprobs")
    if request.stream_options is not None and not request.stream:
        raise RequestFieldError("stream_options needs stream: true", param="stream_options")


def _check_prompt(prompt: WholePrompt, field: str, settings: ServerSettings) -> None:
    most = settings.max_prefix_tokens + settings.max_item_tokens
    if len(prompt.ids) > most:
        raise RequestFieldError(
            f"the prompt has {len(prompt.ids)} tokens, more than this server takes (max_prefix_tokens + "
            f"max_item_tokens = {most}); shorten it", param=field,
        )


def _token_limit(request: ChatCompletionRequest | CompletionRequest, prompt: WholePrompt, runners: OpenAIRunners) -> int:
    """``max_tokens`` (or the default), checked against what the model's context leaves after the prompt."""
    asked = request.token_limit() if isinstance(request, ChatCompletionRequest) else request.max_tokens
    context = context_limit(runners.loaded.model)
    room = None if context is None else context - len(prompt.ids)
    if room is not None and room < 1:
        raise RequestFieldError(f"the prompt's {len(prompt.ids)} tokens fill the model's {context}-token context", param="messages")
    if asked is None:
        return DEFAULT_CHAT_TOKENS if room is None else min(DEFAULT_CHAT_TOKENS, room)
    if room is not None and asked > room:
        raise RequestFieldError(
            f"max_tokens={asked} does not fit: the model's context is {context} tokens and the prompt takes "
            f"{len(prompt.ids)}; ask for at most {room}", param="max_tokens",
        )
    return asked


def _sampling(request: ChatCompletionRequest | CompletionRequest) -> Sampling:
    temperature = DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
    if isinstance(request, ChatCompletionRequest):
        top = (request.top_logprobs or 0) if request.logprobs else None
    else:
        top = request.logprobs
    return Sampling(temperature, 1.0 if request.top_p is None else request.top_p, request.seed, top)


# --- responses ---------------------------------------------------------------------------------------------


def usage_of(result: dict) -> Usage:
    prompt, completion = result["prompt_tokens"], result["completion_tokens"]
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=result["cached_tokens"]))


def choice_confidence(result: dict) -> float | None:
    """A guided choice's confidence: the probability of the chosen option among the options (None: no choices)."""
    logprobs = result.get("choice_logprobs")
    return round(math.exp(max(logprobs.values())), 6) if logprobs else None


def response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def chat_response(result: dict, model: str, tokenizer) -> ChatCompletion:
    """A chat completion from a runner's result (``tokenizer`` spells the log-probs' tokens)."""
    logprobs = result.get("logprobs")
    choice = ChatChoice(
        index=0, message=AssistantMessage(content=result["text"]), finish_reason=result["finish"],
        logprobs=ChoiceLogprobs(content=[_chat_logprob(tokenizer, lp) for lp in logprobs]) if logprobs else None,
        choice_logprobs=result.get("choice_logprobs"), confidence=choice_confidence(result),
    )
    return ChatCompletion(id=response_id("chatcmpl"), created=int(time.time()), model=model, choices=[choice],
                          usage=usage_of(result))


def completion_response(result: dict, model: str, tokenizer) -> Completion:
    """A text completion from a runner's result (``tokenizer`` spells the log-probs' tokens)."""
    logprobs = result.get("logprobs")
    choice = CompletionChoice(
        index=0, text=result["text"], finish_reason=result["finish"],
        logprobs=_completion_logprobs(tokenizer, logprobs) if logprobs else None,
        choice_logprobs=result.get("choice_logprobs"), confidence=choice_confidence(result),
    )
    return Completion(id=response_id("cmpl"), created=int(time.time()), model=model, choices=[choice], usage=usage_of(result))


def _spell(tokenizer, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token_id])
    return text, list(text.encode("utf-8", errors="surrogatepass"))


def _chat_logprob(tokenizer, lp: TokenLogprob) -> TokenLogprobOut:
    token, raw = _spell(tokenizer, lp.token_id)
    top = []
    for token_id, value in lp.top:
        text, text_bytes = _spell(tokenizer, token_id)
        top.append(TopLogprob(token=text, logprob=finite(value), bytes=text_bytes))
    return TokenLogprobOut(token=token, logprob=finite(lp.logprob), bytes=raw, top_logprobs=top)


def _completion_logprobs(tokenizer, logprobs) -> CompletionLogprobs:
    tokens, offsets, offset = [], [], 0
    for lp in logprobs:
        text = tokenizer.decode([lp.token_id])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [{tokenizer.decode([t]): finite(v) for t, v in lp.top} for lp in logprobs]
    return CompletionLogprobs(tokens=tokens, token_logprobs=[finite(lp.logprob) for lp in logprobs], top_logprobs=top,
                              text_offset=offsets)
