"""Many-label lanes of ``prefixcache bench``: a task whose labels share first tokens.

First-token scoring cannot tell such labels apart, so every lane scores whole labels (``full``):

* on the first ``full_items`` records: ``full`` (re-encoding every prompt, through the label trie:
  the reference), ``batched/per-label`` (one continuation row per record and label, as before the
  trie, at a small batch so that it fits in memory) and ``batched`` (the label trie);
* on every record: ``batched`` again, and ``batched+head`` when a fitted head is given (the cheap
  route for many labels when labelled rows exist); their agreement is against that ``batched``
  lane, their speed-up against ``full`` per record.

The lanes share one prefix (a pool), so each lane's peak resident memory is its own work on top of
one model and one prefix. The job reports the label trie's arithmetic floor
per record (:func:`trie_floor`), so every lane's time can be read against what the arithmetic allows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable

from ..cache.config import PoolConfig
from ..cache.pool import PrefixPool
from ..engine.label_trie import LabelTrie
from ..model.load import LoadedModel
from ..scheduler.classify import Classifier
from ..task.definition import Task
from ..types import LABEL_FIELD, Record
from .head_lanes import FIT, bench_head, fit_bench_head, without_head
from .lanes import Lane, classifier_lane, nonembedding_params, run_lanes
from .options import BenchOptions
from .workload import fitting_records

PER_LABEL = "batched/per-label"
SHARED_PREFIX_BUDGET = 2**30  # the lanes' one prefix pool: a 4,000-token prefix of a 135M model is ~190 MiB
FIT_PER_LABEL = 8  # ``--head fit`` with ``--records``: rows per label the head is fitted on, held out of the bench


@dataclass(frozen=True)
class TrieFloor:
    """Per-record arithmetic of whole-label scoring through the trie, and its time at the measured peak.

    ``linear_gflop``: the model's weights over the record's own and the trie's fed tokens;
    ``normalizer_gflop``: the full-vocabulary logits at the record's last token and at every fed node;
    ``prefix_attention_gflop``: those tokens' attention to the prefix (keys and values), which a long
    prefix makes as large as the rest.
    """

    labels: int
    label_tokens: int
    fed_nodes: int
    edges: int
    record_tokens: float
    linear_gflop: float
    normalizer_gflop: float
    prefix_attention_gflop: float
    peak_gflops: float

    @property
    def ms_without_attention(self) -> float:
        return 1000 * (self.linear_gflop + self.normalizer_gflop) / self.peak_gflops

    @property
    def ms(self) -> float:
        return self.ms_without_attention + 1000 * self.prefix_attention_gflop / self.peak_gflops

    def to_json(self) -> dict:
        return asdict(self) | {"ms_without_attention": self.ms_without_attention, "ms": self.ms}


def trie_floor(classifier: Classifier, record_tokens: float, peak_gflops: float) -> TrieFloor:
    """The floor of one record of ``record_tokens`` own tokens, scored over ``classifier``'s prefix."""
    model = classifier.loaded.model
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    trie: LabelTrie = classifier.head.trie
    fed = len(trie.whole)
    tokens = record_tokens + fed
    prefix = len(classifier.prompt.prefix_ids)
    attention = 4 * prefix * head_dim * config.num_attention_heads * config.num_hidden_layers * tokens  # QK and PV
    return TrieFloor(
        labels=len(trie.paths),
        label_tokens=sum(len(p) for p in trie.paths),
        fed_nodes=fed,
        edges=trie.edges,
        record_tokens=record_tokens,
        linear_gflop=2 * nonembedding_params(model) * tokens / 1e9,
        normalizer_gflop=2 * config.hidden_size * config.vocab_size * (1 + fed) / 1e9,
        prefix_attention_gflop=attention / 1e9,
        peak_gflops=peak_gflops,
    )


def gold_accuracy(records: list[Record], predictions: list) -> float | None:
    """The share of ``predictions`` equal to their record's gold label (None: some record has none)."""
    gold = {record.id: record.fields.get(LABEL_FIELD) for record in records}
    if not predictions or None in gold.values():
        return None
    return sum(p.label == gold[p.id] for p in predictions) / len(predictions)


def label_lane_sets(
    options: BenchOptions, loaded: LoadedModel, task: Task, records: list[Record], log: Callable[[str], None]
) -> tuple[list[Lane], list[Lane]]:
    """The lanes run on the first ``options.full_items`` records, and those run on every record."""
    prompt_task = without_head(task)
    pool = PrefixPool(PoolConfig(budget_bytes=SHARED_PREFIX_BUDGET))  # one prefix, shared by every lane
    trie = Classifier(loaded, prompt_task, "full", pool=pool)
    before = Classifier(loaded, prompt_task, "full", pool=pool, label_pass="per-label")
    subset = [
        classifier_lane("full", trie, "full"),
        classifier_lane(PER_LABEL, before, "batched", options.before_batch_size),
        classifier_lane("batched", trie, "batched", options.batch_size),
    ]
    every = [classifier_lane("batched", trie, "batched", options.batch_size)]
    if options.head == FIT and options.records:
        rows = fitting_records(options.records, task, FIT_PER_LABEL, records, options.label_field)
        log(f"fitting a head on {len(rows)} other rows of {options.records} (up to {FIT_PER_LABEL} per label, held out "
            "of the bench's records, so the head's accuracy on them is measured) ...")
        head = fit_bench_head(loaded, prompt_task, rows, options.batch_size, log)
    else:
        head = bench_head(options.head, loaded, task, records, options.batch_size, log)
    if head is not None:
        every.append(classifier_lane("batched+head", Classifier(loaded, prompt_task, pool=pool, head=head), "batched",
                                     options.batch_size))
    return subset, every


def run_label_bench(
    options: BenchOptions, loaded: LoadedModel, task: Task, records: list[Record], peak_gflops: float, log: Callable[[str], None]
) -> tuple[list, dict]:
    """Run both lane sets; returns (results, the document's ``labels`` entry)."""
    subset_lanes, every_lanes = label_lane_sets(options, loaded, task, records, log)
    subset = records[: options.full_items]
    peaks = {"float32": peak_gflops}
    log(f"many labels: full, {PER_LABEL} (B={options.before_batch_size}) and batched on {len(subset)} records, "
        f"then batched (and batched+head) on {len(records)}")
    first = run_lanes(subset_lanes, subset, peaks, on_lane=lambda name: log(f"running {name} on {len(subset)} items ..."))
    second = run_lanes(every_lanes, records, peaks, on_lane=lambda name: log(f"running {name} on {len(records)} items ..."))
    full_ms = first.results[0].ms_per_item
    second.results[:] = [replace(r, speedup_vs_full=full_ms / r.ms_per_item) for r in second.results]  # against full, too
    tokenizer = loaded.tokenizer
    own = [len(tokenizer(str(r.fields.get("text", "")), add_special_tokens=False)["input_ids"]) for r in records]
    floor = trie_floor(Classifier(loaded, without_head(task), "full"), sum(own) / len(own), peak_gflops)
    log(f"trie: {floor.labels} labels, {floor.label_tokens} label tokens, {floor.fed_nodes} fed nodes, {floor.edges} edges; "
        f"floor {floor.ms:.0f} ms/record ({floor.ms_without_attention:.0f} ms without the prefix attention)")
    document = {
        "floor": floor.to_json(),
        "subset_items": len(subset),
        "subset_modes": [r.to_json() | {"gold_accuracy": gold_accuracy(subset, first.predictions[r.mode])} for r in first.results],
        "modes": [r.to_json() | {"gold_accuracy": gold_accuracy(records, second.predictions[r.mode])} for r in second.results],
    }
    for mode in document["modes"]:
        if mode["gold_accuracy"] is not None:
            log(f"{mode['mode']}: {100 * mode['gold_accuracy']:.1f}% of {len(records)} records get their gold label")
    return first.results + second.results, document
