"""The demo: 600 bundled support tickets through the embedded model, with accuracy and a timing table.

The 600 tickets run at the chosen dtype (``auto``: bfloat16 where the CPU has it); the side-by-side
timing of full / cached / batched runs in float32, where the cached path is exact, so its
label agreement is the proof the README promises.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from ..io import records as data
from ..bench.lanes import ModeResult, compare_modes
from ..run.classify import Classifier, RunConfig, RunStats


def timing_table(results: list[ModeResult], title: str) -> Table:
    table = Table(title=title)
    for col in ("mode", "dtype", "B", "items", "s", "ms/item", "items/s", "x full", "agree", "max|Δlp|", "ties", "%peak"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.mode,
            r.dtype,
            str(r.batch_size),
            str(r.records),
            f"{r.seconds:.2f}",
            f"{r.ms_per_item:.1f}",
            f"{r.items_per_s:.1f}",
            f"{r.speedup_vs_full:.2f}x",
            f"{100 * r.label_agreement:.1f}%",  # labels equal to the full lane's
            f"{r.max_abs_logprob_diff:.1e}",
            f"{r.near_ties}" + (f" ({r.disagreements_outside_ties} not)" if r.disagreements_outside_ties else ""),
            f"{r.pct_of_peak:.0f}%" if r.pct_of_peak is not None else "-",
        )
    return table


def float32_twin(classifier: Classifier) -> Classifier:
    """``classifier`` itself when it runs in float32, else the same task on a float32 copy of its model."""
    import torch

    from ..bench.lanes import same_dtype_copy

    if classifier.loaded.dtype == torch.float32:
        return classifier
    return Classifier(same_dtype_copy(classifier.loaded, torch.float32), classifier.task, classifier.method)


def run_demo(classifier: Classifier, batch_size: int, subset: int, out_dir: Path, out: Console, err: Console) -> Path:
    """Classify the bundled tickets, time the three modes on a subset, and write everything to a new folder."""
    rows = list(data.read_rows(data.bundled_dataset()))
    records = list(data.to_records(rows, id_field="id"))
    gold = {r["id"]: r["label"] for r in rows}
    folder = out_dir / time.strftime("demo-%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)

    stats = RunStats()
    config = RunConfig("batched", batch_size)
    with open(folder / "predictions.jsonl", "w", encoding="utf-8") as sink, tqdm(
        total=len(records), desc="classify 600 tickets [batched]", unit="rec", file=sys.stderr
    ) as bar:
        predictions = list(data.write_jsonl(classifier.classify(records, config, progress=bar.update, stats=stats), sink))
    correct = sum(p.label == gold[p.id] for p in predictions)
    accuracy = correct / len(predictions)
    out.print(
        f"\n[bold]accuracy[/] on {len(predictions)} bundled tickets: {accuracy:.1%} ({correct}/{len(predictions)}), "
        f"{stats.records / stats.seconds:.1f} tickets/s, prefix of {classifier.prompt.prefix_ids.__len__()} tokens "
        f"built once in {classifier.prefix_seconds:.2f} s"
    )

    reference = float32_twin(classifier)
    err.print(f"timing full vs cached vs batched on {subset} tickets (float32, where the cached path is exact) ...")
    results, _ = compare_modes(reference, records[:subset], batch_size)
    out.print(timing_table(results, f"{reference.loaded.identity}, float32, {reference.method} scoring"))
    same = min(round(r.label_agreement * r.records) for r in results)
    out.print(f"labels equal to full re-encoding: [bold]{same}/{subset}[/] in every mode")

    summary = {
        "model": classifier.loaded.identity,
        "dtype": str(classifier.loaded.dtype),
        "method": classifier.method,
        "prefix_tokens": len(classifier.prompt.prefix_ids),
        "accuracy": accuracy,
        "records": len(predictions),
        "timing": [r.to_json() for r in results],
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    out.print(f"results written to [bold]{folder}[/] (predictions.jsonl, summary.json)")
    return folder
