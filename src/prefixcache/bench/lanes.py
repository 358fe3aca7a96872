"""Benchmarks: every mode on the same records in one run, as ratios against ``full``.

A *lane* is one way of classifying the records (a runner mode at a dtype, or a
peer such as llama.cpp). All lanes run in the same process, after a warm-up,
on the same records; the first lane (``full``) is the reference for speed-up,
label agreement and log-prob drift.

The roofline: the machine's matmul peak is measured in the same run at each
lane's dtype and thread count, and each lane's achieved FLOP/s is reported as
a percentage of it. FLOPs = 2 x non-embedding parameters x tokens computed,
plus the output-head work actually done (label rows only for first-token).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from ..run.classify import Classifier, warmup
from ..types import Mode, Prediction, Record, RunConfig, RunStats
from ..eval.verify import compare
from .options import BenchOptions


@dataclass(frozen=True)
class ModeResult:
    """One lane's figures. Ratios are against the reference lane (``full``)."""

    mode: str
    dtype: str
    batch_size: int
    records: int
    seconds: float
    speedup_vs_full: float
    label_agreement: float
    max_abs_logprob_diff: float
    tokens_computed: int
    gflop: float = 0.0
    pct_of_peak: float | None = None
    near_ties: int = 0
    disagreements_outside_ties: int = 0

    @property
    def ms_per_item(self) -> float:
        return 1000 * self.seconds / self.records if self.records else 0.0

    @property
    def items_per_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict:
        return asdict(self) | {"ms_per_item": self.ms_per_item, "items_per_s": self.items_per_s}


@dataclass(frozen=True)
class Lane:
    """A way to classify records: ``run(records) -> (predictions, stats)``."""

    name: str
    dtype: str
    batch_size: int
    run: Callable[[list[Record]], tuple[list[Prediction], RunStats]]
    gflop_per_token: float = 0.0
    head_gflop_per_record: float = 0.0
    warm: Callable[[], None] = lambda: None


def classifier_lane(name: str, classifier: Classifier, mode: str, batch_size: int = 1) -> Lane:
    """A lane for one runner mode of ``classifier``."""
    config = RunConfig(mode, Mode(mode).pass_size(batch_size))

    def run(records: list[Record]):
        stats = RunStats()
        return classifier.classify_all(records, config, stats=stats), stats

    model = classifier.loaded.model
    return Lane(
        name,
        dtype_name(classifier.loaded.dtype),
        config.batch_size,
        run,
        2 * nonembedding_params(model) / 1e9,
        head_gflop(classifier),
        lambda: warmup(classifier),
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nonembedding_params(model: torch.nn.Module) -> int:
    """Parameters excluding the input embedding (and the output head when it is tied)."""
    total = sum(p.numel() for p in model.parameters())  # shared (tied) tensors are counted once
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    untied_head = head.weight.numel() if head is not None and head.weight is not embedding else 0
    return total - embedding.numel() - untied_head


def head_gflop(classifier: Classifier) -> float:
    """Output-head GFLOP per record actually done by the scoring method."""
    config = classifier.loaded.model.config.get_text_config(decoder=True)
    hidden, vocab = config.hidden_size, config.vocab_size
    labels = len(classifier.prompt.label_ids)
    if classifier.method == "first-token":
        return 2 * hidden * labels / 1e9
    steps = 1 + sum(len(ids) - 1 for ids in classifier.prompt.label_ids.values())
    return 2 * hidden * vocab * steps / 1e9


def matmul_peak_gflops(
    dtype: torch.dtype, device: torch.device | str = "cpu", seconds: float = 0.6, sizes: Sequence[int] | None = None
) -> float:
    """Best sustained GFLOP/s of square matmuls at ``dtype`` on ``device`` (CPU: the current thread count).

    Default sizes are 1024 and 2048 on a CPU, 4096 and 8192 on a GPU (smaller ones leave a GPU idle).
    GPU work is asynchronous, so each timing ends with a synchronize.
    """
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = 0.0
    for n in sizes or ((4096, 8192) if device.type == "cuda" else (1024, 2048)):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        a @ b  # warm-up
        sync()
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            a @ b
            count += 1
            sync()
        best = max(best, 2 * n**3 * count / (time.perf_counter() - started) / 1e9)
    return best


@dataclass
class BenchReport:
    results: list[ModeResult]
    peaks: dict[str, float]
    predictions: dict[str, list[Prediction]] = field(default_factory=dict)


def run_lanes(
    lanes: Sequence[Lane],
    records: list[Record],
    peaks: dict[str, float] | None = None,
    on_lane: Callable[[str], None] | None = None,
) -> BenchReport:
    """Run every lane on ``records``; the first is the reference.

    Near ties scale with each lane's own numerical noise: with ``d`` the lane's max
    |Δ log-prob| against the reference, a record is a near tie when the reference's
    top-two log-prob margin is at most ``2 d`` (moving both labels by ``d`` could swap
    them). A disagreement outside the near ties cannot be noise, so the figure
    ``disagreements_outside_ties`` is expected to be 0.
    """
    peaks = dict(peaks or {})
    results, outputs = [], {}
    reference: list[Prediction] | None = None
    ref_seconds = 0.0
    for lane in lanes:
        if on_lane:
            on_lane(lane.name)
        lane.warm()
        started = time.perf_counter()
        predictions, stats = lane.run(records)
        seconds = time.perf_counter() - started
        if reference is None:
            reference, ref_seconds = predictions, seconds
        agreement = compare(reference, predictions)
        ties = near_tie_ids(reference, 2 * agreement.max_abs_logprob_diff)
        gflop = lane.gflop_per_token * stats.tokens_computed + lane.head_gflop_per_record * len(records)
        peak = peaks.get(lane.dtype)
        outputs[lane.name] = predictions
        results.append(
            ModeResult(
                lane.name,
                lane.dtype,
                lane.batch_size,
                len(records),
                seconds,
                ref_seconds / seconds if seconds else float("inf"),
                agreement.rate,
                agreement.max_abs_logprob_diff,
                stats.tokens_computed,
                gflop,
                100 * gflop / seconds / peak if peak and gflop else None,
                len(ties),
                len(set(agreement.disagreeing_ids) - ties),
            )
        )
    return BenchReport(results, peaks, outputs)


def near_tie_ids(reference: Sequence[Prediction], noise: float) -> set:
    """Ids of records whose top-two log-prob margin is within ``noise`` (never those with no scores)."""
    if noise <= 0:
        return set()
    return {p.id for p in reference if p.scores is not None and p.scores.margin <= noise}


def compare_modes(
    classifier: Classifier, records: list[Record], batch_size: int = 32, modes=("full", "cached", "batched")
) -> tuple[list[ModeResult], dict[str, list[Prediction]]]:
    """Time each runner mode of one classifier on ``records``; the first mode is the reference."""
    lanes = [classifier_lane(mode, classifier, mode, batch_size) for mode in modes]
    report = run_lanes(lanes, records)
    return report.results, report.predictions


@dataclass(frozen=True)
class SweepPoint:
    """Per-item time of ``full`` and ``batched`` at one prefix length."""

    prefix_tokens: int
    examples: int
    full_ms_per_item: float
    batched_ms_per_item: float

    @property
    def speedup(self) -> float:
        return self.full_ms_per_item / self.batched_ms_per_item if self.batched_ms_per_item else float("inf")


def sweep_prefix(
    loaded,
    base_task,
    records: list[Record],
    targets: Sequence[int],
    batch_size: int,
    full_items: int,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> list[SweepPoint]:
    """Grow ``base_task``'s prefix through ``targets`` tokens; time full (on ``full_items`` records) and batched."""
    from .workload import example_pool, grow_task

    pool = example_pool({str(r.fields.get("text")) for r in records})
    points = []
    for target in targets:
        task = grow_task(base_task, loaded.tokenizer, target, pool)
        classifier = Classifier(loaded, task, "auto")
        timings = []
        for mode, subset in (("full", records[:full_items]), ("batched", records)):
            lane = classifier_lane(mode, classifier, mode, batch_size)
            lane.warm()
            started = time.perf_counter()
            lane.run(subset)
            timings.append(1000 * (time.perf_counter() - started) / len(subset))
        point = SweepPoint(len(classifier.prompt.prefix_ids), len(task.examples), *timings)
        points.append(point)
        if on_point:
            on_point(point)
    return points


def same_dtype_copy(loaded, dtype: torch.dtype):
    """The same weights at another dtype (a new module; the original is untouched)."""
    import copy

    from ..model.load import LoadedModel

    model = copy.deepcopy(loaded.model).to(dtype)
    return LoadedModel(model, loaded.tokenizer, loaded.spec, loaded.identity, dtype, loaded.device)


def build_lanes(options: BenchOptions, log: Callable[[str], None]) -> tuple[list[Lane], dict, object]:
    """Load the model(s) and make the lanes: full, cached, batched in float32, then full and batched at
    the ``auto`` dtype when that differs, then llama.cpp when available."""
    from ..model.load import load_model, load_random_model, resolve_device, resolve_dtype, set_threads
    from .peers import llama_cpp_lane
    from ..spec.task import load_task

    task = load_task(options.task)
    threads = set_threads(options.threads)
    run_dtype = resolve_dtype(options.dtype, resolve_device(None))
    if options.model_config:
        base = load_random_model(options.model_config, "float32", threads, tokenizer_from=options.model)
    else:
        base = load_model(options.model, "float32", threads)
    log(f"model {base.identity}, {threads} threads, run dtype {dtype_name(run_dtype)}")
    reference = Classifier(base, task)
    lanes = [
        classifier_lane("full", reference, "full"),
        classifier_lane("cached", reference, "cached"),
        classifier_lane("batched", reference, "batched", options.batch_size),
    ]
    if run_dtype != torch.float32:
        fast = Classifier(same_dtype_copy(base, run_dtype), task)
        lanes += [
            classifier_lane("full", fast, "full"),
            classifier_lane("batched", fast, "batched", options.batch_size),
        ]
    if options.llama_cpp and not options.model_config:
        lane = llama_cpp_lane(options.model, reference, threads, log)
        if lane is not None:
            lanes.append(lane)
    meta = {"dtype": dtype_name(run_dtype), "threads": threads, "prefix_tokens": len(reference.prompt.prefix_ids), "task": task.name, "model": base.identity}
    return lanes, meta, base


def run_bench(options: BenchOptions, log: Callable[[str], None] = print) -> tuple[BenchReport, dict]:
    """Run every lane on the workload and return the report plus the JSON document.

    An extraction task (``kind: extract``) runs :func:`prefixcache.run.extract.run_extract_bench` instead.
    """
    from ..spec.task import ExtractTask, load_any_task
    from .workload import ticket_records

    if isinstance(load_any_task(options.task), ExtractTask):
        from ..run.extract import run_extract_bench

        return run_extract_bench(options, log)
    lanes, meta, base = build_lanes(options, log)
    records = ticket_records(options.items)
    dtypes = sorted({lane.dtype for lane in lanes if lane.dtype in ("float32", "bfloat16", "float16")})
    peaks = {d: matmul_peak_gflops(getattr(torch, d), base.device) for d in dtypes}
    log("matmul peak: " + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in peaks.items()))
    report = run_lanes(lanes, records, peaks, on_lane=lambda name: log(f"running {name} on {len(records)} items ..."))
    tokenizer = base.tokenizer
    suffix_tokens = [len(tokenizer(str(r.fields["text"]), add_special_tokens=False)["input_ids"]) for r in records]
    document = {
        **meta,
        "items": len(records),
        "peak_gflops": peaks.get(meta["dtype"]),
        "peaks_gflops": peaks,
        "mean_suffix_tokens": sum(suffix_tokens) / len(suffix_tokens),
        "modes": [r.to_json() for r in report.results],
    }
    if options.sweep_targets:
        from ..spec.task import load_task

        points = sweep_prefix(
            base if meta["dtype"] == "float32" else same_dtype_copy(base, getattr(torch, meta["dtype"])),
            load_task(options.task),
            records[: options.sweep_items],
            options.sweep_targets,
            options.batch_size,
            options.sweep_full_items,
            on_point=lambda p: log(f"sweep: prefix {p.prefix_tokens} tokens: full {p.full_ms_per_item:.1f} ms/item, batched {p.batched_ms_per_item:.2f} ms/item"),
        )
        document["sweep"] = [asdict(p) | {"speedup": p.speedup} for p in points]
    return report, document
