"""The extraction benchmark: time to first token and tokens/s, cached vs uncached, on the same records.

``prefixcache bench --task <extraction task>`` runs :func:`run_extract_bench`; its rows are the
classification benchmark's :class:`~prefixcache.bench.lanes.ModeResult`, so one table prints both.
The ``full``, ``cached`` and ``batched`` lanes decode under the task's answer schema (as ``extract`` does);
a last lane, ``batched-unconstrained``, decodes the same batches freely, to show what the constraint costs
and how many outputs it changes or rescues. For a task with ``copy`` fields, ``batched-schema-only`` decodes the
same batches under the schema alone (copy fields as plain strings), so the copy constraint's cost is measured in
the same run; its identical share is against ``batched``. ``cached-stepwise`` (and, with the llama.cpp backend,
``cached-llama.cpp-stepwise``) runs the cached lane with a step for every token, the ones the answer's grammar
forces included: what fast-forward (:class:`~prefixcache.scheduler.engine_loop.EngineLoop`) saves, in the same run.

The decoding floor (:func:`~prefixcache.bench.roofline.decode_floor`): the memory read bandwidth measured in
the same run over the model's weight bytes, the most tokens/s a batch-size-1 greedy decoder can generate (each
step reads every weight once). Every lane's tokens/s is reported as a share of it (``pct_of_floor``), but only
the B=1 lanes (``full`` and ``cached``) are comparable to it: a batched lane reads the weights once for B rows
and may pass it. A lane's tokens/s counts its whole time, prefill included, so its share understates the
decode steps alone.

With llama-cpp-python installed (and ``BenchOptions.llama_cpp``), a last lane, ``llama.cpp``, generates on the
same ``.gguf`` at B = 1 with its own prefix reuse (:mod:`prefixcache.bench.peer_extract`); it decodes freely, so
its text is compared with ``batched-unconstrained``'s, and its share of the floor is of its own: the bandwidth
over the ``.gguf``'s bytes.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

from ..errors import BackendError
from ..eval.verify_extract import compare_extractions
from ..scheduler.extract import Extraction, ExtractStats, Extractor
from ..scheduler.loop import BoundTask
from ..types import Mode, Record, RunConfig
from .lanes import BenchReport, ModeResult, dtype_name
from .options import BenchOptions
from .peer_extract import LLAMA_CPP, llama_cpp_generate
from .roofline import DecodeFloor, decode_floor

UNCONSTRAINED = "batched-unconstrained"  # the lane that decodes without the answer schema
SCHEMA_ONLY = "batched-schema-only"  # the lane that decodes under the schema without the copy constraint
STATIC = "batched-static"  # the batched lane in static batches (no row joins until the batch's last one ends)
STEPWISE = "stepwise"  # a lane's suffix when its rows take a step for every token (no fast-forward of forced ones)


@dataclass(frozen=True)
class ExtractLaneResult:
    """One extraction lane's figures; ``identical`` is the share of records whose output equals the ``full`` lane's
    (for the unconstrained lane, the constrained ``batched`` lane's: the outputs the constraint left as they were)."""

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
    constrained: bool = True
    pct_of_floor: float | None = None  # tokens_per_s as a percentage of the B=1 decoding floor (meaningful at B=1)

    def to_json(self) -> dict:
        return asdict(self)


def bench_extract(
    extractor: Extractor, records: list[Record], batch_size: int, log: Callable[[str], None] = print,
    free: Extractor | None = None, peer: Callable[[list[Record]], tuple[list[Extraction], ExtractStats]] | None = None,
    backend: Extractor | None = None,
) -> list[ExtractLaneResult]:
    """Time full (uncached), cached and batched extraction on the same records, after a warm-up, and the cached lane
    without fast-forward (``cached-stepwise``); then, with
    ``backend`` (the same extractor on another generation backend), its cached and batched lanes, compared with
    the full lane; then, with an
    unconstrained ``free`` extractor of the same task, batched extraction without the constraint; then the
    ``peer`` (llama.cpp, :mod:`prefixcache.bench.peer_extract`), whose outputs are compared with the
    unconstrained lane's (or, without one, the full lane's). Before the peer, ``batched-static``: the batched lane
    in static batches (the path the engine loop replaced), compared with the full lane."""
    lanes = [(mode.value, extractor, mode) for mode in Mode]  # full (the reference) first
    lanes.append((f"{Mode.CACHED.value}-{STEPWISE}", stepwise_twin(extractor), Mode.CACHED))
    if backend is not None:
        lanes += [(f"{mode.value}-{backend.backend.name}", backend, mode) for mode in (Mode.CACHED, Mode.BATCHED)]
        lanes.append((f"{Mode.CACHED.value}-{backend.backend.name}-{STEPWISE}", stepwise_twin(backend), Mode.CACHED))
    if extractor.copied:
        lanes.append((SCHEMA_ONLY, schema_only(extractor), Mode.BATCHED))
    if free is not None:
        lanes.append((UNCONSTRAINED, free, Mode.BATCHED))
    for each in (extractor, free, backend):
        if each is not None:
            each.extract_all(records[:1], RunConfig(Mode.BATCHED, 1))  # builds the prefix, warms kernels
    lanes.append((STATIC, static_twin(extractor), Mode.BATCHED))  # made after: it shares the prefix built
    results, outputs_of = [], {}
    for name, each, mode in lanes:
        size = mode.pass_size(batch_size)
        log(f"running extract lane {name} on {len(records)} records ...")
        stats = ExtractStats()
        started = time.perf_counter()
        outputs = outputs_of[name] = each.extract_all(records, RunConfig(mode, size), stats=stats)
        seconds = time.perf_counter() - started
        reference = outputs_of[Mode.BATCHED.value if name in (UNCONSTRAINED, SCHEMA_ONLY) else Mode.FULL.value]
        results.append(_lane(name, size, len(records), seconds, stats, compare_extractions(reference, outputs).rate,
                             each.constraint is not None))
    if peer is not None:
        log(f"running extract lane {LLAMA_CPP} on {len(records)} records ...")
        started = time.perf_counter()
        outputs, stats = peer(records)
        seconds = time.perf_counter() - started
        reference = outputs_of[UNCONSTRAINED if free is not None else Mode.FULL.value]
        results.append(_lane(LLAMA_CPP, 1, len(records), seconds, stats, compare_extractions(reference, outputs).rate, False))
    return results


def backend_twin(extractor: Extractor, asked: str, rows: int, log: Callable[[str], None]) -> Extractor | None:
    """The same extractor with its generating rows on llama.cpp, for the backend lanes; None when ``asked`` is
    ``torch``, or is ``auto`` and llama.cpp cannot run here (the reason logged).

    Raises:
        BackendError: ``asked`` is ``llama.cpp`` and it cannot run here.
    """
    if asked == "torch":
        return None
    twin = copy.copy(extractor)
    try:
        twin.use_backend("llama.cpp", rows)
    except BackendError as exc:
        if asked == "llama.cpp":
            raise
        log(f"llama.cpp backend lanes skipped: {exc}")
        return None
    return twin


def schema_only(extractor: Extractor) -> Extractor:
    """The same extractor (prompt, prefix, policy) decoding under its schema alone: copy fields as plain strings."""
    plain = copy.copy(extractor)
    plain.copied = ()
    return plain


def stepwise_twin(extractor: BoundTask) -> BoundTask:
    """A copy of ``extractor`` whose rows take a step for every token, the ones their grammar forces included (no
    fast-forward), timed beside the fast-forwarded lanes."""
    twin = copy.copy(extractor)
    twin.fast_forward = False
    return twin


def static_twin(extractor: BoundTask) -> BoundTask:
    """A copy of ``extractor`` that runs its windows in static batches (one ``generate_rows`` call per batch,
    no row joining until its last row ends), timed beside the engine loop that extraction runs through."""
    twin = copy.copy(extractor)
    twin.continuous = False
    return twin


def _lane(
    name: str, size: int, records: int, seconds: float, stats: ExtractStats, identical: float, constrained: bool
) -> ExtractLaneResult:
    ttft = [1000 * s for s in stats.first_token_s] or [0.0]
    return ExtractLaneResult(
        name, size, records, seconds, statistics.fmean(ttft), statistics.median(ttft),
        stats.tokens_generated, stats.tokens_generated / seconds if seconds else 0.0, stats.prefill_tokens,
        identical, stats.parse_errors, constrained,
    )


def run_extract_bench(options: BenchOptions, log: Callable[[str], None] = print) -> tuple[BenchReport, dict]:
    """``prefixcache bench --task <extract task>``: ``(BenchReport, document)``, like :func:`prefixcache.bench.lanes.run_bench`.

    The report's rows are :class:`~prefixcache.bench.lanes.ModeResult` (``label_agreement`` is the share of
    identical outputs); the document's ``extract`` list holds time-to-first-token and tokens/s per lane.
    """
    from ..model.load import load_model, load_random_model, set_threads
    from ..task.definition import load_any_task
    from .workload import ticket_records

    task = load_any_task(options.task)
    threads = set_threads(options.threads)
    if options.model_config:
        loaded = load_random_model(options.model_config, options.dtype, threads, tokenizer_from=options.model)
    else:
        loaded = load_model(options.model, options.dtype, threads)
    extractor = Extractor(loaded, task)
    log(f"model {loaded.identity}, {threads} threads, dtype {dtype_name(loaded.dtype)}, extract task {task.name}")
    floor = decode_floor(loaded.model, loaded.device)
    log_floor(floor, log)
    records = ticket_records(options.items)
    peer = llama_cpp_generate(options.model, extractor, threads, log) if options.llama_cpp else None
    twin = backend_twin(extractor, options.backend, options.batch_size, log)
    lanes = bench_extract(extractor, records, options.batch_size, log, free=Extractor(loaded, task, constrained=False),
                          peer=peer, backend=twin)
    floors = {}
    if peer is not None:
        floors[LLAMA_CPP] = DecodeFloor(floor.memory_read_gb_s, peer.weight_bytes)
        log(f"llama.cpp's own floor: its .gguf is {peer.weight_bytes / 1e6:.1f} MB, so "
            f"{floors[LLAMA_CPP].tokens_per_s:.1f} tokens/s at the same bandwidth")
    lanes = [replace(lane, pct_of_floor=floors.get(lane.mode, floor).pct(lane.tokens_per_s)) for lane in lanes]
    full_seconds = lanes[0].seconds
    for lane in lanes:
        log(
            f"extract lane {lane.mode}, B={lane.batch_size}: time to first token {lane.ttft_ms_mean:.1f} ms (median "
            f"{lane.ttft_ms_p50:.1f}), {lane.tokens_per_s:.1f} tokens/s, {1000 * lane.seconds / lane.records:.1f} "
            f"ms/record, {lane.parse_errors} unparsable, {lane.identical:.0%} identical to "
            + {UNCONSTRAINED: "constrained batched", LLAMA_CPP: "unconstrained batched"}.get(lane.mode, "uncached")
            + (f", {lane.pct_of_floor:.0f}% of the B=1 decoding floor" if lane.pct_of_floor is not None else "")
        )
    rows = [
        ModeResult(
            lane.mode, "gguf" if lane.mode.endswith(LLAMA_CPP) else dtype_name(loaded.dtype), lane.batch_size, lane.records,
            lane.seconds,
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
        "constrained_over_unconstrained": _ratio(lanes, Mode.BATCHED.value, UNCONSTRAINED),
        "backend": None if twin is None else twin.backend.name,
        **floor.to_json(),
        "llama_cpp_weight_bytes": peer.weight_bytes if peer is not None else None,
    }
    return BenchReport(rows, {}), document


def _ratio(lanes: list[ExtractLaneResult], top: str, bottom: str) -> float | None:
    """Lane ``top``'s seconds over lane ``bottom``'s (None when either is missing or took no time)."""
    seconds = {lane.mode: lane.seconds for lane in lanes}
    return seconds[top] / seconds[bottom] if seconds.get(top) and seconds.get(bottom) else None


def log_floor(floor: DecodeFloor, log: Callable[[str], None]) -> None:
    """One line: the measured bandwidth, the weight bytes and the B=1 decoding floor they give."""
    log(
        f"decoding floor (B=1): memory read {floor.memory_read_gb_s:.1f} GB/s / weights {floor.weight_bytes / 1e6:.1f} MB"
        f" = {floor.tokens_per_s:.1f} tokens/s"
    )
