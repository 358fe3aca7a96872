# Study behind docs/benchmarks.md, "Generation backends": what llama.cpp's decode costs by tokens, and where rows'
# prompts are the cheaper: on llama.cpp or on torch (TorchPrefill).
"""Two measurements in one run, one JSON naming its machine.

1. One ``llama_decode`` call of 1, 2, 4, 8, 16 tokens of one sequence, and of 8 sequences of 1 token, after a
   300-token prefix (median of 20 calls each): whether llama.cpp's cost here follows the weights it reads or the
   tokens it computes.
2. ``ticket-fields`` extraction on the bundled tickets through llama.cpp's rows, with the rows' prompts decoded by
   llama.cpp or computed on torch and placed in its cells, at float32 and bfloat16 torch weights, one record at a
   time and 8 at once: ms a record, time to the first token, and the share of records equal to torch's own batched
   extraction at that dtype.

    .venv/bin/python studies/llama_prefill_cost.py --json docs/bench/llama-prefill-cost.json
"""

from __future__ import annotations

import json
import statistics
import time

from prefixcache.bench.workload import ticket_records
from prefixcache.model.llama_cpp import ContextShape, LlamaCpp
from prefixcache.model.load import embedded_gguf, load_model
from prefixcache.scheduler.backend_choice import llama_generation
from prefixcache.scheduler.extract import Extractor, ExtractStats
from prefixcache.task.definition import load_any_task
from prefixcache.types import Mode, RunConfig
from study_run import study_args


def decode_cost(threads: int) -> list[dict]:
    """Median ms of one decode call per (tokens per sequence, sequences), after a 300-token prefix."""
    llama = LlamaCpp(embedded_gguf("smollm2-135m"), ContextShape(4096, 8, 512, threads))
    llama.decode(list(range(100, 400)), list(range(300)), [0] * 300, [299])
    for seq in range(1, 8):
        llama.copy_sequence(0, seq)
    rows = []
    for tokens, seqs in [(1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (1, 8)]:
        times, position = [], 300
        for _ in range(20):
            ids = [500 + i for _ in range(seqs) for i in range(tokens)]
            positions = [position + i for _ in range(seqs) for i in range(tokens)]
            owners = [s for s in range(seqs) for _ in range(tokens)]
            started = time.perf_counter()
            llama.decode(ids, positions, owners, [(s + 1) * tokens - 1 for s in range(seqs)])
            times.append(time.perf_counter() - started)
            position += tokens
        for seq in range(8):
            llama.lc.llama_memory_seq_rm(llama._memory, seq, 300, -1)
        rows.append({"tokens_per_sequence": tokens, "sequences": seqs, "ms": 1000 * statistics.median(times)})
        print(rows[-1], flush=True)
    llama.close()
    return rows


def prompt_placement(dtype: str, items: int, threads: int) -> list[dict]:
    """Extraction lanes through llama.cpp with prompts decoded there or computed on torch (see the docstring)."""
    loaded = load_model("smollm2-135m", dtype, threads)
    task = load_any_task("ticket-fields")
    records = ticket_records(items)
    reference = Extractor(loaded, task).extract_all(records, RunConfig(Mode.BATCHED, 8))
    lanes = []
    for on_torch in (False, True):
        extractor = Extractor(loaded, task)
        extractor.backend = llama_generation(loaded, 8)
        extractor.backend.prompts_on_torch = on_torch
        extractor.extract_all(records[:2], RunConfig(Mode.BATCHED, 1))  # the holder placed, kernels warm
        for size in (1, 8):
            stats, started = ExtractStats(), time.perf_counter()
            out = extractor.extract_all(records, RunConfig(Mode.CACHED if size == 1 else Mode.BATCHED, size), stats=stats)
            seconds = time.perf_counter() - started
            lanes.append({"dtype": dtype, "prompts": "torch" if on_torch else "llama.cpp", "batch": size,
                          "ms_per_record": 1000 * seconds / len(records),
                          "first_token_ms": 1000 * statistics.fmean(stats.first_token_s),
                          "equal_to_torch": sum(a.fields == b.fields for a, b in zip(reference, out)) / len(records)})
            print(lanes[-1], flush=True)
    return lanes


def main() -> None:
    args, threads, facts = study_args(__doc__, items=24)
    document = {**facts, "decode_calls": decode_cost(threads),
                "prompt_placement": prompt_placement("float32", args.items, threads)
                + prompt_placement("bfloat16", args.items, threads)}
    args.json.write_text(json.dumps(document, indent=1) + "\n")

if __name__ == "__main__":
    main()
