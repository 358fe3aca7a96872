# Study behind docs/accuracy.md, "Accuracy against labelled rows": held-out accuracy against rows per intent.
"""Curves of held-out accuracy against labelled rows per intent, for the prompt alone, a linear head (``fit``), a
tuned prefix (``fit --tune prefix``) and a tuned prefix with a head refitted on its states.

Every point of a data set's curve is scored on the same held-out rows: those of ``tuning_study.py`` at 10 rows
per intent (``--scored-per-label`` per intent, seed ``--seed + 1``), never fitted and not in the prompt. The
fitted rows at K per intent are the first K of each intent in one fixed order (seed ``--seed``) without the
held-out rows, so each point's rows hold the smaller points' rows; ``all`` is every row not held out.

One JSON per data set (``--json``), written after every method of every point, so an interrupted run keeps what it
measured; a later run with more ``--points`` adds to it (the held-out rows must be the same). A tuned prefix whose
tuning is expected to take longer than ``--budget-minutes`` has left is not run: the JSON says why, with the
seconds per epoch measured at the largest tuned point and the extrapolation.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python studies/tuning_curves.py banking77 --points 2 5 10 \\
        --epochs 3 --json docs/bench/tuning-curves-banking77.json
    .venv/bin/python studies/tuning_curves.py --plot docs/img/tuning-curves.png \\
        --curves docs/bench/tuning-curves-banking77.json docs/bench/tuning-curves-natcs71.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_study import stratified_take, without_examples  # noqa: E402
from tuning_study import (  # noqa: E402  (the methods, their figures and the held-out split)
    DATA, Hooks, TuneConfig, commit, data_task, ids_hash, linear_head, machine_info, refitted_head, scored_figures, split,
    tuned_figures, tuned_prefix_head,
)

ANCHOR = 10  # the held-out rows are tuning_study.py's at this many fitted rows per intent
METHODS = ("prompt alone", "linear head", "tuned prefix", "tuned prefix + head")


def curve_split(data: str, task, seed: int, scored_per_label: int) -> tuple[list[dict], list[dict]]:
    """The fixed order of fittable rows (intent by intent, each intent's rows shuffled by ``seed``) and the
    held-out rows, disjoint from it and from the prompt's examples."""
    rows = without_examples(DATA[data][1](), task.examples or [])
    _, scored = split(argparse.Namespace(data=data, per_label=ANCHOR, scored_per_label=scored_per_label, seed=seed),
                      task)
    held = {r["id"] for r in scored}
    return [r for r in stratified_take(rows, len(rows), seed) if r["id"] not in held], scored


def rows_at(order: list[dict], per_label: int | None) -> list[dict]:
    """The first ``per_label`` rows of each intent in ``order`` (None: all of them)."""
    counts: dict[str, int] = {}
    out = []
    for row in order:
        counts[row["label"]] = counts.get(row["label"], 0) + 1
        if per_label is None or counts[row["label"]] <= per_label:
            out.append(row)
    return out


def open_document(args, loaded, task, scored: list[dict]) -> dict:
    """The data set's JSON as far as it was written, or a new one; refuses another set of held-out rows."""
    new = {"data": args.data, "task": task.name, "model": loaded.identity, "labels": len(task.labels),
           "scored_rows": len(scored), "scored_ids_sha256": ids_hash(scored), "seed": args.seed,
           "epochs": args.epochs, "prompt": None, "points": [], "runs": []}
    if not args.json.exists():
        return new
    doc = json.loads(args.json.read_text())
    if doc["scored_ids_sha256"] != new["scored_ids_sha256"] or doc["model"] != new["model"]:
        raise SystemExit(f"{args.json} was measured on other held-out rows or another model; write another file")
    return doc


def save(args, doc: dict, loaded) -> None:
    doc["machine"] = machine_info(str(loaded.dtype).removeprefix("torch."), args.threads)
    doc["commit"], doc["date"] = args.started_at, datetime.date.today().isoformat()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")


def prompt_alone(args, loaded, task, scored: list[dict]) -> dict:
    """The prompt alone on the held-out rows: measured, or (``--prompt-from``) read from a ``tuning_study.py`` JSON
    of the same split (its command at 10 fitted and ``--scored-per-label`` scored rows per intent, same seed)."""
    if not args.prompt_from:
        return scored_figures(loaded, task, None, scored) | {"fit_seconds": 0.0}
    source = json.loads(args.prompt_from.read_text())
    command = source.get("command", "")
    same = (source["data"] == args.data and source["scored_rows"] == len(scored) and source["seed"] == args.seed
            and f"--per-label {ANCHOR}" in command and f"--scored-per-label {args.scored_per_label}" in command
            and source["model"] == loaded.identity)
    if not same:
        raise SystemExit(f"{args.prompt_from} is not a run on these held-out rows")
    return source["results"]["prompt alone"] | {"source": f"{args.prompt_from} (`{command}`)"}


def estimate(doc: dict, method: str, fit_rows: int, epochs: int) -> dict | None:
    """``method``'s fit seconds at ``fit_rows`` rows, scaled by rows from the largest point that ran it (a tuned
    prefix: its seconds per epoch, times ``epochs``); None before any point ran it."""
    ran = [p for p in doc["points"] if method in p["results"]]
    if not ran:
        return None
    largest = max(ran, key=lambda p: p["fit_rows"])
    run = largest["results"][method]
    if method == "linear head":
        scaled = run["fit_seconds"] * fit_rows / largest["fit_rows"]
        return {"measured_at_fit_rows": largest["fit_rows"], "measured_seconds": round(run["fit_seconds"], 1),
                "extrapolated_seconds": round(scaled)}
    per_epoch = run["epochs"][-1]["seconds"] / len(run["epochs"])
    scaled = per_epoch * fit_rows / largest["fit_rows"]
    return {"measured_at_fit_rows": largest["fit_rows"], "measured_seconds_per_epoch": round(per_epoch, 1),
            "extrapolated_seconds_per_epoch": round(scaled), "extrapolated_seconds": round(scaled * epochs)}


def over_budget(doc: dict, method: str, fit_rows: int, epochs: int, deadline: float) -> dict | None:
    """Why ``method`` is not run at ``fit_rows`` rows (with the estimate), or None when it is expected to fit."""
    guess = estimate(doc, method, fit_rows, epochs)
    left = round(deadline - time.time())
    if guess is None or 1.3 * guess["extrapolated_seconds"] < left:
        return None
    what = f"tuning {fit_rows:,} rows for {epochs} epochs" if method == "tuned prefix" else f"fitting {fit_rows:,} rows"
    return {"why": f"not run: {what} was expected to take {guess['extrapolated_seconds']:,} s (x 1.3 for safety: "
                   f"{round(1.3 * guess['extrapolated_seconds']):,} s), with {max(left, 0):,} s of the run's budget left",
            **guess}


def point_entry(doc: dict, label: str, fit_rows: list[dict], keep_head: bool) -> dict:
    """The JSON entry of a point, emptied of any earlier measurement of it; with ``keep_head``, a linear head
    measured earlier on the same fitted rows is kept, with the commit and threads of its run."""
    earlier = next((p for p in doc["points"] if p["per_label"] == label), None)
    doc["points"] = [p for p in doc["points"] if p["per_label"] != label]
    entry = {"per_label": label, "fit_rows": len(fit_rows), "fit_ids_sha256": ids_hash(fit_rows), "results": {}}
    if keep_head and earlier and earlier["fit_ids_sha256"] == entry["fit_ids_sha256"] \
            and "linear head" in earlier["results"]:
        entry["results"]["linear head"] = {"commit": earlier.get("commit"), "threads": earlier.get("threads"),
                                           **earlier["results"]["linear head"]}
    doc["points"].append(entry)
    doc["points"].sort(key=lambda p: float("inf") if p["per_label"] == "all" else p["per_label"])
    return entry


def run_point(ctx, label, fit_rows: list[dict], deadline: float, bar) -> None:
    """The three fitted methods at one point, each written to the JSON as soon as it is scored; a method expected
    to end past ``deadline`` is not run, and the JSON says why."""
    args, loaded, task, scored, doc = ctx
    entry = point_entry(doc, label, fit_rows, args.keep_head)
    entry["commit"], entry["threads"], entry["epochs"], entry["absent"] = args.started_at, args.threads, args.epochs, {}
    if "linear head" not in entry["results"]:
        if why := over_budget(doc, "linear head", len(fit_rows), args.epochs, deadline):
            entry["absent"] = {"linear head": why, "tuned prefix": over_budget(doc, "tuned prefix", len(fit_rows),
                                                                               args.epochs, deadline) or why}
            return save(args, doc, loaded)
        bar.set_postfix_str(f"{label}/intent: linear head")
        head, seconds = linear_head(loaded, task, fit_rows, args.seed)
        entry["results"]["linear head"] = scored_figures(loaded, task, head, scored) | {"fit_seconds": seconds}
        save(args, doc, loaded)
    if why := over_budget(doc, "tuned prefix", len(fit_rows), args.epochs, deadline):
        entry["absent"]["tuned prefix"] = why
        return save(args, doc, loaded)
    entry["absent"]["tuned prefix"] = {"why": "not finished: the run was stopped while tuning"}
    save(args, doc, loaded)
    config = TuneConfig(epochs=args.epochs, seed=args.seed)
    hooks = Hooks(on_batch=lambda n, loss: bar.set_postfix_str(f"{label}/intent: tuning, loss {loss:.2f}"),
                  on_epoch=lambda e: print(f"  {label}/intent {e}", file=sys.stderr, flush=True))
    tuned, own = tuned_prefix_head(loaded, task, fit_rows, config, hooks)
    doc["prompt_tokens"] = len(own.prompt.prefix_ids)
    entry["results"]["tuned prefix"] = scored_figures(loaded, task, tuned.head, scored) | {
        "fit_seconds": tuned.seconds} | tuned_figures(tuned)
    del entry["absent"]["tuned prefix"]
    save(args, doc, loaded)
    bar.set_postfix_str(f"{label}/intent: head on the tuned prefix")
    refit, seconds = refitted_head(loaded, task, fit_rows, tuned, args.seed)
    entry["results"]["tuned prefix + head"] = scored_figures(loaded, task, refit, scored) | {"fit_seconds": seconds}
    save(args, doc, loaded)


def measure(args) -> None:
    import torch
    from tqdm import tqdm

    from prefixcache.cli.loading import open_model

    torch.set_num_threads(args.threads)
    deadline = time.time() + 60 * args.budget_minutes
    loaded = open_model("smollm2-135m", args.dtype, args.threads)
    task = data_task(args.data)
    order, scored = curve_split(args.data, task, args.seed, args.scored_per_label)
    doc = open_document(args, loaded, task, scored)
    doc["runs"].append(" ".join(sys.argv))
    points = [None if p == "all" else int(p) for p in args.points]
    with tqdm(total=len(points) + (args.prompt != "skip"), desc=args.data, unit="step") as bar:
        if args.prompt == "run" or (args.prompt == "missing" and doc["prompt"] is None):
            bar.set_postfix_str("prompt alone")
            doc["prompt"] = prompt_alone(args, loaded, task, scored)
            save(args, doc, loaded)
        bar.update(args.prompt != "skip")
        for per_label in points:
            run_point((args, loaded, task, scored, doc), per_label or "all", rows_at(order, per_label), deadline, bar)
            bar.update()
    print(table_text(doc))


def table_text(doc: dict) -> str:
    lines = []
    for p in doc["points"]:
        row = " ".join(f"{m} {100 * r['accuracy']:.1f}%" for m, r in p["results"].items())
        lines.append(f"{p['per_label']:>4} /intent ({p['fit_rows']} rows): {row}")
    return "\n".join(lines)


def plot(path: Path, paths: list[Path]) -> None:
    """One panel per data set: held-out accuracy against rows per intent, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads(p.read_text()) for p in paths]
    fig, axes = plt.subplots(1, len(docs), figsize=(6 * len(docs), 4.2), dpi=110, squeeze=False)
    styles = {"linear head": "o-", "tuned prefix": "s-", "tuned prefix + head": "^-"}
    for ax, doc in zip(axes[0], docs):
        xs = [f"{p['per_label']}\n({p['fit_rows']:,} rows)" for p in doc["points"]]
        for method, style in styles.items():
            at = [(x, 100 * p["results"][method]["accuracy"]) for x, p in zip(xs, doc["points"]) if method in p["results"]]
            if at:
                ax.plot([x for x, _ in at], [y for _, y in at], style, label=method)
        if doc.get("prompt"):
            ax.plot(xs, [100 * doc["prompt"]["accuracy"]] * len(xs), "--", color="grey", label="prompt alone")
        ax.set_xlabel("labelled rows per intent (all: every row not held out)")
        ax.set_ylabel("held-out accuracy (%)")
        ax.set_ylim(0, 100)
        ax.set_title(f"{doc['data']} ({doc['task']}): {doc['scored_rows']} held-out rows", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"smollm2-135m {docs[0]['machine']['dtype']}, {docs[0]['epochs']} tuning epochs at most", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="?", choices=list(DATA))
    parser.add_argument("--points", nargs="+", default=["2", "5", "10"], help="rows per intent, or all")
    parser.add_argument("--scored-per-label", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=TuneConfig.epochs)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    parser.add_argument("--dtype", default="float32", help="float32: torch's CPU backward is faster than bfloat16's here")
    parser.add_argument("--prompt", choices=["missing", "run", "skip"], default="missing",
                        help="score the prompt alone: when the JSON has no figure yet (default), again, or not")
    parser.add_argument("--prompt-from", type=Path, help="a tuning_study.py JSON of the same held-out rows to take "
                        "the prompt alone's figures from, instead of scoring it")
    parser.add_argument("--budget-minutes", type=float, default=90.0,
                        help="a tuned prefix expected to end past this is not run (the JSON says why)")
    parser.add_argument("--keep-head", action="store_true",
                        help="keep a point's linear head measured earlier on the same fitted rows, tune only")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="draw the curves of the --curves JSON files into this PNG")
    parser.add_argument("--curves", type=Path, nargs="+", default=[])
    args = parser.parse_args()
    args.started_at = commit()  # the commit checked out when the run started: others may land while it runs
    if args.plot:
        plot(args.plot, args.curves)
        return
    if not args.data or not args.json:
        parser.error("a data set and --json are needed (or --plot PNG --curves JSON...)")
    measure(args)


if __name__ == "__main__":
    main()
