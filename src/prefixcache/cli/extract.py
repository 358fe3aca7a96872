"""``prefixcache extract``: fields generated as JSON after the cached prefix, one line per record."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer

from ..types import BACKENDS, DEFAULT_EXTRACT_TASK, MODES, RunConfig
from .errors import reported, choice, err, open_output, output_path
from .loading import check_text_field, make_pool, progress, setup_extractor
from .options import (
    BackendOpt, BatchOpt, CacheBudgetOpt, CacheDirBudgetOpt, CacheDirOpt, DtypeOpt, EvictionOpt, FieldHeadOpt, IdFieldOpt, InputArg,
    KVStorageOpt, FieldMinConfidenceOpt, ModelOpt, ModeOpt, TextFieldOpt, ThreadsOpt,
)
from .evaluate_extract import field_policy
from .reports import report_pool


@reported
def extract(
    input: str = InputArg,
    task: str = typer.Option(DEFAULT_EXTRACT_TASK, "--task", help="A bundled extraction task or a path to a task YAML (kind: extract)."),
    model: str = ModelOpt,
    mode: str = ModeOpt,
    batch_size: int = BatchOpt,
    text_field: str = TextFieldOpt,
    id_field: Optional[str] = IdFieldOpt,
    out_path: Optional[Path] = typer.Option(None, "--out", help="Output JSONL (default: stdout)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, help="Override the task's max_new_tokens."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    cache_budget: Optional[str] = CacheBudgetOpt,
    cache_dir: Optional[Path] = CacheDirOpt,
    cache_dir_budget: Optional[str] = CacheDirBudgetOpt,
    kv_storage: str = KVStorageOpt,
    eviction: str = EvictionOpt,
    constrained: bool = typer.Option(
        True, "--constrained/--unconstrained",
        help="Decode under the task's answer schema (the default: every output parses), or freely.",
    ),
    head: Optional[list[str]] = FieldHeadOpt,
    min_confidence: Optional[list[str]] = FieldMinConfidenceOpt,
    review: Optional[Path] = typer.Option(None, "--review", help="Also write each record with flagged fields here (JSONL)."),
    backend: str = BackendOpt,
):
    """Extract the task's fields from every record by greedy generation after the cached prefix.

    Decoding follows the task's answer schema (a JSON object of exactly the declared fields, each as its kind
    says; copy fields only copy spans of the record) unless --unconstrained. Writes one JSON line per record:
    id, fields, raw (the generated text), error (a parse failure names what is wrong), confidence (per field)
    and flagged (fields left null under --min-confidence). Exit code 1 when any record has an error.
    """
    config = RunConfig(choice(mode, MODES, "--mode"), batch_size)
    output_path(out_path, "--out")
    pool = make_pool(cache_budget, cache_dir, kv_storage, eviction, cache_dir_budget)
    extractor = setup_extractor(task, model, dtype, threads, pool, max_new_tokens, constrained)
    extractor.policy = field_policy(extractor, head, min_confidence)
    chosen = extractor.use_backend(choice(backend, BACKENDS, "--backend"), config.mode.pass_size(batch_size))
    err.print(f"generation on {chosen.name} ({chosen.why})", highlight=False)
    stats = extract_into(extractor, input, text_field, id_field, config, out_path, review)
    err.print(
        f"{stats.records} records in {stats.seconds:.1f} s, {stats.tokens_generated} tokens generated "
        f"({stats.tokens_generated / max(stats.seconds, 1e-9):.1f} tokens/s), {stats.errors} errors "
        f"({stats.parse_errors} unparsable outputs)" + (f"; wrote {out_path}" if out_path else ""),
        highlight=False,
    )
    report_pool(pool)
    if stats.errors:
        raise typer.Exit(1)


def extract_into(extractor, input: str, text_field: str, id_field: Optional[str], config: RunConfig,
                 out_path: Optional[Path], review: Optional[Path] = None):
    """Stream the records, extract them and write one JSON line each to ``out_path`` (or stdout); the stats.
    A row that cannot be read (not UTF-8, not JSON, no usable id) gets an error line and the job goes on."""
    from ..io import records as data
    from ..io.jsonl import write_line
    from ..scheduler.extract import ExtractStats

    total = data.count_rows(input)  # a cheap pass for the progress bar; the job itself streams
    # bad rows come through with their error (an error line naming the row and field), like classify's
    records = check_text_field(data.scan_records(input, text_field, id_field), text_field)
    stats = ExtractStats()
    with (open_output(out_path, "w", "--out") if out_path else nullcontext(sys.stdout)) as sink, \
            (open_output(review, "w", "--review") if review else nullcontext()) as flagged:
        with progress(total, f"extract [{config.mode}]") as bar:
            for extraction in extractor.extract(records, config, progress=bar.update, stats=stats):
                write_line(sink, extraction.to_json())
                sink.flush()
                if flagged is not None and extraction.flagged:
                    write_line(flagged, extraction.to_json())
    return stats
