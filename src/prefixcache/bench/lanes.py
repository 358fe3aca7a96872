"""Benchmarks: every mode on the same records in one run, as ratios against ``full``.

A *lane* is one way of classifying the records (a run mode at a dtype, or a
peer such as llama.cpp). All lanes run in the same process, after a warm-up,
on the same records; the first lane (``full``) is the reference for speed-up,
and for label agreement and log-prob drift unless a lane names another reference
(a head lane is compared with ``full`` re-encoding through the same fitted head).

The roofline (:mod:`.roofline`): the machine's square-matmul peak and the peak of the
model's own projection shapes at a batched pass's rows are measured in the same run at
each lane's dtype and thread count, and each lane's achieved FLOP/s is reported as a
percentage of both. FLOPs = 2 x non-embedding parameters x tokens computed, plus the
output-head work actually done (label rows only for first-token).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from ..eval.verify import compare
from ..model.load import LoadedModel
from ..scheduler.classify import Classifier, warmup
from ..types import Mode, Prediction, Record, RunConfig, RunStats
from .memory import PeakRSS
from .workload import example_pool, grow_task


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
    reference: str = "full"  # the lane whose labels and log-probs agreement and drift are measured against
    peak_rss_bytes: int = 0  # the process's highest resident memory while the lane ran
    added_rss_bytes: int = 0  # that peak less the resident memory when the lane started
    pct_of_shape_peak: float | None = None  # achieved FLOP/s against the model's own projection shapes' peak

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
    """A way to classify records: ``run(records) -> (predictions, stats)``.

    ``reference``: the name of an earlier lane whose predictions this lane's agreement and drift are
    measured against (None: the first lane). Speed-up is always against the first lane.
    """

    name: str
    dtype: str
    batch_size: int
    run: Callable[[list[Record]], tuple[list[Prediction], RunStats]]
    gflop_per_token: float = 0.0
    head_gflop_per_record: float = 0.0
    warm: Callable[[], None] = lambda: None
    reference: str | None = None


def classifier_lane(name: str, classifier: Classifier, mode: str, batch_size: int = 1, reference: str | None = None) -> Lane:
    """A lane for one run mode (:class:`~prefixcache.types.Mode`) of ``classifier``."""
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
        reference,
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
    """GFLOP per record of the scoring beyond the record's own tokens: a fitted head's ``[F] x [F, L]``
    product (plus the prompt's label rows for a head on the prompt), first-token's label rows, or whole
    labels' fed label tokens (the trie's inner nodes, or every label's tokens after its first one by
    one) through the model's weights plus a full-vocabulary normalizer at each of them and at the
    record's last token."""
    config = classifier.loaded.model.config.get_text_config(decoder=True)
    hidden, vocab = config.hidden_size, config.vocab_size
    labels = len(classifier.prompt.label_ids)
    fitted = classifier.fitted_head
    if fitted is not None:
        return 2 * (fitted.width + (hidden if fitted.on_prompt else 0)) * labels / 1e9
    if classifier.method == "first-token":
        return 2 * hidden * labels / 1e9
    if classifier.head.label_pass == "trie":
        fed = len(classifier.head.trie.whole)
    else:
        fed = sum(len(ids) - 1 for ids in classifier.prompt.label_ids.values())
    return (2 * nonembedding_params(classifier.loaded.model) * fed + 2 * hidden * vocab * (1 + fed)) / 1e9


@dataclass
class BenchReport:
    """The lanes' rows; ``peaks`` and ``shape_peaks``: GFLOP/s by dtype name (square matmuls; the model's
    projection shapes at a batched pass's rows), empty where not measured."""

    results: list[ModeResult]
    peaks: dict[str, float]
    predictions: dict[str, list[Prediction]] = field(default_factory=dict)
    shape_peaks: dict[str, float] = field(default_factory=dict)


def run_lanes(
    lanes: Sequence[Lane],
    records: list[Record],
    peaks: dict[str, float] | None = None,
    on_lane: Callable[[str], None] | None = None,
    shape_peaks: dict[str, float] | None = None,
) -> BenchReport:
    """Run every lane on ``records``; the first is the reference (for agreement: the lane's own ``reference``).

    ``peaks`` and ``shape_peaks`` (GFLOP/s by dtype name) give each lane's ``pct_of_peak`` and
    ``pct_of_shape_peak`` (None for a dtype without one, or a lane without a FLOP count). The shape peak is
    measured at a batched pass's rows, so it is the ceiling of the batched lanes; B=1 lanes run fewer rows.

    Near ties scale with each lane's own numerical noise: with ``d`` the lane's max
    |Δ log-prob| against the reference, a record is a near tie when the reference's
    top-two log-prob margin is at most ``2 d`` (moving both labels by ``d`` could swap
    them). A disagreement outside the near ties cannot be noise, so the figure
    ``disagreements_outside_ties`` is expected to be 0.
    """
    peaks, shape_peaks = dict(peaks or {}), dict(shape_peaks or {})
    results, outputs, first_of = [], {}, {}
    ref_seconds = 0.0
    for lane in lanes:
        if on_lane:
            on_lane(lane.name)
        lane.warm()
        with PeakRSS() as memory:
            started = time.perf_counter()
            predictions, stats = lane.run(records)
            seconds = time.perf_counter() - started
        if not first_of:
            ref_seconds = seconds
        first_of.setdefault(lane.name, predictions)  # a name's first lane (the float32 one) is its reference
        reference_name = lane.reference or lanes[0].name
        if reference_name not in first_of:
            raise ValueError(f"lane {lane.name!r} is compared with {reference_name!r}, which has not run before it")
        reference = first_of[reference_name]
        agreement = compare(reference, predictions)
        ties = near_tie_ids(reference, 2 * agreement.max_abs_logprob_diff)
        gflop = lane.gflop_per_token * stats.tokens_computed + lane.head_gflop_per_record * len(records)
        outputs[lane.name] = predictions
        results.append(
            ModeResult(
                lane.name, lane.dtype, lane.batch_size, len(records), seconds,
                ref_seconds / seconds if seconds else float("inf"),
                agreement.rate, agreement.max_abs_logprob_diff, stats.tokens_computed,
                gflop, percent_of(gflop, seconds, peaks.get(lane.dtype)),
                len(ties), len(set(agreement.disagreeing_ids) - ties), reference_name,
                memory.bytes, memory.bytes - memory.start_bytes,
                percent_of(gflop, seconds, shape_peaks.get(lane.dtype)),
            )
        )
    return BenchReport(results, peaks, outputs, shape_peaks)


def percent_of(gflop: float, seconds: float, peak_gflops: float | None) -> float | None:
    """Achieved GFLOP/s as a percentage of ``peak_gflops`` (None without a peak, FLOPs or time)."""
    return 100 * gflop / seconds / peak_gflops if peak_gflops and gflop and seconds else None


def near_tie_ids(reference: Sequence[Prediction], noise: float) -> set:
    """Ids of records whose top-two log-prob margin is within ``noise`` (never those with no scores)."""
    if noise <= 0:
        return set()
    return {p.id for p in reference if p.scores is not None and p.scores.margin <= noise}


def compare_modes(
    classifier: Classifier, records: list[Record], batch_size: int = 32, modes=("full", "cached", "batched")
) -> tuple[list[ModeResult], dict[str, list[Prediction]]]:
    """Time each run mode of one classifier on ``records``; the first mode is the reference."""
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


def same_dtype_copy(loaded: LoadedModel, dtype: torch.dtype) -> LoadedModel:
    """The same weights at another dtype (a new module; the original is untouched)."""
    model = copy.deepcopy(loaded.model).to(dtype)
    return LoadedModel(model, loaded.tokenizer, loaded.spec, loaded.identity, dtype, loaded.device)
