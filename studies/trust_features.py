# Study behind docs/accuracy.md, "Confidence you can act on" (the cached features its tables read).
"""Collect the embedded model's features for the trust study (issue 38): one ``.npz`` per (data set, chunk).

Resumable: a chunk already on disk is skipped. Rows are the held-out design of docs/accuracy.md,
scaled down to what 2 shared cores finish in minutes (see ``JOBS``). Run with ``nice``:

    PYTHONPATH=src nice -n 5 .venv/bin/python studies/trust_features.py [--cache /tmp/trust_cache]
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "datasets"
FEATURE = "last+mean@3/4"
CHUNK = 128


def _jsonl(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def banking77(per_label_pool: int, per_label_test: int, seed: int = 0):
    with open(SHARED / "banking77_train.csv", newline="", encoding="utf-8") as fh:
        rows = [{"id": f"b{i:05d}", "text": r["text"].strip(), "label": r["category"]} for i, r in enumerate(csv.DictReader(fh))]
    return _per_label(rows, per_label_pool + per_label_test, seed)


def natcs71(per_label: int, seed: int = 0):
    with open(SHARED / "natcs_dstc11_intent_utterances.csv", newline="", encoding="utf-8") as fh:
        rows = [{"id": r["utterance_id"], "text": " ".join(r["utterance"].split()), "label": r["intent"]}
                for r in csv.DictReader(fh)]
    return _per_label(rows, per_label, seed)


def _per_label(rows, n, seed):
    by = defaultdict(list)
    for r in rows:
        by[r["label"]].append(r)
    rng = random.Random(seed)
    out = []
    for label in sorted(by):
        group = by[label][:]
        rng.shuffle(group)
        out += group[:n]
    rng.shuffle(out)
    return out


def jobs():
    tickets = ROOT / "src" / "prefixcache" / "datasets" / "support_tickets.jsonl"
    return {
        "tickets": ("support-tickets", _jsonl(tickets) + _jsonl(ROOT / "tests" / "data" / "handwritten_tickets.jsonl")),
        "banking77": (str(ROOT / "docs" / "tasks" / "banking77-short.yaml"), banking77(10, 4)),
        "natcs71": (str(ROOT / "docs" / "tasks" / "natcs-71.yaml"), natcs71(4)),
    }


def _natcs5():
    path = ROOT / "src" / "prefixcache" / "datasets" / "natcs" / "utterances.csv"
    with open(path, newline="", encoding="utf-8") as fh:
        return [{"id": r["id"], "text": r["text"], "label": r["label"]} for r in csv.DictReader(fh)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", type=Path, default=Path("/tmp/trust_cache"))
    parser.add_argument("--only", default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    from prefixcache.model.load import load_model
    from prefixcache.scheduler.feature_pass import collect_features
    from prefixcache.task.definition import load_task
    from prefixcache.types import Record, RunConfig

    args.cache.mkdir(parents=True, exist_ok=True)
    loaded = load_model("smollm2-135m", dtype="auto")
    for name, (task_name, rows) in jobs().items():
        if args.only and name not in args.only.split(","):
            continue
        task = load_task(task_name)
        (args.cache / f"{name}.rows.json").write_text(json.dumps(rows))
        for k in range(0, len(rows), CHUNK):
            path = args.cache / f"{name}.{k // CHUNK:03d}.npz"
            if path.exists():
                continue
            part = rows[k:k + CHUNK]
            started = time.perf_counter()
            fs = collect_features(loaded, task, [Record(r["id"], {"text": r["text"]}) for r in part], feature=FEATURE,
                                  config=RunConfig(batch_size=32)).require_complete()
            seconds = time.perf_counter() - started
            np.savez(path, ids=np.array(fs.ids, dtype=object), features=fs.features, prompt=fs.prompt_logprobs,
                     labels=np.array(fs.labels), seconds=seconds)
            print(f"{name} chunk {k // CHUNK}: {len(part)} rows in {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
