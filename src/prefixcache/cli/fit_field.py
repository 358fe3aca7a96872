"""``prefixcache fit --field NAME``: a head for a choice field of an extraction task (its values), or for a copy
field (whether the record holds a value: absent / present), fitted on rows with gold values."""

from __future__ import annotations

import json

from .errors import err, out
from .loading import progress


def fit_field(job, field: str, folds: int, seed: int, as_json: bool) -> None:
    """Fit and write (to ``job.out_path``) a head for ``field`` (its gold values in the column named as the field);
    print the cross-validated figures (one JSON object with ``as_json``). ``job`` is the command's
    :class:`~prefixcache.cli.fit.FitJob`: the rows, the extraction task, the model, the batch size."""
    from ..engine.head_file import save_head
    from ..errors import InputError
    from ..eval.fit_head import fit_head
    from ..eval.fit_report import fit_table
    from ..scheduler.field_features import collect_field_features, head_labels
    from ..task.definition import ExtractTask, load_any_task

    spec = load_any_task(job.task)
    if not isinstance(spec, ExtractTask):
        raise InputError(f"--field {field}: task {spec.name!r} is a classification task; fit its head without --field")
    labels = head_labels(spec, field)
    records = list(job.read())
    copy = spec.kind_of(field) == "copy"
    missing = [r.id for r in records if (field not in r.fields if copy else r.fields.get(field) in (None, ""))]
    if missing:
        raise InputError(f"record {missing[0]!r}: no gold value in column {field!r} ({len(missing)} record(s) lack one)")
    loaded = job.load()
    with progress(len(records), "features") as bar:
        features = collect_field_features(loaded, spec, field, records, job.batch_size, bar.update)
    features = features.require_complete("training row")
    gold = {r.id: (labels[r.fields[field] not in (None, "")] if copy else str(r.fields[field])) for r in records}
    result = fit_head(features, gold, folds=folds, seed=seed)
    result.head.manifest.update({"task": spec.name, "field": field})
    written = save_head(result.head, job.out_path)
    if as_json:
        print(json.dumps({"fit": result.cv_json(), "field": field}))
    else:
        out.print(fit_table(result))
        err.print("(an extraction prompt has no label rows: its 'prompt' row is a uniform guess, not the prompt's answer; "
                  "`eval --field-head` reports the prompt's own value beside the head's)", highlight=False)
    err.print(f"wrote {written} (field {field}: {len(features.labels)} values, {features.features.shape[1]} features, "
              f"fit {result.seconds:.1f} s)")

