"""``prefixcache fit TRAIN --task EXTRACT_TASK --tune prefix``: tune an extraction task's cached prefix on rows with
gold fields (the columns named as the task's fields) and write it as a head file that ``extract --head FILE`` and
``eval --head FILE`` take."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from .errors import err, out

# --dtype auto tunes in float32, as classification's prefix tuning does (on CPUs torch's bfloat16 backward pass is
# slower than float32's); the tuned prefix serves at any dtype.
TUNING_DTYPE = "float32"


def fit_prefix_fields(job, task, config, as_json: bool) -> None:
    """Tune, report the epochs and the held-out figures (one JSON object with ``as_json``), write ``job.out_path``.
    ``job``: the command's :class:`~prefixcache.cli.fit.FitJob`; ``task``: the extraction task; ``config``: a
    :class:`~prefixcache.eval.tune_config.TuneConfig`."""
    from ..engine.head_file import save_head
    from ..eval.tune_fields import answer_tokens, end_of_answer, fields_manifest, gold_values, tune_fields
    from ..eval.tune_prefix import Hooks
    from ..scheduler.extract import Extractor
    from ..scheduler.feature_pass import bound_own_rows

    records = list(job.read())
    loaded = job.load() if job.dtype != "auto" else replace(job, dtype=TUNING_DTYPE).load()
    extractor = Extractor(loaded, task)
    own = bound_own_rows(extractor, records, task.input_fields)
    values = gold_values(task, records, _untuned_answers(extractor, records, job.batch_size))
    _check_choices(task, records, values)
    end = end_of_answer(loaded.tokenizer, extractor.generation.eos_ids)
    answers = [answer_tokens(loaded.tokenizer, task, v, end) for v in values]
    err.print(f"tuning a {config.virtual_tokens or len(own.prompt.prefix_ids)}-token prefix on {len(own.rows)} rows' "
              f"answers ({config.holdout:.0%} held out), at most {config.epochs} epochs…")
    with _bar(config, len(own.rows)) as bar:
        hooks = Hooks(on_batch=lambda n, loss: (bar.set_postfix(loss=f"{loss:.3f}", refresh=False), bar.update(n)),
                      on_epoch=lambda e: bar.set_postfix(loss=f"{e.train_loss:.3f}", heldout=f"{e.heldout_accuracy:.1%}"))
        tuned = tune_fields(loaded, own.prompt.prefix_ids, own.rows, answers, config, hooks)
    tuned.head.manifest.update(fields_manifest(tuned, loaded, own, config, task))
    written = save_head(tuned.head, job.out_path)
    if as_json:
        print(json.dumps({"tuned": tuned.head.manifest["tuned"], "cv": tuned.head.manifest["cv"], "out": str(written)}))
    else:
        out.print(_table(tuned))
    err.print(f"wrote {written} ({tuned.head.prefix.length}-token tuned prefix for fields {', '.join(task.fields)}, "
              f"{tuned.seconds:.0f} s); use it with `extract --head {written}`")


def _untuned_answers(extractor, records: list, batch_size: int) -> list[dict] | None:
    """The untuned prompt's own answers, when some field has no gold column in any row (what it keeps there);
    None when every field has one."""
    from ..types import RunConfig

    if all(any(name in r.fields for r in records) for name in extractor.task.fields):
        return None
    err.print("fields without a gold column keep the untuned prompt's own answer: extracting the training rows…")
    return [e.fields or {} for e in extractor.extract_all(records, RunConfig("batched", batch_size))]


def _check_choices(task, records: list, values: list[dict]) -> None:
    """Refuse a gold value of a choice field that is not one of its values, naming the row."""
    from ..errors import InputError

    for record, answer in zip(records, values):
        for name in task.names_of_kind("choice"):
            allowed = task.fields[name].values
            if answer[name] is not None and answer[name] not in allowed:
                raise InputError(f"record {record.id!r}: gold {name} {answer[name]!r} is not one of {list(allowed)}")


def _bar(config, rows: int):
    from tqdm import tqdm

    trained = rows - round(rows * config.holdout)
    return tqdm(total=config.epochs * trained, desc="tuning", unit="row", file=sys.stderr, dynamic_ncols=True)


def _table(tuned):
    from .fit_prefix import epochs_table

    title = (f"prefix tuning on answers (held out: {len(tuned.heldout)} rows; untuned prompt: token accuracy "
             f"{tuned.start_accuracy:.1%}, loss {tuned.start_loss:.4f})")
    return epochs_table(title, "held-out token accuracy", tuned.epochs, tuned.best_epoch, "* kept (lowest held-out loss)")
