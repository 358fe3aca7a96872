"""``prefixcache verify``: full re-encoding against a cached mode on every record (classification or extraction)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..model.catalog import DTYPE_CHOICES
from ..types import Mode, RunConfig
from .errors import reported, choice
from .loading import check_text_field, is_extract, make_pool, progress, setup_classifier, setup_extractor
from .options import (
    BatchOpt, CacheBudgetOpt, CacheDirBudgetOpt, CacheDirOpt, EvictionOpt, IdFieldOpt, InputArg, JsonOpt,
    KVStorageOpt, HeadOpt, MethodOpt, ModelOpt, TaskOpt, TextFieldOpt, ThreadsOpt,
)
from .reports import report_agreement, report_pool, report_storage, some_ids

CACHED_MODES = tuple(m.value for m in Mode if m.uses_prefix)  # what verify checks against full
# Exactness (the cached path's labels equal full re-encoding's) is a float32 property: in bfloat16 the two paths
# round differently, and a record near a tie can change label. So verify checks in float32 unless told otherwise.
VerifyDtypeOpt = typer.Option(
    "float32", "--dtype",
    help=f"One of {', '.join(DTYPE_CHOICES)}. Default float32, where the check is exact; at bfloat16 (or auto on a "
    "bfloat16 machine) a record near a tie may differ, and that is reported as a difference (exit 1).",
)


@reported
def verify(
    input: str = InputArg,
    task: str = TaskOpt,
    model: str = ModelOpt,
    mode: str = typer.Option(Mode.BATCHED.value, "--mode", help=f"The cached mode to check: {' or '.join(CACHED_MODES)}."),
    batch_size: int = BatchOpt,
    method: str = MethodOpt,
    text_field: str = TextFieldOpt,
    id_field: Optional[str] = IdFieldOpt,
    as_json: bool = JsonOpt,
    dtype: str = VerifyDtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    cache_budget: Optional[str] = CacheBudgetOpt,
    cache_dir: Optional[Path] = CacheDirOpt,
    cache_dir_budget: Optional[str] = CacheDirBudgetOpt,
    kv_storage: str = KVStorageOpt,
    eviction: str = EvictionOpt,
    head: Optional[Path] = HeadOpt,
):
    """Run full re-encoding and a cached mode on every record, in float32 by default (where the two are exact);
    exit 1 if any label (or extracted output) differs."""
    config = RunConfig(choice(mode, CACHED_MODES, "--mode"), batch_size)
    pool = make_pool(cache_budget, cache_dir, kv_storage, eviction, cache_dir_budget)
    if is_extract(task):
        extractor = setup_extractor(task, model, dtype, threads, pool)
        return verify_extract(extractor, read_checked(input, text_field, id_field), config, as_json)
    classifier = setup_classifier(task, model, dtype, threads, method, pool, head)
    verify_labels(classifier, read_checked(input, text_field, id_field), config, as_json)


def read_checked(input: str, text_field: str, id_field: Optional[str]) -> list:
    """Every record of ``input``, refused with the record's name if one lacks ``text_field``."""
    from ..io import records as data

    return list(check_text_field(data.read_records(input, text_field, id_field), text_field))


def verify_labels(classifier, records: list, config: RunConfig, as_json: bool) -> None:
    """``verify`` for a classification task: labels (and log-probs) of full re-encoding and the cached mode."""
    from ..eval.verify import verify as run_verify

    reference = "full" if classifier.tuned is None else "cached, one record per pass (a tuned prefix)"
    with progress(2 * len(records), f"verify [{reference} + {config.mode}]") as bar:
        result = run_verify(classifier, records, config, progress=bar.update)
    agreement = result.agreement
    stored = {} if result.stored_prefix_equal is None else {"stored prefix = fitted": str(result.stored_prefix_equal)}
    report_agreement(
        as_json,
        agreement.to_json() | {"reference": result.reference, "stored_prefix_equal": result.stored_prefix_equal},
        f"verify: {reference} vs {config.mode} ({classifier.method} scoring, {classifier.loaded.dtype})",
        stored | {
            "records": str(agreement.records),
            "agree": str(agreement.agree),
            "agreement": f"{100 * agreement.rate:.2f}%",
            "max |Δ log-prob|": f"{agreement.max_abs_logprob_diff:.2e}",
            "disagreeing ids": some_ids(agreement.disagreeing_ids),
        },
    )
    report_storage(classifier, records, config)
    if not result.ok:
        raise typer.Exit(1)


def verify_extract(extractor, records: list, config: RunConfig, as_json: bool) -> None:
    """``verify`` for an extraction task: uncached vs cached generation must be identical, token for token."""
    from ..eval.verify_extract import verify_extract as run_verify_extract

    with progress(2 * len(records), f"verify extract [full + {config.mode}]") as bar:
        agreement, _, _ = run_verify_extract(extractor, records, config, progress=bar.update)
    report_agreement(
        as_json,
        agreement.to_json(),
        f"verify extract: uncached vs {config.mode} ({extractor.loaded.dtype})",
        {
            "records": str(agreement.records),
            "identical": str(agreement.identical),
            "identical %": f"{100 * agreement.rate:.2f}%",
            "same fields": str(agreement.same_fields),
            "differing ids": some_ids(agreement.differing_ids),
        },
    )
    report_pool(extractor.pool)
    if not agreement.ok:
        raise typer.Exit(1)
