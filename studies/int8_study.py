# Study behind docs/benchmarks.md, "int8 weights on an AVX2 CPU" (its table).
"""Can int8 weights from a kernel library PyTorch ships speed up the embedded model on this CPU, with labels
that agree with float32? (issue 20, item 1). One run, side by side:

* ``float32``: the reference (full re-encoding) and the batched lane;
* ``int8 dynamic (per-tensor)``: ``torch.ao.quantization.quantize_dynamic`` on every decoder linear layer
  (fbgemm: int8 weights, activations quantized per tensor on the fly);
* ``int8 dynamic (per-channel weights)``: the same with per-channel weight scales;
* the same with ``down_proj`` / ``o_proj`` / ``v_proj`` left in float32 (where activation outliers live);
* ``int8 weight-only``: ``torch._weight_int8pack_mm`` (float activations, int8 weights), timed per layer shape.

Prints ms/item of the batched lane, the speedup over float32 batched, label agreement with full float32 and
the largest |log-prob difference|, on ``--items`` synthetic tickets of the bench's default task.

    python studies/int8_study.py --items 60
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch

from prefixcache.bench.workload import ticket_records
from prefixcache.model.load import LoadedModel, load_model
from prefixcache.scheduler.classify import Classifier
from prefixcache.task.definition import load_task
from prefixcache.types import RunConfig


def quantized(base: LoadedModel, per_channel: bool, keep_float: tuple[str, ...]) -> LoadedModel:
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig, quantize_dynamic

    model = copy.deepcopy(base.model)
    qconfig = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
    spec = {name: qconfig for name, module in model.model.named_modules()
            if isinstance(module, torch.nn.Linear) and not any(part in name for part in keep_float)}
    model.model = quantize_dynamic(model.model, spec, dtype=torch.qint8)
    return LoadedModel(model, base.tokenizer, base.spec, base.identity, torch.float32, base.device)


def timed(classifier: Classifier, records, mode: str, batch: int):
    classifier.classify_all(records[:2], RunConfig(mode, batch))  # warm-up
    started = time.perf_counter()
    out = classifier.classify_all(records, RunConfig(mode, batch))
    return out, (time.perf_counter() - started) / len(records)


def weight_only_ratio(threads: int) -> list[tuple[int, float]]:
    """float32 linear time / int8 weight-only (``_weight_int8pack_mm``) time at M rows, 1536x576 weights."""
    torch.set_num_threads(threads)
    weights = [torch.randn(1536, 576) for _ in range(30)]
    packed = [torch.randint(-127, 127, (1536, 576), dtype=torch.int8) for _ in range(30)]
    scales = torch.rand(1536)
    out = []
    for rows in (1, 32):
        x = torch.randn(rows, 576)
        runs = []
        for fn in (lambda: [torch.nn.functional.linear(x, w) for w in weights],
                   lambda: [torch._weight_int8pack_mm(x, w, scales) for w in packed]):
            fn()
            started = time.perf_counter()
            for _ in range(3):
                fn()
            runs.append(time.perf_counter() - started)
        out.append((rows, runs[0] / runs[1]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # torch.ao's deprecation notices
    base = load_model("smollm2-135m", "float32", args.threads)
    task = load_task("tickets-compact")
    records = ticket_records(args.items)
    reference, _ = timed(Classifier(base, task), records, "full", 1)
    _, f32_ms = timed(Classifier(base, task), records, "batched", args.batch_size)
    print("| lane | ms/item (batched) | x float32 batched | labels = full float32 | max abs log-prob diff |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| float32 | {1000 * f32_ms:.1f} | 1.00x | 100.0% | 0 |")
    variants = [("int8 dynamic, per-tensor weights", False, ()), ("int8 dynamic, per-channel weights", True, ()),
                ("int8 per-channel, down_proj float", True, ("down_proj",)),
                ("int8 per-channel, down/o/v_proj float", True, ("down_proj", "o_proj", "v_proj"))]
    for name, per_channel, keep in variants:
        out, ms = timed(Classifier(quantized(base, per_channel, keep), task), records, "batched", args.batch_size)
        agree = sum(a.label == b.label for a, b in zip(reference, out)) / len(records)
        diff = max(max(abs(x - y) for x, y in zip(a.scores.logprobs, b.scores.logprobs)) for a, b in zip(reference, out))
        print(f"| {name} | {1000 * ms:.1f} | {f32_ms / ms:.2f}x | {100 * agree:.1f}% | {diff:.2f} |")
    for rows, ratio in weight_only_ratio(torch.get_num_threads()):
        print(f"\nint8 weight-only (_weight_int8pack_mm) at M={rows}: {ratio:.2f}x the float32 linear's speed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
