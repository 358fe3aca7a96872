# Study behind docs/benchmarks.md, "Generation backends": how often llama.cpp's extraction equals torch's float32.
"""The bundled ``ticket-fields`` extraction on every bundled ticket, batched, once with torch's float32 generation and
once with llama.cpp's (the same ``.gguf``: torch reads its blocks dequantized, llama.cpp reads them as they are),
and the share of records and of fields that are equal, every difference listed, in one JSON naming its machine; for
scale, the same shares between torch's own bfloat16 and float32 paths (how near the 135M model's answers are to ties).

    .venv/bin/python studies/backend_agreement.py --json docs/bench/backend-agreement.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from prefixcache.io.records import bundled_dataset, read_records
from prefixcache.model.load import load_model, set_threads
from prefixcache.model.machine import machine_info
from prefixcache.scheduler.extract import Extractor
from prefixcache.task.definition import load_any_task
from prefixcache.types import RunConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    loaded = load_model("smollm2-135m", dtype="float32", threads=threads)
    task = load_any_task("ticket-fields")
    records = list(read_records(bundled_dataset(), id_field="id"))[: args.items]
    sides, seconds = {}, {}
    for backend in ("torch", "llama.cpp"):
        extractor = Extractor(loaded, task)
        extractor.use_backend(backend, args.batch_size)
        extractor.extract_all(records[:1], RunConfig("batched", 1))  # the prefix, built (and decoded) before timing
        started = time.perf_counter()
        sides[backend] = extractor.extract_all(records, RunConfig("batched", args.batch_size))
        seconds[backend] = time.perf_counter() - started
        print(f"{backend}: {len(records)} records in {seconds[backend]:.1f} s", flush=True)
    pairs = [(a.id, name, a.fields and a.fields.get(name), b.fields and b.fields.get(name))
             for a, b in zip(sides["torch"], sides["llama.cpp"]) for name in task.fields]
    differ = [{"id": i, "field": n, "torch": x, "llama.cpp": y} for i, n, x, y in pairs if x != y]
    records_equal = sum(a.fields == b.fields for a, b in zip(sides["torch"], sides["llama.cpp"]))
    bf16 = Extractor(load_model("smollm2-135m", dtype="bfloat16", threads=threads), task)
    bf16_side = bf16.extract_all(records, RunConfig("batched", args.batch_size))  # torch's own rounding, for scale
    bf16_pairs = [(a.fields and a.fields.get(n)) == (b.fields and b.fields.get(n))
                  for a, b in zip(sides["torch"], bf16_side) for n in task.fields]
    document = {
        "machine": machine_info("float32", threads), "date": time.strftime("%Y-%m-%d"),
        "commit": commit,  # what was checked out when the run started
        "task": task.name, "records": len(records), "batch_size": args.batch_size,
        "records_equal": records_equal / len(records), "fields_equal": 1 - len(differ) / len(pairs),
        "per_field_equal": {n: 1 - sum(d["field"] == n for d in differ) / len(records) for n in task.fields},
        "errors": {b: sum(r.error is not None for r in side) for b, side in sides.items()},
        "seconds": seconds, "differences": differ,
        "torch_bfloat16_vs_float32": {"records_equal": sum(a.fields == b.fields for a, b in zip(sides["torch"], bf16_side))
                                      / len(records), "fields_equal": sum(bf16_pairs) / len(bf16_pairs)},
    }
    args.json.write_text(json.dumps(document, indent=1) + "\n")
    print(f"records equal {document['records_equal']:.1%}, fields equal {document['fields_equal']:.1%}: {args.json}")


if __name__ == "__main__":
    main()
