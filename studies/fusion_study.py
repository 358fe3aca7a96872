# Study behind docs/benchmarks.md, "bfloat16 on a CPU with AVX512-BF16 and no AMX" (the fused elementwise work table).
"""Does fusing the elementwise work of each decoder layer pay on this CPU? (issue 20, item 2). One run:

* ``eager``: the batched lane at ``--dtype`` (bfloat16 by default), as every command runs it;
* ``compiled MLP + norms``: the same model with each layer's MLP and its two RMSNorms wrapped in
  ``torch.compile(dynamic=True)`` (Inductor fuses SwiGLU's ``silu * up`` and RMSNorm's upcast, square, mean,
  rsqrt and scale into single kernels; the attention, which the shared prefix replaces, stays eager);
* ``compiled norms``: only the two RMSNorms compiled.

The lanes alternate for ``--rounds`` rounds on the same records (so load drift hits all alike); the table
gives each lane's median ms/item, its speed against eager, the compile time it paid (its first call), and its
labels and largest |log-prob difference| against the eager lane of the same dtype.

    python studies/fusion_study.py --items 256
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

from prefixcache.bench.workload import ticket_records
from prefixcache.model.load import LoadedModel, cpu_has_fast_bf16, load_model
from prefixcache.scheduler.classify import Classifier
from prefixcache.task.definition import load_task
from prefixcache.types import RunConfig


def compiled(base: LoadedModel, parts: tuple[str, ...]) -> LoadedModel:
    """A copy of ``base`` whose decoder layers have ``parts`` (attribute names) wrapped in torch.compile."""
    model = copy.deepcopy(base.model)
    for layer in model.model.layers:
        for part in parts:
            setattr(layer, part, torch.compile(getattr(layer, part), dynamic=True))
    return LoadedModel(model, base.tokenizer, base.spec, base.identity, base.dtype, base.device)


def run(classifier: Classifier, records, batch: int):
    started = time.perf_counter()
    out = classifier.classify_all(records, RunConfig("batched", batch))
    return out, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    base = load_model("smollm2-135m", args.dtype, args.threads)
    task = load_task("tickets-compact")
    records = ticket_records(args.items)
    lanes = {"eager": Classifier(base, task),
             "compiled MLP + norms": Classifier(compiled(base, ("mlp", "input_layernorm", "post_attention_layernorm")), task),
             "compiled norms": Classifier(compiled(base, ("input_layernorm", "post_attention_layernorm")), task)}
    first, outputs, times = {}, {}, {name: [] for name in lanes}
    for name, classifier in lanes.items():  # the first call pays compilation (and warms the eager lane)
        outputs[name], first[name] = run(classifier, records[: args.batch_size * 2], args.batch_size)
    for _ in range(args.rounds):
        for name, classifier in lanes.items():
            outputs[name], seconds = run(classifier, records, args.batch_size)
            times[name].append(1000 * seconds / len(records))
    print(f"CPU: AVX512-BF16 {'yes' if cpu_has_fast_bf16() else 'no'}; {torch.get_num_threads()} threads; "
          f"{args.dtype}; {len(records)} records, B = {args.batch_size}, medians of {args.rounds} alternated rounds\n")
    print("| lane | ms/item | x eager | first call s (compile) | labels = eager | max abs log-prob diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    eager = statistics.median(times["eager"])
    for name in lanes:
        ms = statistics.median(times[name])
        agree = sum(a.label == b.label for a, b in zip(outputs["eager"], outputs[name])) / len(records)
        diff = max(max(abs(x - y) for x, y in zip(a.scores.logprobs, b.scores.logprobs))
                   for a, b in zip(outputs["eager"], outputs[name]))
        print(f"| {name} | {ms:.1f} | {eager / ms:.2f}x | {first[name]:.1f} | {100 * agree:.1f}% | {diff:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
