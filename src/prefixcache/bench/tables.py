"""Markdown tables made from the committed ``--json`` documents under ``docs/bench/``, so that no figure in the
README or the docs is typed by hand.

A table sits between two marker comments in a markdown file::

    <!-- table: KIND docs/bench/FILE.json [MORE.json ...] -->
    | ... the rendered table ... |

    *caption: the machine (from the JSON's ``machine``), the run's command and facts*
    <!-- /table -->

:func:`render` makes a block's body from its ``KIND`` and JSON paths (relative to the repository root);
:func:`refresh` rewrites every block of a text; :func:`stale_blocks` lists the blocks that differ from what
:func:`render` makes (``tests/test_figures.py`` fails on any). ``python -m prefixcache.bench.tables --write``
(``make tables``) rewrites the README and ``docs/*.md`` in place; ``--check`` exits 1 when one is stale.

Kinds (every JSON is one command's output; its caption says which machine): ``modes`` (every lane of a
``bench`` run), ``lanes`` (the README's short form of one), ``sweep`` (``bench --sweep-prefix``), ``labels`` (the many-label floor), ``demo`` (``demo --json``),
``loadtest`` (``prefixcache loadtest --json``), ``accuracy`` (pairs of ``eval --json``: the prompt, then a head),
``machines`` (several ``bench`` runs, one row per machine), and the studies' kinds of :mod:`.study_tables`:
``tuning`` (``studies/tuning_study.py``), ``curves`` (``studies/tuning_curves.py``: accuracy against labelled rows
per intent), ``second-model`` (``studies/second_model.py``: a linear head on another model's states).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..model.machine import machine_name
from .study_tables import curves_table, second_model_table, tuning_table
from .table_cells import caption, duration, md_table, ms, pct

BLOCK = re.compile(r"(<!-- table: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
DOCUMENTS = ("README.md", "docs/*.md")


@dataclass(frozen=True)
class Block:
    """One marked table in a markdown file: where it is, what it names, what it holds, what it should hold."""

    path: str
    spec: str
    body: str
    expected: str


def run_facts(doc: dict) -> str:
    return f"{doc['model']}, {doc['items']} records, prefix {doc['prefix_tokens']} tokens, {doc['threads']} threads"


def agreement(mode: dict) -> str:
    """``100.0%``, or ``95.0% (201 near ties, 0 outside)`` when some records were flagged as near ties."""
    text = f"{100 * mode['label_agreement']:.1f}%"
    if mode.get("near_ties"):
        text += f" ({mode['near_ties']} near ties, {mode.get('disagreements_outside_ties', 0)} outside)"
    return text


def lane_agreement(mode: dict) -> str:
    """:func:`agreement` against the lane's reference (``full`` float32 unless the lane names another); "the
    reference" for that lane itself; "–" where the reference scores otherwise (a head lane against a prompt lane)."""
    ref = mode.get("reference", "full")
    if ref == mode["mode"] and mode["max_abs_logprob_diff"] == 0:
        return "the reference"
    if ("+head" in ref) != ("+head" in mode["mode"]):
        return "–"
    return agreement(mode)


def modes_table(doc: dict) -> str:
    """Every lane of one ``bench`` run; the columns a run has (shape peak, memory, gold accuracy) appear."""
    lanes = doc["modes"]
    extra = [("% of shape peak", "pct_of_shape_peak", pct), ("peak RSS", "peak_rss_bytes", lambda b: f"{b / 2**30:.2f} GiB"),
             ("gold accuracy", "gold_accuracy", lambda a: f"{100 * a:.1f}%")]
    extra = [e for e in extra if any(m.get(e[1]) for m in lanes)]
    header = ["mode", "dtype", "B", "records", "ms/item", "items/s", "x full (fp32)", "labels = (lane)",
              "max abs Δ log-prob", "% of peak"] + [name for name, _, _ in extra]
    rows = []
    for m in lanes:
        said = lane_agreement(m)
        compared = said not in ("–", "the reference")
        row = [m["mode"], m["dtype"], str(m["batch_size"]), str(m["records"]), ms(m["ms_per_item"]),
               f"{m['items_per_s']:.1f}", f"{m['speedup_vs_full']:.2f}x",
               f"{said} ({m.get('reference', 'full')})" if compared else said,
               f"{m['max_abs_logprob_diff']:.1e}" if compared else "–", pct(m.get("pct_of_peak"))]
        rows.append(row + [fmt(m[key]) if m.get(key) else "–" for _, key, fmt in extra])
    peaks = ", ".join(f"{d} {g:,.0f}" for d, g in sorted(doc.get("peaks_gflops", {}).items()))
    return md_table(header, rows) + caption(doc, f"{run_facts(doc)}; matmul peak GFLOP/s: {peaks}")


LANE_NAMES = {"full": "full re-encode", "cached": "cached, one record per pass", "batched": "**batched**",
              "llama.cpp": "llama.cpp with prompt reuse, same `.gguf`"}


def lanes_table(doc: dict) -> str:
    """The README's short form of a ``bench`` run: lane, ms/record, speed-up against full float32, agreement."""
    rows = []
    for m in doc["modes"]:
        name = LANE_NAMES.get(m["mode"], m["mode"])
        if m["mode"] != "llama.cpp":
            name += f", {m['dtype']}" + (f", {m['batch_size']} per pass" if m["batch_size"] > 1 else "")
        if len({n["records"] for n in doc["modes"]}) > 1:
            name += f" ({m['records']} records)"
        rows.append([name, ms(m["ms_per_item"]), f"{m['speedup_vs_full']:.1f}x", lane_agreement(m)])
    header = ["lane", "ms / record", "vs full float32", "labels equal to full float32"]
    return md_table(header, rows) + caption(doc, run_facts(doc))


def lane(doc: dict, mode: str, dtype: str) -> dict | None:
    """The batch-size-largest lane of ``mode`` at ``dtype`` in a ``bench`` document, or None."""
    found = [m for m in doc["modes"] if m["mode"] == mode and m["dtype"] == dtype]
    return max(found, key=lambda m: m["batch_size"]) if found else None


def machines_table(docs: list[dict]) -> str:
    """One row per ``bench`` run: what `batched` gets on that machine in float32 and at its run dtype
    (``--dtype auto``), against full float32 re-encoding, and a million records at that speed."""
    rows = []
    for doc in docs:
        fp32, auto = lane(doc, "batched", "float32"), lane(doc, "batched", doc["dtype"])
        rows.append([machine_name(doc["machine"]), doc["model"].split("@")[0], doc["dtype"],
                     f"{fp32['speedup_vs_full']:.1f}x" if fp32 else "–",
                     f"{auto['speedup_vs_full']:.1f}x (B = {auto['batch_size']})", ms(auto["ms_per_item"]),
                     duration(auto["ms_per_item"] * 1000)])
    header = ["machine", "model", "`--dtype auto`", "batched float32 vs full float32", "batched at `auto` vs full float32",
              "ms / record at `auto`", "a million records"]
    notes = "; ".join(f"{machine_name(d['machine'])}: `{d['machine'].get('command', '')}`"
                      + (f" ({d['machine']['note']})" if d["machine"].get("note") else "") for d in docs)
    return md_table(header, rows) + f"\n*One `prefixcache bench` run per row, in one process each: {notes}.*\n"


def sweep_table(doc: dict) -> str:
    rows = [[str(p["prefix_tokens"]), ms(p["full_ms_per_item"]), ms(p["batched_ms_per_item"]), f"{p['speedup']:.0f}x"]
            for p in doc["sweep"]]
    header = ["prefix tokens", "full ms/item", "batched ms/item", "batched / full"]
    return md_table(header, rows) + caption(doc, f"{doc['model']}, run dtype {doc['dtype']}, {doc['threads']} threads")


def labels_table(doc: dict) -> str:
    """The many-label lanes (``modes``) and the trie's arithmetic floor per record."""
    floor = doc["labels"]["floor"]
    parts = [("weights over the record's and the fed nodes' tokens", floor["linear_gflop"]),
             ("full-vocabulary normalizer", floor["normalizer_gflop"]),
             ("those tokens' attention to the prefix", floor["prefix_attention_gflop"])]
    peak = floor["peak_gflops"]
    rows = [[name, f"{g:.1f}", ms(1000 * g / peak)] for name, g in parts]
    rows.append(["**floor**", f"{sum(g for _, g in parts):.1f}", f"**{ms(floor['ms'])}**"])
    facts = (f"{floor['labels']} labels, {floor['fed_nodes']} inner nodes fed per record, {floor['record_tokens']:.1f} "
             f"record tokens on average, at the measured float32 peak of {peak:,.0f} GFLOP/s")
    return md_table(["part", "GFLOP per record", "ms at the peak"], rows) + caption(doc, facts)


def demo_table(doc: dict) -> str:
    """``demo --json``: the float32 timing of full / cached / batched and the accuracy figures."""
    rows = [[m["mode"], str(m["batch_size"]), ms(m["ms_per_item"]), f"{m['speedup_vs_full']:.1f}x",
             f"{round(m['label_agreement'] * m['records'])}/{m['records']}"] for m in doc["timing"]]
    head = doc.get("fitted_head") or {}
    facts = (f"{doc['model']}, prefix {doc['prefix_tokens']} tokens; accuracy of the {doc['records']} tickets at "
             f"{doc['dtype'].removeprefix('torch.')}: {100 * doc['accuracy']:.1f}%")
    if head:
        facts += (f"; fitted head on {head['fitted_rows']} tickets, scored on the other {head['scored_rows']}: "
                  f"prompt {100 * head['prompt_accuracy']:.1f}% -> head {100 * head['head_accuracy']:.1f}%")
    header = ["mode (float32)", "B", "ms / ticket", "x full", "labels equal to full"]
    return md_table(header, rows) + caption(doc, facts)


def loadtest_table(doc: dict) -> str:
    rows = [[lane["name"], str(lane["max_batch"]), f"{lane['items_per_second']:.1f}", ms(lane["p50_ms"]),
             ms(lane["p99_ms"]), str(lane["errors"])] for lane in doc["lanes"]]
    facts = (f"micro-batched / one at a time: {doc['ratio']:.2f}x; the engine alone, in-process: "
             f"{doc['engine_ceiling']:.2f}x; {doc['errors']} errors")
    return md_table(["lane", "max batch", "items/s", "p50 ms", "p99 ms", "errors"], rows) + caption(doc, facts)


def accuracy_table(docs: list[dict]) -> str:
    """Pairs of ``eval --json`` documents: the prompt alone, then the same rows through a fitted head."""
    rows, commands = [], []
    for prompt, head in zip(docs[::2], docs[1::2]):
        words = prompt.get("machine", {}).get("command", "").split()
        source = f"`{words[2]}`, " if len(words) > 2 and words[1] == "eval" else ""
        rows.append([f"{prompt['task']}: {source}{prompt['records']} records", f"{100 * prompt['accuracy']:.1f}%",
                     f"{100 * head['accuracy']:.1f}%", f"{head['macro_f1']:.3f}"])
        commands += [f"`{d['machine']['command']}`" for d in (prompt, head) if d.get("machine", {}).get("command")]
    first = docs[0]
    facts = f"{first['model']}, run dtype {first['dtype']}; the commands, prompt then head: {', '.join(commands)}"
    bare = {**first, "machine": {k: v for k, v in first.get("machine", {}).items() if k != "command"}}
    return md_table(["data", "prompt alone", "fitted head", "head macro-F1"], rows) + caption(bare, facts)


MULTI: dict[str, Callable] = {"accuracy": accuracy_table, "machines": machines_table, "tuning": tuning_table,
                              "curves": curves_table, "second-model": second_model_table}
KINDS: dict[str, Callable] = {
    "modes": modes_table, "lanes": lanes_table, "sweep": sweep_table,
    "labels": labels_table, "demo": demo_table, "loadtest": loadtest_table,
}


def render(spec: str, root: Path) -> str:
    """The body of a ``<!-- table: spec -->`` block: ``spec`` is ``KIND PATH [PATH ...]``, paths from ``root``.

    Raises:
        ValueError: an unknown kind, or no JSON path.
        OSError: a JSON file cannot be read.
    """
    kind, *paths = spec.split()
    if not paths:
        raise ValueError(f"table {spec!r} names no JSON file")
    docs = [json.loads((root / p).read_text()) for p in paths]
    if kind in MULTI:
        return MULTI[kind](docs)
    if kind not in KINDS:
        raise ValueError(f"unknown table kind {kind!r} (one of {', '.join([*MULTI, *KINDS])})")
    return KINDS[kind](docs[0])


def blocks(text: str, path: str, root: Path) -> list[Block]:
    """Every marked table of a markdown text, with what :func:`render` makes of its spec."""
    return [Block(path, m["spec"], m["body"], render(m["spec"], root)) for m in BLOCK.finditer(text)]


def refresh(text: str, root: Path, failed: list | None = None) -> str:
    """``text`` with every marked table's body rendered again from its JSON. With a ``failed`` list, a table whose
    JSON cannot be read or rendered is left as it is and ``(spec, error)`` appended; without one, the error rises."""

    def fill(m: re.Match) -> str:
        try:
            return m[1] + render(m["spec"], root) + m[4]
        except (OSError, ValueError, KeyError) as exc:
            if failed is None:
                raise
            failed.append((m["spec"], exc))
            return m[0]

    return BLOCK.sub(fill, text)


def documents(root: Path) -> list[Path]:
    """The markdown files that may hold marked tables: the README and ``docs/*.md``."""
    return sorted(p for pattern in DOCUMENTS for p in root.glob(pattern))


def stale_blocks(root: Path) -> list[Block]:
    """Every marked table, in the README and the docs, whose text differs from its JSON's rendering."""
    found = []
    for path in documents(root):
        found += [b for b in blocks(path.read_text(), str(path.relative_to(root)), root) if b.body != b.expected]
    return found


def main(argv: list[str] | None = None) -> int:
    """``--write``: re-render every table in place; ``--check`` (default): exit 1, naming them, if any is stale."""
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[args.index("--root") + 1]) if "--root" in args else Path.cwd()
    if "--write" in args:
        failed = []
        for path in documents(root):
            text = path.read_text()
            fresh = refresh(text, root, failed)
            if fresh != text:
                path.write_text(fresh)
                print(f"rewrote {path.relative_to(root)}")
        for spec, exc in failed:
            print(f"not rendered (left as it was): {spec}: {exc!r}")
        return 1 if failed else 0
    stale = stale_blocks(root)
    for b in stale:
        print(f"{b.path}: table '{b.spec}' differs from its JSON (make tables rewrites it)")
    return 1 if stale else 0


if __name__ == "__main__":  # pragma: no cover - python -m prefixcache.bench.tables
    raise SystemExit(main())
