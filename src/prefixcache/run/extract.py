"""Extraction tasks: records in, JSON fields out, generated greedily from the cached prefix.

An :class:`~prefixcache.spec.task.ExtractTask` is rendered like a classification
task (chat template, sentinel, checked token boundary), with the declared
fields in the system message and each example's answer as a JSON object. The
:class:`Extractor` then runs the same record loop as the classifier per window
of records (prepare, plan, run, report; see :mod:`prefixcache.run.loop`):

* run: one :func:`~prefixcache.engine.generate.generate_rows` call per batch;
* report: parse each output as JSON; Extractions are yielded in input order.

Modes are the classifier's (:class:`~prefixcache.types.Mode`): ``full`` generates
from the whole prompt (the uncached baseline), ``cached`` one record at a time
after the stored prefix, ``batched`` many at once. A record that cannot be
rendered, or whose output is not a JSON object with the declared fields, gets
an Extraction with ``error`` set; it is never dropped.

Also here: :func:`compare_extractions` / :func:`verify_extract` (cached output
must be token-for-token the uncached output) and :func:`run_extract_bench`
(time-to-first-token and tokens/s, cached vs uncached).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator, Mapping

from ..cache.kv import PrefixKV
from ..cache.pool import PrefixPool
from ..engine.generate import Generation, GenerationConfig, eos_ids_of, generate_rows
from ..model.load import LoadedModel
from ..spec.prompt import SENTINEL, RecordSlot, split_at_sentinel, template_lead
from ..spec.restart import Restart
from ..spec.task import ExtractTask
from ..types import Mode, Record, RunConfig, WindowStats
from .loop import BoundTask, WorkItem

# ---------------------------------------------------------------------------
# The prompt
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtractPrompt(RecordSlot):
    """An extraction task rendered for one tokenizer (see :class:`prefixcache.spec.prompt.Prompt` for the fields)."""

    task: ExtractTask
    prefix_text: str
    lead: str
    tail_text: str
    prefix_ids: tuple[int, ...]
    heal: int
    restart: Restart | None = None

    @property
    def input_names(self) -> list[str]:
        return self.task.input_fields


def answer_json(task: ExtractTask, values: Mapping[str, object]) -> str:
    """The JSON an example answers with: the declared fields in declared order."""
    return json.dumps({name: values.get(name) for name in task.fields}, ensure_ascii=False)


def render_extract_messages(task: ExtractTask) -> list[dict[str, str]]:
    """Chat messages for ``task`` with :data:`~prefixcache.spec.prompt.SENTINEL` in place of the record."""
    declared = "\n".join(f"- {name}: {description}" for name, description in task.fields.items())
    system = (
        f"{task.instruction.strip()}\n\nFields:\n{declared}\n\n"
        f"Answer with one JSON object with exactly these keys: {', '.join(task.fields)}. "
        "Use null for a field the text does not give."
    )
    messages = [{"role": "system", "content": system}]
    for example in task.examples:
        filled = task.input_template.format(**{f: example.text for f in task.input_fields})
        answer = answer_json(task, example.fields)
        messages += [{"role": "user", "content": filled}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": _lead(task) + SENTINEL})
    return messages


def _lead(task: ExtractTask) -> str:
    return template_lead(task.input_template, task.input_fields[0])


def build_extract_prompt(task: ExtractTask, tokenizer) -> ExtractPrompt:
    """Render ``task`` with ``tokenizer``'s chat template and heal the prefix boundary.

    Raises:
        PromptError: no chat template, a sentinel problem, or an unhealable boundary.
    """
    split = split_at_sentinel(tokenizer, render_extract_messages(task))
    return ExtractPrompt(task, split.prefix_text, _lead(task), split.tail_text, split.prefix_ids, split.heal, split.restart)


# ---------------------------------------------------------------------------
# Parsing the output
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedFields:
    """The declared fields found in an output (``None`` when no JSON object was found) and what went wrong."""

    fields: dict | None
    error: str | None = None


def parse_fields(raw: str, declared: list[str]) -> ParsedFields:
    """Parse the first JSON object in ``raw`` and keep the declared fields (other keys are dropped).

    Never raises: a missing object, invalid JSON or a missing field is reported in ``error``.
    """
    start = raw.find("{")
    if start < 0:
        return ParsedFields(None, f"no JSON object in the output: {_excerpt(raw)}")
    try:
        value, _ = json.JSONDecoder().raw_decode(raw[start:])
    except json.JSONDecodeError as exc:
        where = f"{exc.msg} at character {start + exc.pos}"
        return ParsedFields(None, f"output is not valid JSON ({where}): {_excerpt(raw)}")
    if not isinstance(value, dict):
        return ParsedFields(None, f"output is JSON but not an object: {_excerpt(raw)}")
    fields = {name: value[name] for name in declared if name in value}
    missing = [name for name in declared if name not in value]
    if missing:
        return ParsedFields(fields, f"output lacks field(s) {', '.join(missing)}")
    return ParsedFields(fields)


def _excerpt(text: str, limit: int = 80) -> str:
    return json.dumps(text if len(text) <= limit else text[:limit] + "...", ensure_ascii=False)


# ---------------------------------------------------------------------------
# The extractor
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Extraction:
    """The result for one record. ``error`` is set when the record could not be rendered or parsed.

    ``raw`` is the generated text (None when nothing was generated); ``fields`` the parsed
    declared fields (possibly partial when some are missing).
    """

    id: object
    fields: dict | None = None
    raw: str | None = None
    error: str | None = None
    token_ids: tuple[int, ...] = field(default=(), repr=False)
    finish: str | None = None
    boundary_fallback: bool = False

    def to_json(self) -> dict:
        return {"id": self.id, "fields": self.fields, "raw": self.raw, "error": self.error}


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

    Raises (on construction):
        PromptError: the task cannot be rendered for this tokenizer.
    """

    stats_type = ExtractStats

    def __init__(
        self, loaded: LoadedModel, task: ExtractTask, pool: PrefixPool | None = None, max_new_tokens: int | None = None
    ):
        self.prompt = build_extract_prompt(task, loaded.tokenizer)
        super().__init__(loaded, task, pool)
        self.generation = GenerationConfig(
            max_new_tokens or task.max_new_tokens, tuple(task.stop), eos_ids_of(loaded.model, loaded.tokenizer)
        )

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

    def _forward(self, prefix: PrefixKV, batch: list[WorkItem], stats: ExtractStats) -> list[Generation]:
        rows = [it.rows for it in batch]
        generations, timing = generate_rows(self.loaded.model, self.loaded.tokenizer, prefix, rows, self.generation)
        stats.forward_passes += timing.steps
        stats.prefill_tokens += sum(len(it.rows) for it in batch)
        stats.tokens_generated += timing.tokens
        stats.first_token_s += [timing.first_token_s] * len(batch)
        return generations

    def _result(self, item: WorkItem, generation: Generation) -> Extraction:
        parsed = parse_fields(generation.text, list(self.task.fields))
        error = parsed.error
        if error is not None and generation.finish == "length":
            error += f" (stopped at max_new_tokens={self.generation.max_new_tokens})"
        return Extraction(
            item.record.id, parsed.fields, generation.text, error, generation.token_ids, generation.finish,
            item.boundary_fallback,
        )

    def _failed(self, item: WorkItem) -> Extraction:
        return Extraction(item.record.id, error=item.error)

    def _tally(self, stats: ExtractStats, items: list[WorkItem], results: list[Extraction]) -> None:
        stats.errors += sum(1 for r in results if r.error is not None)
        stats.parse_errors += sum(1 for r in results if r.error is not None and r.raw is not None)


# ---------------------------------------------------------------------------
# Verification: cached output must be the uncached output, token for token
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtractAgreement:
    """How two extraction runs over the same records compare (``identical``: same generated tokens)."""

    records: int
    identical: int
    same_fields: int
    differing_ids: list

    @property
    def rate(self) -> float:
        return self.identical / self.records if self.records else 1.0

    @property
    def ok(self) -> bool:
        return self.identical == self.records

    def to_json(self) -> dict:
        return asdict(self)


def compare_extractions(reference: list[Extraction], candidate: list[Extraction]) -> ExtractAgreement:
    """Compare record by record (same order, same ids). Records that errored before generating must error in both.

    Raises:
        ValueError: the two runs hold different records or orders.
    """
    if [e.id for e in reference] != [e.id for e in candidate]:
        raise ValueError("the two runs did not return the same records in the same order")
    identical = same_fields = 0
    differing = []
    for ref, cand in zip(reference, candidate):
        same_output = ref.token_ids == cand.token_ids and ref.raw == cand.raw
        same = same_output and (ref.raw is not None or ref.error == cand.error)
        identical += same
        same_fields += ref.fields == cand.fields
        if not same:
            differing.append(ref.id)
    return ExtractAgreement(len(reference), identical, same_fields, differing)


def verify_extract(
    extractor: Extractor, records: list[Record], config: RunConfig, progress: Callable[[int], None] | None = None
) -> tuple[ExtractAgreement, ExtractStats, ExtractStats]:
    """Run ``full`` (uncached) and ``config.mode`` over ``records``; compare their outputs token for token."""
    ref_stats, cand_stats = ExtractStats(), ExtractStats()
    reference = extractor.extract_all(records, RunConfig(Mode.FULL, 1, config.window), progress=progress, stats=ref_stats)
    candidate = extractor.extract_all(records, config, progress=progress, stats=cand_stats)
    return compare_extractions(reference, candidate), ref_stats, cand_stats


# ---------------------------------------------------------------------------
# Benchmark: time to first token and tokens/s, cached vs uncached
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtractLaneResult:
    """One extraction lane's figures; ``identical`` is the share of records whose output equals the ``full`` lane's."""

    mode: str
    batch_size: int
    records: int
    seconds: float
    ttft_ms_mean: float
    ttft_ms_p50: float
    tokens_generated: int
    tokens_per_s: float
    prefill_tokens: int
    identical: float
    parse_errors: int

    def to_json(self) -> dict:
        return asdict(self)


def bench_extract(
    extractor: Extractor, records: list[Record], batch_size: int, log: Callable[[str], None] = print
) -> list[ExtractLaneResult]:
    """Time full (uncached), cached and batched extraction on the same records, after a warm-up."""
    extractor.extract_all(records[:1], RunConfig(Mode.BATCHED, 1))  # builds the prefix, warms kernels
    results, reference = [], None
    for mode in Mode:  # full (the reference) first
        size = mode.pass_size(batch_size)
        log(f"running extract [{mode}] on {len(records)} records ...")
        stats = ExtractStats()
        started = time.perf_counter()
        outputs = extractor.extract_all(records, RunConfig(mode, size), stats=stats)
        seconds = time.perf_counter() - started
        reference = reference or outputs
        ttft = [1000 * s for s in stats.first_token_s] or [0.0]
        results.append(
            ExtractLaneResult(
                mode.value, size, len(records), seconds, statistics.fmean(ttft), statistics.median(ttft),
                stats.tokens_generated,
                stats.tokens_generated / seconds if seconds else 0.0, stats.prefill_tokens,
                compare_extractions(reference, outputs).rate, stats.parse_errors,
            )
        )
    return results


def run_extract_bench(options, log: Callable[[str], None] = print):
    """``prefixcache bench --task <extract task>``: ``(BenchReport, document)``, like :func:`prefixcache.bench.lanes.run_bench`.

    The report's rows are :class:`~prefixcache.bench.lanes.ModeResult` (``label_agreement`` is the share of
    identical outputs); the document's ``extract`` list holds time-to-first-token and tokens/s per lane.
    """
    from ..bench.lanes import BenchReport, ModeResult, dtype_name
    from ..model.load import load_model, load_random_model, set_threads
    from ..spec.task import load_any_task
    from ..bench.workload import ticket_records

    task = load_any_task(options.task)
    threads = set_threads(options.threads)
    if options.model_config:
        loaded = load_random_model(options.model_config, options.dtype, threads, tokenizer_from=options.model)
    else:
        loaded = load_model(options.model, options.dtype, threads)
    extractor = Extractor(loaded, task)
    log(f"model {loaded.identity}, {threads} threads, dtype {dtype_name(loaded.dtype)}, extract task {task.name}")
    records = ticket_records(options.items)
    lanes = bench_extract(extractor, records, options.batch_size, log)
    full_seconds = lanes[0].seconds
    for lane in lanes:
        log(
            f"extract [{lane.mode}] B={lane.batch_size}: time to first token {lane.ttft_ms_mean:.1f} ms (median "
            f"{lane.ttft_ms_p50:.1f}), {lane.tokens_per_s:.1f} tokens/s, {lane.identical:.0%} identical to uncached"
        )
    rows = [
        ModeResult(
            lane.mode, dtype_name(loaded.dtype), lane.batch_size, lane.records, lane.seconds,
            full_seconds / lane.seconds if lane.seconds else float("inf"), lane.identical, 0.0,
            lane.prefill_tokens + lane.tokens_generated,
        )
        for lane in lanes
    ]
    document = {
        "model": loaded.identity, "dtype": dtype_name(loaded.dtype), "threads": threads, "task": task.name,
        "kind": "extract", "items": len(records), "prefix_tokens": len(extractor.prompt.prefix_ids),
        "prefix_seconds": extractor.prefix_seconds, "modes": [r.to_json() for r in rows],
        "extract": [lane.to_json() for lane in lanes],
    }
    return BenchReport(rows, {}), document
