# Study behind docs/benchmarks.md, "Lean decoder", "Weight-only int4" (its extraction agreement table).
"""Extraction through the engine with weight-only int4 decode steps against bfloat16, on the same records.

The int4 model is the lean decoder with every linear layer of the stack quantized from the float32 weights
(groups of 32, min/max: the Q4_1 scheme the embedded ``.gguf`` ships, see ``lean_decode_bench.Int4Linear``).
A layer multiplies through the int4 kernel when it sees at most ``--small`` rows, and through its bfloat16
weights otherwise: torch's int4 CPU kernel is about 2x faster than a bfloat16 matmul at one row and 2-2.5x
slower at 64 or more, so prompts keep the bfloat16 weights. Lanes alternate, twice each.

    PYTHONPATH=src python studies/int4_extract_agreement.py --items 48 --batch-size 1
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from lean_decode_bench import Int4Linear
from prefixcache.bench.workload import ticket_records
from prefixcache.model.load import load_model, set_threads
from prefixcache.scheduler.extract import ExtractStats, Extractor
from prefixcache.task.definition import load_any_task
from prefixcache.types import Mode, RunConfig


class SmallRowsInt4(torch.nn.Module):
    """A linear layer that multiplies ``small`` rows or fewer through int4 weights, more through its own."""

    def __init__(self, linear: torch.nn.Linear, small: int):
        super().__init__()
        self.int4, self.linear, self.small = Int4Linear(linear), linear, small

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.int4(x) if x.numel() // x.shape[-1] <= self.small else self.linear(x)


def int4_model(small: int) -> torch.nn.Module:
    model = load_model("smollm2-135m", "float32", set_threads(None)).model
    for layer in model.base_model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, SmallRowsInt4(child, small))
    return model.to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--small", type=int, default=8, help="the most rows a layer multiplies through int4")
    args = parser.parse_args()
    task, records = load_any_task("ticket-fields"), ticket_records(args.items)
    base = load_model("smollm2-135m", "bfloat16", set_threads(None))
    lanes = {"bfloat16": base, "int4 decode steps": replace(base, model=int4_model(args.small))}
    outputs, seconds = {}, {name: 0.0 for name in lanes}
    for name in list(lanes) * 2:
        extractor = Extractor(lanes[name], task)
        extractor.prefix  # built before the clock starts
        extractor.extract_all(records[:2], RunConfig(Mode.BATCHED, 2), stats=ExtractStats())  # warms the kernels
        started = time.perf_counter()
        outputs[name] = extractor.extract_all(records, RunConfig(Mode.BATCHED, args.batch_size), stats=ExtractStats())
        seconds[name] += time.perf_counter() - started
    base_out, int4_out = outputs.values()
    same = sum(a.fields == b.fields for a, b in zip(base_out, int4_out))
    print(f"{args.items} records, batch {args.batch_size}, int4 at <= {args.small} rows\n")
    print("| lane | seconds (2 runs) | records/s |\n|---|---|---|")
    for name, total in seconds.items():
        print(f"| {name} | {total:.1f} | {2 * args.items / total:.2f} |")
    print(f"\nint4 / bfloat16 records/s: {seconds['bfloat16'] / seconds['int4 decode steps']:.2f}x; "
          f"identical fields: {same}/{args.items}")


if __name__ == "__main__":
    main()
