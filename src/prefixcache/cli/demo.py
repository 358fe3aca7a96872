"""``prefixcache demo``: 600 bundled support tickets through the embedded model, with accuracy and a timing table.

The 600 tickets run at the chosen dtype (``auto``: bfloat16 where the CPU has it); the side-by-side
timing of full / cached / batched runs in float32, where the cached path is exact, so its
label agreement is the proof the README promises.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ..types import DEFAULT_TASK, Mode, RunConfig, RunStats
from .errors import reported, err, out, output_path
from .demo_head import fitted_head_section
from .loading import load, setup_classifier
from .options import BatchOpt, DtypeOpt, ModelOpt, ThreadsOpt
from .reports import timing_table


@reported
def demo(
    model: str = ModelOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    batch_size: int = BatchOpt,
    subset: int = typer.Option(60, "--subset", min=1, help="Tickets in the side-by-side timing."),
    out_dir: Path = typer.Option(Path("prefixcache-out"), "--out-dir", help="Where the results folder is made."),
    pool: bool = typer.Option(False, "--pool", help="Instead: five tasks through a prefix pool whose budget holds "
                              "three (policies, disk tier, int8 storage); --subset tickets in its label checks."),
    json_path: Optional[Path] = typer.Option(
        None, "--json", help="Also write the summary (with the machine it ran on) here, e.g. docs/bench/demo.json."
    ),
):
    """Classify the 600 bundled support tickets, print accuracy and a full/cached/batched timing table."""
    if pool:
        from .demo_pool import run_pool_demo

        run_pool_demo(load(model, dtype, threads), subset, out, err)
        return
    if out_dir.exists() and not out_dir.is_dir():
        raise typer.BadParameter(f"{out_dir} is a file; name a folder", param_hint="--out-dir")
    output_path(json_path, "--json")
    classifier = setup_classifier(DEFAULT_TASK, model, dtype, threads, "auto")
    folder = run_demo(classifier, batch_size, subset, out_dir, out, err)
    if json_path:
        json_path.write_text((folder / "summary.json").read_text())
        err.print(f"wrote {json_path}")


def float32_twin(classifier):
    """``classifier`` itself when it runs in float32, else the same task on a float32 copy of its model."""
    import torch

    from ..bench.lanes import same_dtype_copy
    from ..scheduler.classify import Classifier

    if classifier.loaded.dtype == torch.float32:
        return classifier
    return Classifier(same_dtype_copy(classifier.loaded, torch.float32), classifier.task, classifier.method)


def run_demo(classifier, batch_size: int, subset: int, out_dir: Path, out: Console, err: Console) -> Path:
    """Classify the bundled tickets, time the three modes on a subset, and write everything to a new folder."""
    from ..bench.lanes import compare_modes
    from ..io import records as data
    from ..model.machine import machine_info

    rows = list(data.read_rows(data.bundled_dataset()))
    records = list(data.to_records(rows, id_field="id"))
    gold = {r["id"]: r["label"] for r in rows}
    folder = out_dir / time.strftime("demo-%Y%m%d-%H%M%S")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise typer.BadParameter(f"cannot make {folder}: {exc.strerror or exc}", param_hint="--out-dir") from None
    predictions, stats = classify_tickets(classifier, records, batch_size, folder / "predictions.jsonl")
    correct = sum(p.label == gold[p.id] for p in predictions)
    accuracy = correct / len(predictions)
    out.print(
        f"\n[bold]accuracy[/] on {len(predictions)} bundled tickets: {accuracy:.1%} ({correct}/{len(predictions)}), "
        f"{stats.records / stats.seconds:.1f} tickets/s, prefix of {classifier.prompt.prefix_ids.__len__()} tokens "
        f"built once in {classifier.prefix_seconds:.2f} s"
    )
    fitted = fitted_head_section(classifier, records, gold, batch_size, out, err)

    reference = float32_twin(classifier)
    err.print(f"timing full vs cached vs batched on {subset} tickets (float32, where the cached path is exact) ...")
    results, _ = compare_modes(reference, records[:subset], batch_size)
    out.print(timing_table(results, f"{reference.loaded.identity}, float32, {reference.method} scoring"))
    same = min(round(r.label_agreement * r.records) for r in results)
    out.print(f"labels equal to full re-encoding: [bold]{same}/{subset}[/] in every mode")

    summary = {
        "machine": machine_info(str(classifier.loaded.dtype).removeprefix("torch.")),
        "model": classifier.loaded.identity,
        "dtype": str(classifier.loaded.dtype),
        "method": classifier.method,
        "prefix_tokens": len(classifier.prompt.prefix_ids),
        "accuracy": accuracy,
        "fitted_head": fitted,
        "records": len(predictions),
        "timing": [r.to_json() for r in results],
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    out.print(f"results written to [bold]{folder}[/] (predictions.jsonl, summary.json)")
    return folder


def classify_tickets(classifier, records: list, batch_size: int, path: Path) -> tuple[list, RunStats]:
    """Classify ``records`` in batched mode, writing each prediction's line to ``path``; predictions and stats."""
    from tqdm import tqdm

    from ..io import records as data

    stats = RunStats()
    config = RunConfig(Mode.BATCHED, batch_size)
    with open(path, "w", encoding="utf-8") as sink, tqdm(
        total=len(records), desc="classify 600 tickets [batched]", unit="rec", file=sys.stderr
    ) as bar:
        predictions = list(data.write_jsonl(classifier.classify(records, config, progress=bar.update, stats=stats), sink))
    return predictions, stats
