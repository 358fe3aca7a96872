# Study behind docs/benchmarks.md, "Generation backends": which blocks llama.cpp's rows should read.
"""``ticket-fields`` extraction through llama.cpp's rows on the ``.gguf``'s own blocks and on the same weights
requantized (``model/requantize.py``: Q8_0, Q4_0), side by side in one run: ms a record one at a time and 8 at once,
time to the first token, and the share of records whose fields equal torch's float32 extraction of the same
records (torch reads the ``.gguf``'s own blocks, dequantized). One JSON naming its machine.

    .venv/bin/python studies/llama_weights.py --json docs/bench/llama-weights.json
"""

from __future__ import annotations

import json
import statistics
import time

from prefixcache.bench.workload import ticket_records
from prefixcache.model.load import load_model
from prefixcache.scheduler.backend_choice import llama_generation
from prefixcache.scheduler.extract import Extractor, ExtractStats
from prefixcache.task.definition import load_any_task
from prefixcache.types import Mode, RunConfig
from study_run import study_args

KINDS = ("own", "q8_0", "q4_0")


def main() -> None:
    args, threads, facts = study_args(__doc__, items=48)
    loaded = load_model("smollm2-135m", "float32", threads)
    task = load_any_task("ticket-fields")
    records = ticket_records(args.items)
    reference = Extractor(loaded, task).extract_all(records, RunConfig(Mode.BATCHED, 8))
    lanes = []
    for kind in KINDS:
        extractor = Extractor(loaded, task)
        extractor.backend = llama_generation(loaded, 8, weights=kind)
        extractor.extract_all(records[:2], RunConfig(Mode.BATCHED, 1))  # the file made, the holder placed, warm
        for size in (1, 8):
            stats, started = ExtractStats(), time.perf_counter()
            out = extractor.extract_all(records, RunConfig(Mode.CACHED if size == 1 else Mode.BATCHED, size), stats=stats)
            seconds = time.perf_counter() - started
            lanes.append({"weights": kind, "batch": size, "ms_per_record": 1000 * seconds / len(records),
                          "first_token_ms": 1000 * statistics.fmean(stats.first_token_s),
                          "tokens_generated": stats.tokens_generated,
                          "records_equal_to_torch": sum(a.fields == b.fields for a, b in zip(reference, out)) / len(records),
                          "weight_bytes": extractor.backend.llama.weight_bytes})
            print(lanes[-1], flush=True)
    document = {**facts, "records": len(records), "lanes": lanes}
    args.json.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
