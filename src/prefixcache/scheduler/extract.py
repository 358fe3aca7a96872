"""Extraction tasks: records in, JSON fields out, generated greedily from the cached prefix.

An :class:`Extractor` is a :class:`~prefixcache.scheduler.loop.BoundTask` over an extraction prompt
(:mod:`prefixcache.task.extract_prompt`); it runs the same record loop as the classifier per window
of records (prepare, plan, run, report; see :mod:`prefixcache.scheduler.loop`):

* run: one :func:`~prefixcache.engine.generate.generate_rows` call per batch, constrained by default to the
  task's answer schema (:func:`~prefixcache.task.answer.answer_schema`: an object of exactly the declared
  fields, strings or null), so every output parses; ``constrained=False`` decodes freely (to compare);
* report: parse each output as JSON (:func:`~prefixcache.task.answer.parse_fields`, kept as the check),
  then apply the task's field policy (:mod:`prefixcache.scheduler.field_policy`: choice fields through their
  fitted heads, a confidence per field, fields under their threshold left null and flagged);
  Extractions are yielded in input order.

Copy fields (``kind: copy``): under the constraint, each batch binds the task's copy fields to each record's own
text (:class:`~prefixcache.engine.copy_constraint.CopyConstraint`), so a copied value is a span of the record
or null.

Modes are the classifier's (:class:`~prefixcache.types.Mode`): ``full`` generates
from the whole prompt (the uncached baseline), ``cached`` one record at a time
after the stored prefix, ``batched`` many at once. A record that cannot be
rendered, or whose output is not a JSON object with the declared fields, gets
an Extraction with ``error`` set; it is never dropped.

Elsewhere: the agreement of cached and uncached output (:mod:`prefixcache.eval.verify_extract`) and
the extraction benchmark (:mod:`prefixcache.bench.extract_lanes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from ..cache.kv import PrefixKV
from ..cache.pool import PrefixPool
from ..engine.constraint import grammar_tokenizer, json_constraint
from ..engine.copy_constraint import CopyConstraint, token_table
from ..engine.generate import Decoding, Generation, GenerationConfig, eos_ids_of, generate_rows
from ..engine.sampling import Sampling
from ..errors import BackendError, setting
from ..model.load import LoadedModel
from ..task.answer import answer_schema, parse_fields
from ..model.context_window import context_limit
from ..task.extract_prompt import build_extract_prompt
from ..task.definition import ExtractTask
from ..types import Mode, Record, RunConfig, WindowStats
from .engine_loop import EngineLoop
from .field_policy import FieldPolicy
from .loop import BoundTask, Failure, WorkItem, route
from .sequence import Generate, Sequence

CONFIDENCE = Sampling(top_logprobs=0)  # greedy, recording each token's log-prob (the fields' confidence)


@dataclass(frozen=True)
class Extraction:
    """The result for one record. ``error`` is set when the record could not be rendered or parsed.

    ``raw`` is the generated text (None when nothing was generated); ``fields`` the parsed
    declared fields (possibly partial when some are missing), after the field policy; ``confidence`` per field;
    ``flagged``: fields left null for being under their threshold.
    """

    id: object
    fields: dict | None = None
    raw: str | None = None
    error: str | None = None
    token_ids: tuple[int, ...] = field(default=(), repr=False)
    finish: str | None = None
    boundary_fallback: bool = False
    confidence: dict | None = None
    flagged: tuple[str, ...] = ()

    def to_json(self) -> dict:
        confidence = None if self.confidence is None else {
            k: (None if v is None else round(v, 4)) for k, v in self.confidence.items()}
        return {"id": self.id, "fields": self.fields, "raw": self.raw, "error": self.error, "confidence": confidence,
                "flagged": list(self.flagged)}


@dataclass
class ExtractStats(WindowStats):
    """Counters of one extraction run. ``first_token_s``: per record, the time to its first token."""

    parse_errors: int = 0
    prefill_tokens: int = 0
    tokens_generated: int = 0
    first_token_s: list[float] = field(default_factory=list)


class Extractor(BoundTask):
    """An extraction task bound to a model: builds the prompt and prefix once, then extracts from records.

    Thread safety: the stored prefix is read-only and every batch uses its own fork.
    With a ``pool`` the prefix is looked up once per :meth:`extract` call (the task's ``pin`` is honoured).
    ``constrained`` (the default): decode under the task's answer schema (``constraint``; None when False).

    Raises (on construction):
        PromptError: the task cannot be rendered for this tokenizer.
        ConstraintError: ``constrained`` and the tokenizer cannot be constrained (it is not a fast tokenizer).
    """

    stats_type = ExtractStats

    def __init__(
        self, loaded: LoadedModel, task: ExtractTask, pool: PrefixPool | None = None, max_new_tokens: int | None = None,
        constrained: bool = True, policy: FieldPolicy | None = None,
    ):
        self.prompt = build_extract_prompt(task, loaded.tokenizer)
        super().__init__(loaded, task, pool)
        self.generation = GenerationConfig(
            max_new_tokens or task.max_new_tokens, tuple(task.stop), eos_ids_of(loaded.model, loaded.tokenizer)
        )
        self.constraint = json_constraint(answer_schema(task)) if constrained else None
        if constrained:  # fails here rather than in the first batch, and pays the one-time build now
            grammar_tokenizer(loaded.tokenizer, self.generation.eos_ids)
        self.policy = policy or FieldPolicy(task)
        self.copied = tuple(task.names_of_kind("copy")) if constrained else ()
        # the vocabulary as bytes, to find which tokens wrote which field (the confidence): constrained decoding only
        self._token_bytes = token_table(loaded.tokenizer, self.generation.eos_ids).token_bytes if constrained else None
        self._shared_want = Generate(self.generation, CONFIDENCE, self.constraint)

    def extract(
        self,
        records: Iterable[Record],
        config: RunConfig = RunConfig(),
        progress: Callable[[int], None] | None = None,
        stats: ExtractStats | None = None,
    ) -> Iterator[Extraction]:
        """Yield one Extraction per record, in input order."""
        yield from self._stream(records, config, progress, stats if stats is not None else self.stats_type())

    def extract_all(self, records: Iterable[Record], config: RunConfig = RunConfig(), **kw) -> list[Extraction]:
        return list(self.extract(records, config, **kw))

    def _route(self, index: int, record: Record, enc, config: RunConfig) -> WorkItem:
        """An item, or an error naming the record when its prompt plus ``max_new_tokens`` would not fit the
        model's context (it is never run: a prompt far past the context would ask for memory it cannot have)."""
        limit = context_limit(self.loaded.model)
        prompt, budget = len(enc.full_ids), self.generation.max_new_tokens
        if limit is not None and prompt + budget > limit:
            return WorkItem(index, record, overflowed=True, error=(
                f"record {record.id!r}: its prompt takes {prompt} tokens, and with max_new_tokens={budget} that is "
                f"more than the model's {limit}-token context; shorten its text"))
        return route(index, record, enc, Mode(config.mode))

    def _forward(self, prefix: PrefixKV, batch: list[WorkItem], stats: ExtractStats) -> list[Generation]:
        rows = [it.rows for it in batch]
        constraint = self.constraint
        if self.copied:  # the copy fields bound to each record's own text
            constraint = CopyConstraint(constraint, self.copied, tuple(self.source_text(it.record) for it in batch))
        generations, timing = generate_rows(
            self.loaded.model, self.loaded.tokenizer, prefix, rows, Decoding(self.generation, CONFIDENCE, constraint)
        )
        stats.forward_passes += timing.steps
        stats.prefill_tokens += sum(len(it.rows) for it in batch)
        stats.tokens_generated += timing.tokens
        stats.first_token_s += [timing.first_token_s] * len(batch)
        return generations

    def use_backend(self, asked: str, rows: int = 32):
        """Run the generating rows (up to ``rows`` at once) on the backend ``asked`` chooses (``auto``, ``torch`` or
        ``llama.cpp``: :mod:`~prefixcache.scheduler.backend_choice`); returns the choice (its name and why).

        On llama.cpp a tuned prefix is placed in its cells from torch's, and with fitted field heads every row's
        prompt is computed on torch (their state); where the model's cells cannot be written that way, the rows stay
        on torch (``auto``) or the backend is refused (``llama.cpp``).

        Raises:
            BackendError: ``llama.cpp`` asked for where it cannot run (the reason named).
        """
        from .backend_choice import BackendChoice, choose, llama_generation

        chosen = choose(self.loaded, asked, None, rows)
        self.backend = llama_generation(self.loaded, rows) if chosen.name == "llama.cpp" else None
        needs = [why for why, needed in [("a tuned prefix", self.tuned is not None),
                                         ("fitted field heads' states", bool(self.policy.heads))] if needed]
        if self.backend is not None and needs and self.backend.prefill is None:
            why = f"{' and '.join(needs)} come from torch, and this model's llama.cpp cells cannot be written from it"
            self.backend = None
            if asked == "llama.cpp":
                raise BackendError(f"the llama.cpp backend cannot run this: {why}; use {setting('backend', 'torch')}")
            return BackendChoice("torch", why)
        if self.backend is not None:
            self.backend.states = bool(self.policy.heads)
        return chosen

    def source_text(self, record: Record) -> str:
        """The text a copy field may copy from: the record's fields the prompt shows, one per line."""
        return "\n".join(str(record.fields.get(name, "")) for name in self.task.input_fields)

    def _sequences(self, batches, stats: ExtractStats, on_finish) -> list[Sequence]:
        """Generating sequences, each under the task's decoding settings (greedy, recording log-probs for the
        fields' confidence) and constraint, with the copy fields bound to its own record's text."""
        return [Sequence(prefix, item.rows, self.want_of(item), tag=item, on_finish=on_finish)
                for prefix, batch in batches for item in batch]

    def want_of(self, item: WorkItem) -> Generate:
        """What ``item``'s generating sequence wants: the task's decoding settings and constraint, with the copy
        fields bound to its own record's text."""
        if not self.copied:
            return self._shared_want
        bound = CopyConstraint(self.constraint, self.copied, (self.source_text(item.record),))
        return Generate(self.generation, CONFIDENCE, bound)

    def _count_loop(self, engine: EngineLoop, seqs: list[Sequence], stats: ExtractStats) -> None:
        stats.forward_passes += engine.stats.passes
        stats.prefill_tokens += sum(len(seq.ids) for seq in seqs)
        stats.tokens_generated += engine.stats.tokens_generated
        # from the step that first fed the record (its own wait in the queue is not its time to first token)
        stats.first_token_s += [seq.first_token_at - seq.admitted_at for seq in seqs if seq.first_token_at is not None]

    def _result(self, item: WorkItem, generation: Generation | Failure) -> Extraction:
        if isinstance(generation, Failure):
            return Extraction(item.record.id, error=f"record {item.record.id!r}: {generation.error}",
                              boundary_fallback=item.boundary_fallback)
        return self.extraction_of(item.record.id, generation, item.boundary_fallback)

    def extraction_of(self, record_id: object, generation: Generation, boundary_fallback: bool = False) -> Extraction:
        """The Extraction of one record's ``generation``: its text parsed into the task's fields (an error naming
        what is wrong, and the token budget when it ran out, if it does not parse)."""
        parsed = parse_fields(generation.text, list(self.task.fields))
        error = parsed.error
        if error is not None and generation.finish == "length":
            error += f" (stopped at max_new_tokens={self.generation.max_new_tokens})"
        judged = self.policy.judge(parsed.fields, generation, self._token_bytes)
        return Extraction(
            record_id, judged.fields, generation.text, error, generation.token_ids, generation.finish, boundary_fallback,
            judged.confidence, judged.flagged,
        )

    def _failed(self, item: WorkItem) -> Extraction:
        return Extraction(item.record.id, error=item.error)

    def _tally(self, stats: ExtractStats, items: list[WorkItem], results: list[Extraction]) -> None:
        stats.errors += sum(1 for r in results if r.error is not None)
        stats.parse_errors += sum(1 for r in results if r.error is not None and r.raw is not None)
