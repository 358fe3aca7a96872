"""``prefixcache fit --tune prefix``: tune the task's cached prefix with a head on labelled rows, and write it as a
head file that every ``--head`` path takes."""

from __future__ import annotations

import json
import sys

from dataclasses import replace

from .errors import err, out

# --dtype auto tunes in float32: on CPUs torch's bfloat16 backward pass is slower than float32's (measured:
# docs/accuracy.md, "A tuned prefix"); a tuned prefix serves at any dtype, like a head.
TUNING_DTYPE = "float32"


def fit_prefix(job, config, as_json: bool) -> None:
    """Tune, report the epochs and the held-out figures (one JSON object with ``as_json``), write ``job.out_path``.
    ``job``: the command's :class:`~prefixcache.cli.fit.FitJob`; ``config``: a
    :class:`~prefixcache.eval.tune_config.TuneConfig`."""
    from ..engine.head_file import save_head
    from ..engine.scoring import LabelScorer
    import numpy as np

    from ..eval.tune_prefix import Hooks, tune_prefix, tuned_manifest
    from ..scheduler.feature_pass import own_rows
    from ..task.definition import load_task

    task = load_task(job.task)
    labelled = job.labelled(task)
    loaded = job.load() if job.dtype != "auto" else replace(job, dtype=TUNING_DTYPE).load()
    own = own_rows(loaded, task, labelled.records)
    scorer = LabelScorer(loaded.model, own.prompt, "first-token")
    position = {label: j for j, label in enumerate(scorer.labels)}
    gold = np.array([position[label] for label in labelled.gold], dtype=np.int64)  # row for row with own.rows
    err.print(f"tuning a {config.virtual_tokens or len(own.prompt.prefix_ids)}-token prefix and a head on "
              f"{len(own.rows)} rows ({config.holdout:.0%} held out), at most {config.epochs} epochs…")
    with _bar(config, len(own.rows)) as bar:
        hooks = Hooks(on_batch=lambda n, loss: (bar.set_postfix(loss=f"{loss:.3f}", refresh=False), bar.update(n)),
                      on_epoch=lambda e: bar.set_postfix(loss=f"{e.train_loss:.3f}", heldout=f"{e.heldout_accuracy:.1%}"))
        tuned = tune_prefix(loaded, scorer, own.prompt.prefix_ids, own.rows, gold, config, hooks)
    tuned.head.manifest.update(tuned_manifest(tuned, loaded, own, config, task.name))
    written = save_head(tuned.head, job.out_path)
    document = tuned.head.manifest["tuned"]
    if as_json:
        print(json.dumps({"tuned": document, "cv": tuned.head.manifest["cv"], "out": str(written)}))
    else:
        out.print(_table(tuned))
    err.print(f"wrote {written} ({tuned.head.prefix.length}-token tuned prefix, {len(tuned.head.labels)} labels, "
              f"{tuned.seconds:.0f} s)")


def _bar(config, rows: int):
    from tqdm import tqdm

    trained = rows - round(rows * config.holdout)
    return tqdm(total=config.epochs * trained, desc="tuning", unit="row", file=sys.stderr, dynamic_ncols=True)


def _table(tuned):
    title = f"prefix tuning (held out: {len(tuned.correct)} rows; untuned prompt {tuned.start_accuracy:.1%})"
    caption = (f"* kept; calibration error on the held-out rows {tuned.ece[0]:.1%} raw, {tuned.ece[1]:.1%} at "
               f"temperature {tuned.calibration.temperature:.3f}")
    return epochs_table(title, "held-out accuracy", tuned.epochs, tuned.best_epoch, caption)


def epochs_table(title: str, accuracy: str, epochs, best_epoch: int, caption: str):
    """A tuning run's epochs as a table (the kept one starred); ``accuracy``: that column's name."""
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for column in ("epoch", "train loss", accuracy, "held-out loss", "seconds"):
        table.add_column(column, justify="right")
    for e in epochs:
        mark = " *" if e.epoch == best_epoch else ""
        table.add_row(f"{e.epoch}{mark}", f"{e.train_loss:.4f}", f"{e.heldout_accuracy:.1%}", f"{e.heldout_loss:.4f}",
                      f"{e.seconds:.0f}")
    return table
