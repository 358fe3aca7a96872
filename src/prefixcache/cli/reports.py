"""What commands print: tables on standard output, one-line figures on standard error.

Imports nothing heavy; a report that needs the engine (the int8 storage check) imports it in its body.
"""

from __future__ import annotations

import json

from rich.table import Table

from ..cache.config import format_bytes
from .errors import err, out


def timing_table(results: list, title: str) -> Table:
    """One row per :class:`~prefixcache.bench.lanes.ModeResult`: time, ratios against ``full``, agreement with
    the lane's reference (``full``; a caption names any other, such as ``full+head`` for the head lanes).
    ``%peak``: achieved FLOP/s against square matmuls; ``%shape``: against the model's own projection shapes at
    a batched pass's rows (:mod:`prefixcache.bench.roofline`)."""
    table = Table(title=title, caption=reference_caption(results))
    columns = ("mode", "dtype", "B", "items", "s", "ms/item", "items/s", "x full", "agree", "max|Δlp|", "ties")
    for col in (*columns, "%peak", "%shape", "peak RSS"):
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
            f"{100 * r.label_agreement:.1f}%",  # labels equal to the reference lane's
            f"{r.max_abs_logprob_diff:.1e}",
            f"{r.near_ties}" + (f" ({r.disagreements_outside_ties} not)" if r.disagreements_outside_ties else ""),
            f"{r.pct_of_peak:.0f}%" if r.pct_of_peak is not None else "-",
            f"{r.pct_of_shape_peak:.0f}%" if r.pct_of_shape_peak is not None else "-",
            format_bytes(r.peak_rss_bytes) if r.peak_rss_bytes else "-",
        )
    return table


def reference_caption(results: list) -> str | None:
    """``agree, max|Δlp|, ties: against full; full+head, batched+head against full+head`` when some lane is
    measured against another lane than the first; None when every lane is measured against the first."""
    first = results[0].mode if results else None
    others = list(dict.fromkeys(r.reference for r in results if r.reference != first))
    if not others:
        return None
    parts = [f"agree, max|Δlp|, ties: against {first}"]
    parts += [f"{', '.join(r.mode for r in results if r.reference == name)} against {name}" for name in others]
    return "; ".join(parts)


def report_pool(pool) -> None:
    """One stderr line of pool figures (nothing without a pool)."""
    if pool is None:
        return
    s = pool.stats()
    saved = f", {s.storage} storage saves {format_bytes(s.bytes_saved)} against float" if s.bytes_saved else ""
    err.print(
        f"prefix pool: {s.hits} hits, {s.misses} misses ({s.disk_loads} loaded from disk, {s.partial_reuses} extended, "
        f"{s.disk_rejected} disk files rejected), {s.evictions} evictions, {format_bytes(s.bytes_held)} held of "
        f"{format_bytes(s.budget_bytes)}{saved}; {s.prefill_tokens_saved} prefill tokens saved",
        highlight=False,
    )


def report_storage(classifier, records, config) -> None:
    """With a quantized pool: label agreement against float storage and memory saved, on stderr."""
    from ..eval.verify_storage import storage_agreement

    if classifier.pool is None or classifier.pool.config.storage == "float":
        return
    result = storage_agreement(classifier, records, config)
    err.print(
        f"{result.storage} storage vs float storage: labels agree on {result.agree}/{result.records} "
        f"({100 * result.rate:.2f}%), max |Δ log-prob| {result.max_abs_logprob_diff:.2e}; the prefix takes "
        f"{format_bytes(result.stored_bytes)} instead of {format_bytes(result.float_bytes)} ({100 * result.saved_fraction:.0f}% saved)",
        highlight=False,
    )


def report_agreement(as_json: bool, document: dict, title: str, row: dict[str, str]) -> None:
    """``verify``'s answer: the JSON document, or a one-row table (column -> cell)."""
    if as_json:
        print(json.dumps(document))
        return
    table = Table(title=title)
    for column in row:
        table.add_column(column)
    table.add_row(*row.values())
    out.print(table)


def some_ids(ids: list, limit: int = 20) -> str:
    return ", ".join(map(str, ids[:limit])) or "none"
