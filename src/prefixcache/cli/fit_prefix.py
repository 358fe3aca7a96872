"""``prefixcache fit --tune prefix``: tune the task's cached prefix with a head on labelled rows, refit the head on the
tuned prefix's states (unless ``--no-refit-head``), and write them as a head file that every ``--head`` path takes."""

from __future__ import annotations

import json
import sys

from dataclasses import replace

from .errors import err, out

# --dtype auto tunes in float32: on CPUs torch's bfloat16 backward pass is slower than float32's (measured:
# docs/accuracy.md, "A tuned prefix"); a tuned prefix serves at any dtype, like a head.
TUNING_DTYPE = "float32"


def fit_prefix(job, config, refit, as_json: bool) -> None:
    """Tune, refit the head, report the epochs and the held-out figures (one JSON object with ``as_json``), write
    ``job.out_path``. ``job``: the command's :class:`~prefixcache.cli.fit.FitJob`; ``config``: a
    :class:`~prefixcache.eval.tune_config.TuneConfig`; ``refit``: a
    :class:`~prefixcache.eval.tune_config.RefitConfig`."""
    from ..engine.features import FeatureSpec
    from ..engine.head_file import save_head
    from ..engine.scoring import LabelScorer
    import numpy as np

    from ..eval.tune_prefix import Hooks, tune_prefix
    from ..scheduler.feature_pass import own_rows
    from ..task.definition import load_task

    if refit.enabled:
        FeatureSpec.parse(refit.feature)  # a bad spec is refused before the model loads
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
        joint = tune_prefix(loaded, scorer, own.prompt.prefix_ids, own.rows, gold, config, hooks)
    tuned, manifest = _written(job, (loaded, task, labelled, own), joint, config, refit)
    tuned.head.manifest.update(manifest)
    written = save_head(tuned.head, job.out_path)
    if as_json:
        print(json.dumps({"tuned": manifest["tuned"], "cv": manifest["cv"], "refit": manifest.get("refit"),
                          "out": str(written)}))
    else:
        out.print(_table(joint))
        if refit.enabled:
            out.print(_refit_line(tuned, joint, manifest["refit"]))
    which = "a head refitted on its states" if refit.enabled else "the head trained with it"
    err.print(f"wrote {written} ({tuned.head.prefix.length}-token tuned prefix with {which}, {len(tuned.head.labels)} "
              f"labels, {joint.seconds + manifest.get('refit', {}).get('seconds', 0.0):.0f} s)")


def _written(job, run, joint, config, refit):
    """What the file holds: the tuning's result with the head refitted on the tuned prefix's states (``refit``), or
    as trained (``--no-refit-head``), and its manifest. ``run``: (loaded model, task, labelled rows, own rows)."""
    from ..eval.tune_prefix import tuned_manifest
    from ..eval.tune_refit import refit_head, refit_manifest
    from ..types import RunConfig

    loaded, task, labelled, own = run
    manifest = tuned_manifest(joint, loaded, own, config, task.name)
    if not refit.enabled:
        return joint, manifest
    err.print(f"refitting the head on the tuned prefix's states ({refit.folds}-fold cross-validation)…")
    features = RunConfig(batch_size=job.batch_size)
    refitted = refit_head(loaded, task, labelled.records, labelled.gold, joint, refit, features)
    return refitted.tuned, refit_manifest(refitted, manifest)


def _bar(config, rows: int):
    from tqdm import tqdm

    trained = rows - round(rows * config.holdout)
    return tqdm(total=config.epochs * trained, desc="tuning", unit="row", file=sys.stderr, dynamic_ncols=True)


def _table(tuned):
    title = f"prefix tuning (held out: {len(tuned.correct)} rows; untuned prompt {tuned.start_accuracy:.1%})"
    caption = (f"* kept; the head trained with the prefix: calibration error on the held-out rows {tuned.ece[0]:.1%} "
               f"raw, {tuned.ece[1]:.1%} at temperature {tuned.calibration.temperature:.3f}")
    return epochs_table(title, "held-out accuracy", tuned.epochs, tuned.best_epoch, caption)


def _refit_line(tuned, joint, refit: dict) -> str:
    """The refitted head's held-out figures beside the joint head's (the head written, and the one it replaced)."""
    return (f"head refitted on the tuned prefix's states ({refit['feature']}, C = {refit['C']:g}): held-out "
            f"accuracy {tuned.heldout_accuracy:.1%} (the head trained with the prefix: {joint.heldout_accuracy:.1%}); "
            f"calibration error {tuned.ece[0]:.1%} raw, {tuned.ece[1]:.1%} at temperature "
            f"{tuned.calibration.temperature:.3f}")


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
