"""Plots for benchmark results (matplotlib, headless). Each function writes one PNG and returns its path.

The evaluation's plots (confusion matrix, example sweep) are :mod:`prefixcache.eval.report_plots`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..eval.report_plots import wrap_title  # noqa: E402
from .lanes import ModeResult, SweepPoint  # noqa: E402


def lane_color(mode: str) -> str:
    """Grey for the full baselines, green for a head lane (``+head``), orange for llama.cpp, blue otherwise."""
    if mode.endswith("+head"):
        return "#8fbc8f" if mode.startswith("full") else "#55a868"
    return "#999999" if mode == "full" else "#dd8452" if mode == "llama.cpp" else "#4c72b0"


def plot_modes(results: Sequence[ModeResult], path: Path, title: str, floor_ms: float | None = None) -> Path:
    """Bars of ms per item (log scale) with the speed-up over ``full`` written on each bar; ``floor_ms``: a dashed
    line at the arithmetic floor per item (the many-label lanes' trie floor)."""
    fig, ax = plt.subplots(figsize=(max(8, 1.9 * len(results)), 4.2))
    names = [f"{r.mode}\n{r.dtype}, b={r.batch_size}" + (f", n={r.records}" if len({x.records for x in results}) > 1 else "")
             for r in results]
    values = [r.ms_per_item for r in results]
    colors = [lane_color(r.mode) for r in results]
    bars = ax.bar(names, values, color=colors)
    for bar, r in zip(bars, results):
        label = f"{r.ms_per_item:.1f} ms\n{r.speedup_vs_full:.1f}x"
        if r.pct_of_peak is not None:
            label += f"\n{r.pct_of_peak:.0f}% peak"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    if floor_ms:
        ax.axhline(floor_ms, color="#c44e52", linestyle="--", linewidth=1)
        ax.annotate(f"batched arithmetic floor {floor_ms:.0f} ms", (len(results) - 0.5, floor_ms), textcoords="offset points",
                    xytext=(-2, 3), ha="right", fontsize=8, color="#c44e52")
    ax.set_yscale("log")
    ax.set_ylabel("ms per item (log scale, lower is better)")
    ax.set_title(wrap_title(title, fig, 10), fontsize=10)
    ax.margins(y=0.35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_sweep(points: Sequence[SweepPoint], path: Path, title: str) -> Path:
    """ms per item against prefix length, for full re-encoding and batched prefix caching."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [p.prefix_tokens for p in points]
    ax.plot(xs, [p.full_ms_per_item for p in points], "o-", color="#999999", label="full re-encode")
    ax.plot(xs, [p.batched_ms_per_item for p in points], "o-", color="#4c72b0", label="batched over cached prefix")
    for p in points:
        ax.annotate(f"{p.speedup:.0f}x", (p.prefix_tokens, p.batched_ms_per_item), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("prefix tokens (more few-shot examples →)")
    ax.set_ylabel("ms per item")
    ax.set_yscale("log")
    ax.set_title(wrap_title(title, fig, 10), fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
