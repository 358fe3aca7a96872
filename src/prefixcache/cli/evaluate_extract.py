"""``prefixcache eval`` for an extraction task: the task run over rows with gold fields, and each field scored.

Also what ``extract`` and ``eval`` share for fields: ``FIELD=VALUE`` options (``--head``, ``--min-confidence``)
and the field policy built from them (:class:`~prefixcache.scheduler.field_policy.FieldPolicy`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import typer

from .errors import err, out


def parse_pairs(values: Optional[Sequence[str]], option: str, convert: Callable = str) -> dict:
    """``["a=1", "b=2"]`` -> ``{"a": convert("1"), ...}``; a bad pair is a usage error naming ``option``."""
    pairs = {}
    for value in values or ():
        name, sep, rest = value.partition("=")
        try:
            if not sep or not name.strip() or not rest.strip():
                raise ValueError("expected FIELD=VALUE")
            pairs[name.strip()] = convert(rest.strip())
        except ValueError as exc:
            raise typer.BadParameter(f"{value!r}: {exc}", param_hint=option) from None
    return pairs


def field_policy(extractor, heads: Optional[Sequence[str]], min_confidence: Optional[Sequence[str]], tuned=None):
    """The extractor's :class:`FieldPolicy` from ``--head FIELD=FILE`` and ``--min-confidence FIELD=P`` values;
    each head is checked against the extractor's model and prompt (a head fitted elsewhere is refused). A bare
    ``--head FILE`` (no ``FIELD=``), or ``tuned`` (a path), is the task's tuned prefix: the extractor follows it
    (:func:`use_tuned`)."""
    from ..engine.head_file import check, load_head
    from ..scheduler.field_policy import FieldPolicy

    bare = [value for value in heads or () if "=" not in value] + ([str(tuned)] if tuned is not None else [])
    if len(bare) > 1:
        raise typer.BadParameter(f"one tuned prefix at most, got {bare}", param_hint="--head")
    if bare:
        use_tuned(extractor, bare[0])
    named = [value for value in heads or () if "=" in value]
    loaded_heads = {name: load_head(path) for name, path in parse_pairs(named, "--head").items()}
    for head in loaded_heads.values():
        check(head.manifest, extractor.loaded, extractor.prompt, head.labels)
    thresholds = parse_pairs(min_confidence, "--min-confidence", float)
    return FieldPolicy(extractor.task, loaded_heads, thresholds)


def use_tuned(extractor, path) -> None:
    """Make ``extractor`` generate after the tuned prefix in the head file at ``path`` (``fit --task T --tune
    prefix``), refused (exit 2, the difference named) when fitted for another model, prompt or field set."""
    from ..engine.head_file import check_fields, load_head
    from ..errors import InputError
    from ..scheduler.feature_pass import tuned_prefix

    head = load_head(path)
    if not head.tuned or head.labels:
        what = "a choice field's head: give it as --head FIELD=FILE" if not head.tuned else "a classification task's"
        raise InputError(f"{str(path)!r} is not an extraction task's tuned prefix ({what}); fit one with "
                         f"`prefixcache fit TRAIN --task {extractor.task.name} --tune prefix`")
    check_fields(head.manifest, extractor.loaded, extractor.prompt, list(extractor.task.fields))
    extractor.tuned = tuned_prefix(head)


def run_extract_eval(extractor, records: list, batch_size: int, target: Optional[float],
                     thresholds: dict[str, float]):
    """Extract ``records`` (batched) and score every declared field their columns carry; returns the reports,
    the thresholds (``thresholds``, else those ``target`` picks on these rows) and the run's metadata."""
    from ..eval.extract_eval import Scored, field_report
    from ..eval.extract_report import chosen_thresholds
    from ..types import RunConfig

    started = time.perf_counter()
    results = extractor.extract_all(records, RunConfig("batched", batch_size))
    seconds = time.perf_counter() - started
    rows = [Scored(r.id, extractor.source_text(r), dict(r.fields), e.fields or {}, e.confidence or {})
            for r, e in zip(records, results)]
    names = [n for n in extractor.task.fields if any(n in r.fields for r in records)]
    reports = [field_report(extractor.task, name, rows) for name in names]
    reports += prompt_only_reports(extractor, records, results, names)
    chosen = dict(thresholds) or (chosen_thresholds(reports, target) if target is not None else {})
    meta = {"task": extractor.task.name, "model": extractor.loaded.identity, "dtype": str(extractor.loaded.dtype),
            "rows": len(records), "errors": sum(e.error is not None for e in results), "seconds": round(seconds, 2),
            "records_per_s": round(len(records) / max(seconds, 1e-9), 3), "target_accuracy": target,
            "heads": {n: str(h.manifest.get("training", {}).get("rows")) + " rows" for n, h in extractor.policy.heads.items()},
            "tuned": _tuned_meta(extractor)}
    return reports, chosen, meta


def _tuned_meta(extractor) -> dict | None:
    """What the eval's metadata says of the tuned prefix the extractor follows (None: the prompt's own)."""
    tuned = extractor.tuned
    return None if tuned is None else {"digest": tuned.variant, "prefix_tokens": tuned.prefix.length}


def prompt_only_reports(extractor, records: list, results: list, names: list[str]) -> list:
    """For each choice field a head decided: the same figures for the value the prompt alone generated (read
    back from the raw output), reported as ``FIELD (prompt)``, so one run shows both."""
    from dataclasses import replace

    from ..eval.extract_eval import Scored, field_report
    from ..task.answer import parse_fields

    reports = []
    for name in [n for n in names if n in extractor.policy.heads]:
        rows = []
        for r, e in zip(records, results):
            generated = parse_fields(e.raw or "", [name]).fields or {}
            rows.append(Scored(r.id, extractor.source_text(r), dict(r.fields), generated, {}))
        reports.append(replace(field_report(extractor.task, name, rows), name=f"{name} (prompt)", curve=[]))
    return reports


def eval_extraction(extractor, records: list, batch_size: int, target: Optional[float], min_confidence,
                    as_json: bool, plot: Optional[Path]) -> None:
    """Run and print (or emit as JSON, and plot) the extraction eval."""
    from ..eval.extract_report import document, field_table, plot_coverage, threshold_table

    reports, thresholds, meta = run_extract_eval(
        extractor, records, batch_size, target, parse_pairs(min_confidence, "--min-confidence", float))
    title = f"{meta['task']} | {meta['model']} | {meta['rows']} rows | {meta['records_per_s']} records/s"
    if as_json:
        print(json.dumps(document(reports, meta, thresholds)))
    else:
        out.print(field_table(reports, title))
        if thresholds:
            chosen = "chosen for target accuracy " + str(target) if not min_confidence else "given"
            out.print(threshold_table(reports, thresholds, f"at the thresholds {chosen}"))
        for r in reports:
            if r.wrong:
                err.print(f"{r.name}: wrong on e.g. " + "; ".join(
                    f"{w['id']}: {w['predicted']!r} (gold {w['gold']!r})" for w in r.wrong[:5]), highlight=False)
    if plot is not None:
        err.print(f"wrote {plot_coverage(reports, plot, title)}")
