"""What the OpenAI-compatible routes run on the model thread: guided choice and generation over a reused prefix.

A request's whole prompt (:class:`~prefixcache.task.chat.WholePrompt`) is split at its reusable part.
That part is looked up in the service's :class:`~prefixcache.cache.pool.PrefixPool` when the request's
sequence is made (on the model thread): a hit when an earlier request stored it, an *extension* when a held
entry shares a leading part with it (only the rest is computed), else it is computed and stored for the next
request, all under the pool's byte budget and eviction policy. The sequence fed after it is the rest of the
prompt, so a result equals full re-encoding's (invariant 1) whatever the pool held.

Each request gets its own runner (:class:`OpenAIRunners` makes them) and one sequence of the engine loop:

* guided choice: a scoring sequence; requests with the same reusable part and the same choices name the same
  scorer ``group``, so the loop scores them in one call over one stored prefix;
* generation: a generating sequence with the request's own sampling, stop strings and response schema;
  requests with different settings share steps (sampling is per row).

This module knows nothing about HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Hashable, Iterator, Sequence

from ..cache.kv import PrefixKV, build_in_chunks
from ..cache.pool import PrefixPool
from ..engine.forward import score_rows
from ..engine.constraint import JsonConstraint
from ..engine.generate import GenerationConfig
from ..engine.rows import empty_prefix
from ..engine.sampling import Sampling
from ..engine.scoring import LabelScorer
from ..errors import PoolBudgetError
from ..model.load import LoadedModel
from ..scheduler.sequence import Generate, Scores, Sequence as EngineSequence, Status
from ..task.chat import Choices, EarlierMessages, WholePrompt
from .kv_room import KVRoom
from .runners import Submitted, failed

MIN_REUSE = 16  # a reusable part shorter than this is not stored: the whole prompt is computed


@dataclass(frozen=True)
class RouteTask:
    """What the metrics call these runners' steps (one series for all requests of the OpenAI routes)."""

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
    """One request's sequence over the pool's entry for ``prefix_ids`` (or the empty prefix when it is too short
    or cannot fit)."""

    kind: ClassVar[str]
    task = RouteTask()

    def __init__(self, loaded: LoadedModel, pool: PrefixPool, prefix_ids: tuple[int, ...]):
        self.loaded = loaded
        self.pool = pool
        self.prefix_ids = prefix_ids

    def _prefix(self, items: Sequence[PromptItem]) -> tuple[PrefixKV, list[int]]:
        """The prefix for these items and each item's cached prompt tokens (the first item pays for what the
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


    def prefix_build(self, chunk_tokens: int) -> Iterator[None] | None:
        """Work for the model thread to do between steps before this request's sequences are made: its reusable
        prompt part computed ``chunk_tokens`` at a time and held in the pool (one chunk per ``next``), so that a
        long system prompt never stalls the loop for its whole prefill. None when there is nothing to compute in
        chunks: the part is held already, too short to reuse or to need chunks, too large for the pool's budget
        (``sequences`` then runs it as the request's own tokens, chunked by the loop), or the pool has a disk tier
        (which :meth:`PrefixPool.get` reads first)."""
        ids = self.prefix_ids
        if (len(ids) < MIN_REUSE or len(ids) <= chunk_tokens or self.pool.store is not None
                or self.pool.holds(self.loaded, ids) or not self.pool.fits(self.loaded, len(ids))):
            return None
        return self._build(chunk_tokens)

    def _build(self, chunk_tokens: int) -> Iterator[None]:
        built = None
        for built in build_in_chunks(self.loaded.model, self.prefix_ids, chunk_tokens):
            yield
        self.pool.hold(self.loaded, built, name="openai")

    def sequences(self, items: Sequence[PromptItem]) -> Submitted:
        prefix, cached = self._prefix(items)
        seqs = [EngineSequence(prefix, item.prompt.ids[prefix.length:], self._want(item), tag=(item, reused),
                               on_token=self._streamer(item))
                for item, reused in zip(items, cached)]
        return Submitted(seqs, sum(cached))

    def _want(self, item: PromptItem) -> Scores | Generate:
        raise NotImplementedError

    def _streamer(self, item: PromptItem) -> Callable[[EngineSequence, int], None] | None:
        return None


class ChoiceRunner(_ReusingRunner):
    """Guided choice: each request's choices scored as labels after its prompt; the loop scores the requests of
    one ``group`` (the same reusable part and choices) in one :func:`score_rows` call."""

    kind: ClassVar[str] = "guided_choice"

    def __init__(self, loaded: LoadedModel, pool: PrefixPool, prefix_ids: tuple[int, ...], choices: Choices, method: str):
        super().__init__(loaded, pool, prefix_ids)
        self.choices = choices
        self.head = LabelScorer(loaded.model, choices, choices.resolve_method(method))
        self.group: Hashable = ("choice", prefix_ids, tuple(choices.label_ids.items()), self.head.method)
        self._scores = Scores(self)

    def _want(self, item: PromptItem) -> Scores:
        return self._scores

    def score(self, prefix: PrefixKV, seqs: Sequence[EngineSequence]) -> list:
        """The scorer of one step's sequences of this group: label log-probs per sequence."""
        logprobs = score_rows(self.loaded.model, prefix, [seq.ids for seq in seqs], self.head)  # [B, L]
        return self.head.to_scores(logprobs)

    def answer(self, seq: EngineSequence) -> dict:
        if seq.status is not Status.FINISHED:
            raise failed(seq)
        item, reused = seq.tag
        scores = seq.result
        best = scores.label
        return {
            "text": best, "finish": "stop", "choice_logprobs": dict(zip(scores.labels, scores.logprobs)),
            "completion_tokens": len(self.choices.label_ids[best]),
            "prompt_tokens": len(item.prompt.ids), "cached_tokens": reused,
        }


class GenerateRunner(_ReusingRunner):
    """Generation: the request decoded by the engine loop (greedy or sampled, per row), under ``constraint`` (a
    response schema) when there is one; each token is streamed as the step that chose it ends."""

    kind: ClassVar[str] = "generate"

    def __init__(self, loaded: LoadedModel, pool: PrefixPool, prefix_ids: tuple[int, ...], config: GenerationConfig,
                 sampling: Sampling, constraint: JsonConstraint | None = None):
        super().__init__(loaded, pool, prefix_ids)
        self._generate = Generate(config, sampling, constraint)

    def _want(self, item: PromptItem) -> Generate:
        return self._generate

    def _streamer(self, item: PromptItem) -> Callable[[EngineSequence, int], None] | None:
        if item.on_token is None:
            return None
        return lambda _seq, token: item.on_token(token)

    def answer(self, seq: EngineSequence) -> dict:
        if seq.status is not Status.FINISHED:
            raise failed(seq)
        item, reused = seq.tag
        g = seq.result
        return {
            "text": g.text, "finish": "length" if g.finish == "length" else "stop", "token_ids": list(g.token_ids),
            "logprobs": g.logprobs, "completion_tokens": len(g.token_ids),
            "prompt_tokens": len(item.prompt.ids), "cached_tokens": reused,
        }


class OpenAIRunners:
    """Makes each request's runner (on a prep thread), and keeps the leading messages of recent chats tokenized.

    Nothing here is kept per request: requests batch together in the engine loop (by prefix, and guided choices
    by their scorer ``group``), not by sharing a runner object."""

    def __init__(self, loaded: LoadedModel, pool: PrefixPool, method: str, kv_room: KVRoom | None = None):
        self.loaded = loaded
        self.pool = pool
        self.method = method
        self.kv_room = kv_room or KVRoom(loaded.model, pool.config.budget_bytes)  # what one request's slot may take
        self.earlier = EarlierMessages()  # the leading messages of recent chats, tokenized (used on the prep threads)

    def choice(self, prompt: WholePrompt, choices: Choices) -> ChoiceRunner:
        """Raises LabelCollisionError when the server's method is ``first-token`` and two choices share a first token."""
        return ChoiceRunner(self.loaded, self.pool, prompt.ids[: prompt.reusable], choices, self.method)

    def generate(self, prompt: WholePrompt, config: GenerationConfig, sampling: Sampling,
                 constraint: JsonConstraint | None = None) -> GenerateRunner:
        return GenerateRunner(self.loaded, self.pool, prompt.ids[: prompt.reusable], config, sampling, constraint)
