"""What the plain lane checks and measures against: the requests, the task's snapshot, the sequential result of
every distinct text in this process, and the engine's own ceiling on the same items (no HTTP)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .options import LoadTestOptions


def snapshot_task(spec: str, folder: str) -> str:
    """Copy the task's YAML (a bundled name or a path) into ``folder``; return the copy's path."""
    source = Path(spec)
    if source.is_file():
        text = source.read_text(encoding="utf-8")
    else:
        text = (resources.files("prefixcache.tasks") / f"{spec}.yaml").read_text(encoding="utf-8")
    target = Path(folder) / "task.yaml"
    target.write_text(text, encoding="utf-8")
    return str(target)


def workload(n_requests: int, per_request: int, distinct: int) -> list[list[dict]]:
    """Requests of bundled support tickets (``distinct`` of them, cycled), each item with a unique id."""
    from ...io.records import bundled_dataset

    with open(bundled_dataset(), encoding="utf-8") as fh:
        texts = [json.loads(line)["text"] for line in fh if line.strip()][:distinct]
    items = [{"id": f"q{i}", "text": texts[i % len(texts)]} for i in range(n_requests * per_request)]
    return [items[i : i + per_request] for i in range(0, len(items), per_request)]


@dataclass
class Ceiling:
    """What the engine itself does on the same items, in this process, with no HTTP: the most any
    server can reach, since a server pass is an engine pass.

    ``ideal_ms`` is the batched per-item time at 100% of the measured matmul peak, counting the
    linear layers' and the attention's FLOPs only; ``bound`` is the ratio even that would give.
    """

    one_ms: float  # per item, one item per pass (the reference run)
    batched_ms: float  # per item, ``batch`` items per pass
    batch: int
    ideal_ms: float
    peak_gflops: float
    dtype: str

    @property
    def ratio(self) -> float:
        return self.one_ms / self.batched_ms

    @property
    def bound(self) -> float:
        return self.one_ms / self.ideal_ms


def sequential_reference(options: LoadTestOptions, requests) -> tuple[dict[str, object], Ceiling, float]:
    """Every distinct text classified alone, in this process (text -> Prediction), the engine's ceiling, and
    the tolerance (``options.tolerance``, else 1e-4 in float32 and 0.1 in a 16-bit dtype)."""
    import torch

    from ...model.load import load_model
    from ...scheduler.classify import Classifier, warmup
    from ...task.definition import load_task
    from ...types import Record, RunConfig, RunStats

    served = options.served
    loaded = load_model(served.model, served.dtype, served.threads)
    tolerance = options.tolerance
    if tolerance is None:
        tolerance = 1e-4 if loaded.dtype == torch.float32 else 0.1
    classifier = Classifier(loaded, load_task(options.task))
    texts = list(dict.fromkeys(item["text"] for request in requests for item in request))
    records = [Record(text, {"text": text}) for text in texts]
    warmup(classifier)
    started = time.perf_counter()
    stats = RunStats()
    predictions = classifier.classify_all(records, RunConfig("cached", 1), stats=stats)
    one_ms = 1000 * (time.perf_counter() - started) / len(records)
    batched_ms = float("inf")
    for _ in range(2):  # best of two: the figure is a ceiling
        started = time.perf_counter()
        classifier.classify_all(records, RunConfig("batched", options.max_batch))
        batched_ms = min(batched_ms, 1000 * (time.perf_counter() - started) / len(records))
    ceiling = engine_ceiling(classifier, stats.tokens_computed / len(records), (one_ms, batched_ms), options.max_batch)
    print(f"sequential reference: {len(records)} distinct items one per pass in-process, {1000 / one_ms:.1f} items/s "
          f"({loaded.identity}, {ceiling.dtype})", flush=True)
    return {p.id: p for p in predictions}, ceiling, tolerance


def engine_ceiling(classifier, own: float, timings: tuple[float, float], batch: int) -> Ceiling:
    """The :class:`Ceiling` from the measured (one per pass, batched) ms per item and ``own`` tokens per item."""
    from ..lanes import nonembedding_params
    from ..roofline import matmul_peak_gflops

    loaded = classifier.loaded
    dtype = str(loaded.dtype).removeprefix("torch.")
    peak = matmul_peak_gflops(loaded.dtype, loaded.device)
    config = loaded.model.config.get_text_config(decoder=True)
    prefix = len(classifier.prompt.prefix_ids)
    width = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    per_token = 2 * nonembedding_params(loaded.model) + 4 * config.num_hidden_layers * width * (prefix + own / 2)
    ideal_ms = 1000 * per_token * own / (peak * 1e9)
    return Ceiling(timings[0], timings[1], batch, ideal_ms, peak, dtype)
