"""The docs tables of the accuracy studies under ``studies/``: ``tuning`` (``tuning_study.py``), ``curves``
(``tuning_curves.py``) and ``second-model`` (``second_model.py``). Each renders committed JSONs only."""

from __future__ import annotations

import json

from .table_cells import caption, duration, md_table, ms


def tuning_table(docs: list[dict]) -> str:
    """``studies/tuning_study.py`` runs: per data set, the prompt alone, a linear head, a tuned prefix, a tuned
    prefix with a head refitted on its states and LoRA on the weights, on rows held out of every fit. A row that
    carries its own ``run`` (``--only``: measured by a later run, merged into the file) is named in the caption with
    that run's commit, date, threads, load and command. Where rows carry ``accuracy_at_coverage``, a column gives
    it (the accuracy of the most confident rows, at the ``coverage`` reached); where they carry ``ece_floor_p95``,
    the calibration error names it as the noise a perfectly calibrated model would show."""
    rows, later = [], {}
    covered = any("accuracy_at_coverage" in row for doc in docs for row in doc["results"].values())
    for doc in docs:
        where = f"{doc['data']} ({doc['fit_rows']} fitted -> {doc['scored_rows']} scored, "
        where += f"{doc['prompt_tokens']}-token prompt"
        shown = doc.get("prompt_examples_per_label")
        where += f", {shown} fitted row(s) per intent as its examples)" if shown else ")"
        for name, row in doc["results"].items():
            rows.append([where, name, f"{100 * row['accuracy']:.1f}%", error_cell(row),
                         duration(row["fit_seconds"]) if row["fit_seconds"] else "–", ms(row["ms_per_record"])])
            if covered:
                rows[-1].append(f"{100 * row['accuracy_at_coverage']:.1f}% at {100 * row['coverage']:.0f}%"
                                if "accuracy_at_coverage" in row else "–")
            if row.get("run"):
                later.setdefault((doc["data"], json.dumps(row["run"], sort_keys=True)), []).append(name)
    commands = ", ".join(study_command(d) for d in docs if d.get("machine", {}).get("command"))
    bare = {**docs[0], "machine": {k: v for k, v in docs[0].get("machine", {}).items() if k != "command"}}
    facts = f"{docs[0]['model']}, run dtype {docs[0]['machine'].get('dtype')}; the commands: {commands}"
    if later:
        facts += "; measured by a later run: " + "; ".join(
            later_run(data, names, json.loads(run)) for (data, run), names in later.items())
    header = ["data", "method", "accuracy", "calibration error", "fit", "ms / record (batched)"]
    return md_table(header + ["accuracy of the most confident rows"] * covered, rows) + caption(bare, facts)


def error_cell(row: dict) -> str:
    """A row's calibration error, and where measured, what a perfectly calibrated model would show on as many rows
    with the same confidences (the 95th percentile of its simulated errors)."""
    floor = row.get("ece_floor_p95")
    return f"{100 * row['ece']:.1f}%" + (f" (noise: up to {100 * floor:.1f}%)" if floor is not None else "")


def study_command(doc: dict) -> str:
    """A study JSON's command in backquotes, and the commit and date it names (where it names them)."""
    command = f"`{doc['machine']['command']}`"
    return f"{command} (commit {doc['commit']}, {doc['date']})" if doc.get("commit") else command


def later_run(data: str, methods: list[str], run: dict) -> str:
    """One later run of :func:`tuning_table`'s caption: its rows, commit, date, torch threads, load, command."""
    machine = run.get("machine", {})
    load = machine.get("load_average")
    where = f", load average {load[1]:g} over the last 5 minutes when written" if load else ""
    return (f"{data}, {' and '.join(methods)}: commit {run.get('commit', '?')}, {run.get('date', '?')}, "
            f"{machine.get('threads', '?')} torch thread(s){where}, `{machine.get('command', '?')}`")


CURVE_METHODS = ("prompt alone", "linear head", "tuned prefix", "tuned prefix + head")


def curve_cell(row: dict | None) -> str:
    """One method at one point of a curve: accuracy (calibration error, fit time); "–" where it was not run."""
    if row is None:
        return "–"
    seconds = row.get("fit_seconds")
    fit = f", {seconds:.0f} s" if seconds and seconds < 120 else f", {duration(seconds)}" if seconds else ""
    return f"{100 * row['accuracy']:.1f}% ({100 * row['ece']:.1f}%{fit})"


def usual_threads(doc: dict) -> int:
    """The torch threads most of a curve's points ran on (the caption's figure; a point that differs says so)."""
    threads = [p.get("threads", doc["machine"]["threads"]) for p in doc["points"]] or [doc["machine"]["threads"]]
    return max(threads, key=threads.count)


def point_run_notes(doc: dict, point: dict, usual: int) -> list[str]:
    """What differs at one point of a curve from its data set's caption (``usual`` torch threads, ``doc``'s epochs):
    the threads or the epochs its tuning ran with, and a linear head kept from an earlier run (its commit and
    threads)."""
    out, label = [], f"{doc['data']}, {point['per_label']}"
    threads, epochs = point.get("threads", doc["machine"]["threads"]), point.get("epochs", doc["epochs"])
    if threads != usual or epochs != doc["epochs"]:
        out.append(f"{label}: {threads} torch thread(s), at most {epochs} tuning epochs")
    head = point["results"].get("linear head", {})
    if head.get("commit"):
        out.append(f"{label}: the linear head from an earlier run (commit {head['commit']}, {head['threads']} torch "
                   f"thread(s))")
    return out


def curves_table(docs: list[dict]) -> str:
    """``studies/tuning_curves.py`` runs, one table per data set: each method's held-out accuracy (calibration error,
    fit time) at each number of labelled rows per intent, every point scored on the same held-out rows."""
    out, notes = [], []
    for doc in docs:
        points = doc["points"]
        header = [f"{doc['data']}: method"] + [
            f"{p['per_label']}{' / intent' if p['per_label'] != 'all' else ' rows'} ({p['fit_rows']:,})" for p in points]
        rows = [[name] + [curve_cell(doc["prompt"] if name == "prompt alone" else p["results"].get(name))
                          for p in points] for name in CURVE_METHODS]
        out.append(md_table(header, rows))
        commits = ", ".join(sorted({p.get("commit", doc["commit"]) for p in points} | {doc["commit"]}))
        notes.append(f"{doc['data']} (`{doc['task']}`, {doc['labels']} labels, {doc['scored_rows']} held-out rows, "
                     f"commits {commits}, {doc['date']})")
        usual = usual_threads(doc)
        for p in points:
            notes.extend(point_run_notes(doc, p, usual))
            for method in CURVE_METHODS:
                why = p.get("absent", {}).get(method)
                if why:
                    notes.append(f"{doc['data']}, {p['per_label']}: {method} {why if isinstance(why, str) else why['why']}")
        if doc["prompt"] and doc["prompt"].get("source"):
            notes.append(f"{doc['data']}: the prompt alone from {doc['prompt']['source']}")
    commands = ", ".join(f"`{c}`" for d in docs for c in d["runs"])
    bare = {**docs[0], "machine": {k: v for k, v in docs[0]["machine"].items() if k != "command"}}
    facts = (f"{docs[0]['model']}, {usual_threads(docs[0])} torch thread(s), at most {docs[0]['epochs']} "
             f"tuning epochs; {'; '.join(notes)}; the commands: "
             f"{commands}")
    return "\n".join(out) + caption(bare, facts)


SECOND_MODEL_DATA = {"banking77": "banking77 (`banking77-short`)", "tickets": "tickets (`support-tickets`)"}


def second_model_table(docs: list[dict]) -> str:
    """``studies/second_model.py``: per data set and model, the prompt's first-token scores and a linear head on
    the model's states, every model through transformers' own cache, on the same held-out rows."""
    doc, rows, commands = docs[0], [], []
    for data, run in doc["data"].items():
        where = f"{SECOND_MODEL_DATA.get(data, data)}, {run['fit_rows']} fitted -> {run['scored_rows']} scored"
        for model, row in run["models"].items():
            head = row["linear head"]
            rows.append([where, f"{model.split('@')[0]} ({row['layers']} layers)", f"{row['prompt_tokens']:,}",
                         f"{100 * row['prompt alone']['accuracy']:.1f}%", f"{100 * head['accuracy']:.1f}%",
                         f"{100 * head['ece_calibrated']:.1f}%", duration(row["seconds"])])
            commands.append(f"`{row['machine']['command']}` (commit {row['commit']}, {row['date']})")
    bare = {"machine": {k: v for k, v in doc["machine"].items() if k != "command"}}
    facts = (f"{doc['machine'].get('threads')} torch thread(s), features "
             f"`last+mean@3/4`; the commands: {', '.join(sorted(set(commands)))}")
    header = ["data", "model", "prompt tokens", "prompt alone (first token)", "linear head", "calibration error",
              "features + fit"]
    return md_table(header, rows) + caption(bare, facts)
