"""What the OpenAI-compatible routes run on the model thread: guided choice and generation over a reused prefix.

A request's whole prompt (:class:`~prefixcache.task.chat.WholePrompt`) is split at its reusable part.
That part is looked up in the service's :class:`~prefixcache.cache.pool.PrefixPool` once per pass: a
hit when an earlier request stored it, an *extension* when a held entry shares a leading part with it
(only the rest is computed), else it is computed and stored for the next request, all under the pool's
byte budget and eviction policy. The row fed after it is the rest of the prompt, so a result equals
full re-encoding's (invariant 1) whatever the pool held.

Runners are keyed (:class:`OpenAIRunners`): requests with the same reusable part and the same choices
(or the same decoding settings and response schema) get the same runner object, and the micro-batcher merges the queued
items of one runner into one pass. So concurrent requests sharing a system prompt and few-shot turns
are scored together, over one stored prefix.

This module knows nothing about HTTP.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

from ..cache.kv import PrefixKV
from ..cache.pool import PrefixPool
from ..engine.forward import score_rows
from ..engine.constraint import JsonConstraint
from ..engine.generate import GenerationConfig, generate_rows
from ..engine.rows import empty_prefix
from ..engine.sampling import Sampling
from ..engine.scoring import LabelScorer
from ..errors import PoolBudgetError
from ..model.load import LoadedModel
from ..task.chat import Choices, EarlierMessages, WholePrompt

MIN_REUSE = 16  # a reusable part shorter than this is not stored: the whole prompt is computed
RUNNERS_KEPT = 256  # runners (distinct prefix + choices or settings) remembered for batching


@dataclass(frozen=True)
class RouteName:
    """What the batcher and the metrics call these runners' passes (one series for all requests)."""

    name: str = "openai"


@dataclass(eq=False)
class PromptItem:
    """One request's prompt in a pass. ``full`` (set by the pass): computed whole, no stored part used.

    ``on_token(token_id)`` (streaming) is called on the model thread for every generated token.
    """

    prompt: WholePrompt
    on_token: Callable[[int], None] | None = None
    full: bool = False


class _ReusingRunner:
    """A pass over the pool's entry for ``prefix_ids`` (or the empty prefix when it is too short or cannot fit)."""

    kind: ClassVar[str]
    task = RouteName()

    def __init__(self, loaded: LoadedModel, pool: PrefixPool, prefix_ids: tuple[int, ...]):
        self.loaded = loaded
        self.pool = pool
        self.prefix_ids = prefix_ids

    def _prefix(self, items: Sequence[PromptItem]) -> tuple[PrefixKV, list[int]]:
        """The prefix for this pass and each item's cached prompt tokens (the first item pays for what the
        lookup computed; the others reuse what it stored). Marks items ``full`` when nothing is reused."""
        if len(self.prefix_ids) >= MIN_REUSE:
            try:
                lookup = self.pool.get(self.loaded, self.prefix_ids, name="openai")
            except PoolBudgetError:
                pass
            else:
                used = len(self.prefix_ids)
                return lookup.prefix, [lookup.tokens_reused] + [used] * (len(items) - 1)
        for item in items:
            item.full = True
        return empty_prefix(self.loaded.model), [0] * len(items)

    def _rows(self, prefix: PrefixKV, items: Sequence[PromptItem]) -> list[tuple[int, ...]]:
        return [item.prompt.ids[prefix.length:] for item in items]


class ChoiceRunner(_ReusingRunner):
    """Guided choice: each item's choices scored as labels after its prompt, one :func:`score_rows` call."""

    kind: ClassVar[str] = "guided_choice"

    def __init__(self, loaded: LoadedModel, pool: PrefixPool, prefix_ids: tuple[int, ...], choices: Choices, method: str):
        super().__init__(loaded, pool, prefix_ids)
        self.choices = choices
        self.head = LabelScorer(loaded.model, choices, choices.resolve_method(method))

    def run(self, items: Sequence[PromptItem]) -> list[dict]:
        prefix, cached = self._prefix(items)
        logprobs = score_rows(self.loaded.model, prefix, self._rows(prefix, items), self.head)  # [B, L]
        out = []
        for item, scores, reused in zip(items, self.head.to_scores(logprobs), cached):
            best = scores.label
            out.append({
                "text": best, "finish": "stop", "choice_logprobs": dict(zip(scores.labels, scores.logprobs)),
                "completion_tokens": len(self.choices.label_ids[best]),
                "prompt_tokens": len(item.prompt.ids), "cached_tokens": reused,
            })
        return out


class GenerateRunner(_ReusingRunner):
    """Generation: every item decoded with one :func:`generate_rows` call (greedy or sampled), under
    ``constraint`` (a response schema) when there is one."""

    kind: ClassVar[str] = "generate"
    decodes: ClassVar[bool] = True  # a pass decodes step by step: the batcher lets short passes in between

    def __init__(self, loaded: LoadedModel, pool: PrefixPool, prefix_ids: tuple[int, ...], config: GenerationConfig,
                 sampling: Sampling, constraint: JsonConstraint | None = None):
        super().__init__(loaded, pool, prefix_ids)
        self.config = config
        self.sampling = sampling
        self.constraint = constraint

    def run(self, items: Sequence[PromptItem]) -> list[dict]:
        prefix, cached = self._prefix(items)

        def on_token(row: int, token: int) -> None:
            if items[row].on_token is not None:
                items[row].on_token(token)

        generations, _ = generate_rows(
            self.loaded.model, self.loaded.tokenizer, prefix, self._rows(prefix, items), self.config, self.sampling, on_token,
            self.constraint,
        )
        return [
            {
                "text": g.text, "finish": "length" if g.finish == "length" else "stop", "token_ids": list(g.token_ids),
                "logprobs": g.logprobs, "completion_tokens": len(g.token_ids),
                "prompt_tokens": len(item.prompt.ids), "cached_tokens": reused,
            }
            for item, g, reused in zip(items, generations, cached)
        ]


class OpenAIRunners:
    """The runner for a request's key, the same object for the same key (so its items batch together).

    Keeps the :data:`RUNNERS_KEPT` most recently used runners; an older one may still be in a pass. Thread-safe.
    """

    def __init__(self, loaded: LoadedModel, pool: PrefixPool, method: str):
        self.loaded = loaded
        self.pool = pool
        self.method = method
        self._runners: OrderedDict[tuple, _ReusingRunner] = OrderedDict()
        self._lock = threading.Lock()
        self.earlier = EarlierMessages()  # the leading messages of recent chats, tokenized (used on the prep threads)

    def choice(self, prompt: WholePrompt, choices: Choices) -> ChoiceRunner:
        """Raises LabelCollisionError when the server's method is ``first-token`` and two choices share a first token."""
        key = ("choice", prompt.ids[: prompt.reusable], tuple(choices.label_ids.items()))
        return self._get(key, lambda: ChoiceRunner(self.loaded, self.pool, key[1], choices, self.method))

    def generate(self, prompt: WholePrompt, config: GenerationConfig, sampling: Sampling,
                 constraint: JsonConstraint | None = None) -> GenerateRunner:
        """The runner of these decoding settings; requests with different schemas never share one."""
        key = ("generate", prompt.ids[: prompt.reusable], config, sampling, constraint)
        return self._get(key, lambda: GenerateRunner(self.loaded, self.pool, key[1], config, sampling, constraint))

    def _get(self, key: tuple, build: Callable[[], _ReusingRunner]):
        with self._lock:
            runner = self._runners.get(key)
            if runner is None:
                runner = self._runners[key] = build()
                while len(self._runners) > RUNNERS_KEPT:
                    self._runners.popitem(last=False)
            self._runners.move_to_end(key)
            return runner
