# Study behind docs/accuracy.md, "Confidence you can act on" (its tables and plots).
"""The trust measurements behind docs/accuracy.md ("Confidence you can act on"), on features that
``studies/trust_features.py`` cached (held-out rows only; nothing here runs the model).

    PYTHONPATH=src .venv/bin/python studies/trust_study.py [--cache /tmp/trust_cache] [--plots docs/img]

Prints markdown tables: calibration error before and after (temperature, and the alternatives measured),
selective accuracy, the ``suggest`` simulation on banking77, and the cost of the output writers.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.special import log_softmax
from sklearn.isotonic import IsotonicRegression
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from prefixcache.engine.confidence import (
    Calibration, confidence_and_correct, expected_calibration_error, fit_temperature, risk_coverage, threshold_for_accuracy,
)
from prefixcache.eval.fit_head import fit_head, single_threaded
from prefixcache.eval.suggest import choose_rows
from prefixcache.scheduler.feature_pass import FeatureSet
from prefixcache.scheduler.feature_store import FeatureStore

ROOT = Path(__file__).resolve().parents[1]


def load(cache: Path, name: str):
    rows = json.loads((cache / f"{name}.rows.json").read_text())
    chunks = sorted(cache.glob(f"{name}.[0-9][0-9][0-9].npz"))
    ids, feats, prompt, seconds = [], [], [], 0.0
    for path in chunks:
        with np.load(path, allow_pickle=True) as data:
            ids += list(data["ids"])
            feats.append(data["features"])
            prompt.append(data["prompt"])
            labels = tuple(str(x) for x in data["labels"])
            seconds += float(data["seconds"])
    by_id = {r["id"]: r for r in rows}
    gold = [by_id[i]["label"] for i in ids]
    fs = FeatureSet(ids=ids, features=np.vstack(feats), prompt_logprobs=np.vstack(prompt), labels=labels,
                    feature="last+mean@22", prefix_hash="", model_identity="smollm2-135m", text_hashes=list(ids))
    return fs, np.array([labels.index(g) for g in gold]), seconds / max(len(ids), 1), len(rows)


def part(fs: FeatureSet, index) -> FeatureSet:
    from prefixcache.eval.fit_curve import subset
    return subset(fs, index)


def pct(x):
    return f"{100 * x:.1f}%"


def alternatives(oof, y_oof, test, y_test):
    """Held-out ECE of the raw scores and of each calibration fitted on the out-of-fold scores."""
    found = {"raw": expected_calibration_error(*confidence_and_correct(test, y_test))}
    temperature = fit_temperature(oof, y_oof)
    found["temperature"] = expected_calibration_error(*confidence_and_correct(temperature.apply(test), y_test))
    c_oof, ok_oof = confidence_and_correct(oof, y_oof)
    c_test, ok_test = confidence_and_correct(test, y_test)
    if len(set(ok_oof.tolist())) > 1:
        platt = LogisticRegression(C=1e4).fit(np.log(c_oof / (1 - c_oof + 1e-12) + 1e-12)[:, None], ok_oof)
        p = platt.predict_proba(np.log(c_test / (1 - c_test + 1e-12) + 1e-12)[:, None])[:, 1]
    else:  # every out-of-fold row right: the fitted probability of being right is 1
        p = np.ones(len(c_test))
    found["Platt (top label)"] = expected_calibration_error(p, ok_test)
    found["oof_accuracy"] = float(ok_oof.mean())
    w, b = vector_scaling(oof, y_oof)
    scaled = log_softmax(w * np.where(np.isfinite(test), test, -50.0) + b, axis=1)
    found["vector scaling"] = expected_calibration_error(*confidence_and_correct(scaled, y_test))
    found["vector scaling changes labels"] = float((scaled.argmax(1) != test.argmax(1)).mean())
    iso = IsotonicRegression(y_min=0, y_max=1, out_of_bounds="clip").fit(c_oof, ok_oof)
    found["isotonic (top label)"] = expected_calibration_error(iso.predict(c_test), ok_test)
    return found, temperature


def vector_scaling(logprobs, y, l2=1e-3):
    """Per-label scale and bias on the log-probs (Guo et al.'s vector scaling), by L-BFGS on the mean cross-entropy."""
    from scipy.optimize import minimize

    x = np.where(np.isfinite(logprobs), logprobs, -50.0)
    n, k = x.shape
    onehot = np.eye(k)[y]

    def loss(theta):
        w, b = theta[:k], theta[k:]
        z = log_softmax(w * x + b, axis=1)
        p = np.exp(z)
        value = -(z * onehot).sum(1).mean() + l2 * ((w - 1) ** 2).sum()
        grad_w = ((p - onehot) * x).mean(0) + 2 * l2 * (w - 1)
        return value, np.concatenate([grad_w, (p - onehot).mean(0)])

    theta = minimize(loss, np.concatenate([np.ones(k), np.zeros(k)]), jac=True, method="L-BFGS-B").x
    return theta[:k], theta[k:]


def head_study(name, fs, y, fit_index, test_index, coverages, targets):
    result = fit_head(part(fs, fit_index), [fs.labels[j] for j in y[fit_index]], folds=5)
    held = part(fs, test_index)
    scores = result.head.log_probs(held.features, held.prompt_logprobs).numpy()
    oof = result.oof_logprobs
    found, _ = alternatives(oof, y[fit_index], scores, y[test_index])
    temperature = result.calibration  # what `fit` stores (the identity when out-of-fold rows are almost all right)
    found["temperature as fit stores it"] = expected_calibration_error(*confidence_and_correct(temperature.apply(scores),
                                                                                               y[test_index]))
    found["out-of-fold: raw, calibrated"] = result.ece
    calibrated = temperature.apply(scores)
    conf, ok = confidence_and_correct(calibrated, y[test_index])
    curve = risk_coverage(conf, ok)
    row = {"name": name, "fitted": len(fit_index), "scored": len(test_index), "accuracy": ok.mean(),
           "T": temperature.temperature, "ece": found, "at_coverage": {c: curve.at_coverage(c) for c in coverages}}
    for target in targets:  # the threshold --target-accuracy picks on the out-of-fold rows, applied to held-out rows
        chosen = threshold_for_accuracy(result.oof_confidence, result.oof_correct, target)
        accepted = conf >= chosen.threshold if chosen else np.zeros(len(conf), bool)
        row[f"target {target}"] = (chosen.coverage if chosen else 0.0, accepted.mean(),
                                   ok[accepted].mean() if accepted.any() else float("nan"))
    return row, conf, ok


def prompt_study(fs, y, fit_index, test_index):
    """The prompt's own first-token scores, calibrated on ``fit_index`` and measured on ``test_index``."""
    found, temperature = alternatives(fs.prompt_logprobs[fit_index], y[fit_index], fs.prompt_logprobs[test_index], y[test_index])
    ok = fs.prompt_logprobs[test_index].argmax(1) == y[test_index]
    return {"accuracy": ok.mean(), "T": temperature.temperature, "ece": found}


def simulate(fs, y, pool_index, test_index, strategies, budgets, seeds, C=0.1):
    """Accuracy on ``test_index`` of a head fitted (fixed C) on rows chosen from ``pool_index`` at each budget."""
    x_pool, y_pool = fs.features[pool_index], y[pool_index]
    scaler = StandardScaler().fit(x_pool)
    z_pool, z_test = scaler.transform(x_pool), scaler.transform(fs.features[test_index])
    n_labels = len(fs.labels)
    results = {}
    for strategy in strategies:
        for seed in seeds:
            rng = np.random.default_rng(seed)
            start = np.concatenate([rng.choice(np.flatnonzero(y_pool == k), 2, replace=False) for k in range(n_labels)])
            chosen = set(start.tolist())
            for budget in budgets:
                model = _fit(z_pool, y_pool, sorted(chosen), C, seed)
                results.setdefault((strategy, budget), []).append((model.predict(z_test) == y[test_index]).mean())
                if budget == budgets[-1]:
                    break
                add = budgets[budgets.index(budget) + 1] - budget
                exclude = np.zeros(len(z_pool), bool)
                exclude[list(chosen)] = True
                logprobs = _full_logprobs(model, z_pool, n_labels)
                picked = choose_rows(x_pool, add, logprobs if strategy in ("uncertain", "margin") else None,
                                     strategy=strategy, exclude=exclude, seed=seed)
                chosen |= set(picked.tolist())
    return results


def _fit(z, y, rows, C, seed):
    with single_threaded():
        return LogisticRegression(C=C, max_iter=300, tol=1e-3, random_state=seed).fit(z[rows], y[rows])


def _full_logprobs(model, z, n_labels):
    out = np.full((len(z), n_labels), -50.0)
    out[:, model.classes_] = model.predict_log_proba(z)
    return out


def writer_cost(n=2000, labels=3):
    """Microseconds per record of rendering a line with and without kept fields, and of the CSV/Parquet finish."""
    import tempfile

    from prefixcache.io.jsonl import write_line
    from prefixcache.io.outputs import RowTap, finish_table
    from prefixcache.types import LabelScores, Prediction, Record

    names = tuple(f"label_{k}" for k in range(labels))
    records = [Record(f"r{i}", {"text": f"ticket text number {i} " * 4, "team": f"t{i % 7}", "priority": i % 3}) for i in range(n)]
    preds = [Prediction(r.id, LabelScores(names, tuple(np.log(np.full(labels, 1 / labels))))) for r in records]
    figures = {}
    for keep in ((), ("team", "priority")):
        tap, sink = RowTap(keep), io.StringIO()
        list(tap.records(records))
        started = time.perf_counter()
        for p in preds:
            write_line(sink, tap.render(p))
        figures["jsonl" + (" + keep 2 fields" if keep else "")] = 1e6 * (time.perf_counter() - started) / n
    with tempfile.TemporaryDirectory() as folder:
        for suffix in ("csv", "parquet"):
            journal = Path(folder) / f"out.{suffix}.journal.jsonl"
            tap = RowTap(("team", "priority"))
            list(tap.records(records))
            with journal.open("w") as fh:
                for p in preds:
                    write_line(fh, tap.render(p))
            started = time.perf_counter()
            finish_table(journal, Path(folder) / f"out.{suffix}")
            figures[f"{suffix} (whole file at the end)"] = 1e6 * (time.perf_counter() - started) / n
    return figures


def second_round_cost(rows=10_000, width=1152, labels=77, n=77):
    """Seconds of a second ``suggest`` round over an encoded pool: read the stored features, score them with a head
    ``[rows, F] x [F, L]``, choose ``n`` rows (uncertain and diverse)."""
    import tempfile

    from prefixcache.scheduler.feature_store import FeatureStore

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        store = FeatureStore(Path(folder))
        store.add([f"{i:064x}" for i in range(rows)], rng.normal(size=(rows, width)).astype(np.float32),
                  rng.normal(size=(rows, labels)).astype(np.float32))
        started = time.perf_counter()
        again = FeatureStore(Path(folder))
        keys = list(again.rows)
        x = np.stack([again.rows[k][0] for k in keys])
        read = time.perf_counter() - started
        weight = rng.normal(size=(labels, width)).astype(np.float32)
        logits = x @ weight.T
        logprobs = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
        chosen = choose_rows(x, n, logprobs, strategy="uncertain")
        uncertain = time.perf_counter() - started
        choose_rows(x, n, None, strategy="diverse")
        diverse = time.perf_counter() - started - uncertain
    return {"rows": rows, "read_s": read, "uncertain_total_s": uncertain, "diverse_s": diverse, "chosen": len(chosen)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", type=Path, default=Path("/tmp/trust_cache"))
    parser.add_argument("--plots", type=Path, default=None)
    parser.add_argument("--only", default="tickets,banking77,natcs71,writers,suggest_cost")
    parser.add_argument("--store", type=Path, default=None, help="banking77-all: the --feature-cache of `suggest`")
    parser.add_argument("--store-rows", type=Path, default=None, help="banking77-all: the pool file given to `suggest`")
    args = parser.parse_args()
    report = {}
    if "tickets" in args.only:
        report["tickets"] = tickets(args)
    if "banking77" in args.only.split(",") and (args.cache / "banking77.rows.json").exists():
        report["banking77"] = banking(args)
    if "banking77-all" in args.only.split(","):
        report["banking77-all"] = banking_all(args)
    if "natcs71" in args.only and (args.cache / "natcs71.rows.json").exists():
        report["natcs71"] = natcs71(args)
    if "suggest_cost" in args.only:
        report["suggest_cost"] = second_round_cost()
        print("second suggest round:", json.dumps(report["suggest_cost"]))
    if "writers" in args.only:
        report["writers"] = {labels: writer_cost(labels=labels) for labels in (3, 77)}
        print("writers, microseconds per record:", json.dumps(report["writers"], indent=1))
    (args.cache / "trust_results.json").write_text(json.dumps(report, indent=1, default=str))


def tickets(args):
    fs, y, s_per_row, _ = load(args.cache, "tickets")
    synthetic = np.array([i for i, k in enumerate(fs.ids) if not str(k).startswith("hw")])
    hand = np.array([i for i, k in enumerate(fs.ids) if str(k).startswith("hw")])
    row, conf, ok = head_study("support-tickets (600 synthetic -> 75 hand-written)", fs, y, synthetic, hand,
                               (0.9, 0.95), (0.99,))
    prompt = prompt_study(fs, y, synthetic, hand)
    print("tickets head:", json.dumps(row, default=str, indent=1))
    print("tickets prompt:", json.dumps(prompt, default=str, indent=1))
    print(f"tickets feature pass: {1000 * s_per_row:.0f} ms/row (shared machine)")
    if args.plots:
        from prefixcache.eval.selective import plot_trust
        plot_trust(conf, ok, args.plots / "trust-tickets.png", "support-tickets head: 75 hand-written tickets (calibrated)")
    return {"head": row, "prompt": prompt, "ms_per_row": 1000 * s_per_row}


def banking(args):
    fs, y, s_per_row, total = load(args.cache, "banking77")
    seen = {}
    pool, test = [], []
    for i, label in enumerate(y):
        seen[label] = seen.get(label, 0) + 1
        (pool if seen[label] <= 10 else test).append(i)
    pool, test = np.array(pool), np.array(test)
    row, conf, ok = head_study(f"banking77-short ({len(pool)} -> {len(test)})", fs, y, pool, test, (0.5, 0.65, 0.8), (0.95,))
    prompt = prompt_study(fs, y, pool, test)
    print("banking77 head:", json.dumps(row, default=str, indent=1))
    print("banking77 prompt:", json.dumps(prompt, default=str, indent=1))
    budgets = [154, 231, 308, 385, 462, 539, 616, 770]
    sim = simulate(fs, y, pool, test, ("random", "uncertain", "margin", "diverse"), budgets, (0, 1, 2))
    table = {f"{s} @ {b}": (float(np.mean(v)), float(np.std(v))) for (s, b), v in sim.items()}
    print("suggest simulation:", json.dumps(table, indent=1))
    if args.plots:
        _plot_sim(sim, budgets, args.plots / "trust-suggest-banking77.png", len(pool), len(test))
        from prefixcache.eval.selective import plot_trust
        plot_trust(conf, ok, args.plots / "trust-banking77.png", f"banking77-short head, {len(test)} held-out rows (calibrated)")
    return {"head": row, "prompt": prompt, "simulation": table, "ms_per_row": 1000 * s_per_row, "rows": total}


def load_store(store: Path, rows_path: Path, task_path: str):
    """The features ``prefixcache suggest --feature-cache`` stored (every shard under ``store``), for the rows of
    ``rows_path`` (JSON Lines with ``id``, ``text``, ``label``), in that order."""
    from prefixcache.engine.head_file import text_hash
    from prefixcache.task.definition import load_task

    task = load_task(task_path)
    stored = {}
    for folder in sorted({shard.parent for shard in store.rglob("shard-*.npz")}):  # one folder per model and prompt
        stored.update(FeatureStore(folder).rows)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    keys = [text_hash({"text": r["text"]}, task.fields) for r in rows]
    labels = tuple(task.labels)
    fs = FeatureSet(ids=[r["id"] for r in rows], features=np.stack([stored[k][0] for k in keys]),
                    prompt_logprobs=np.stack([stored[k][1] for k in keys]), labels=labels, feature="last+mean@3/4",
                    prefix_hash="", model_identity="smollm2-135m", text_hashes=keys)
    return fs, np.array([labels.index(r["label"]) for r in rows])


def banking_all(args):
    """banking77 at full scale: the whole training split, 10 rows per intent held out (never fitted on, never in a
    pool), the rest the pool; the head at 10 rows per intent, and the ``suggest`` simulation over the whole pool."""
    fs, y = load_store(args.store, args.store_rows, str(ROOT / "docs" / "tasks" / "banking77-short.yaml"))
    seen, pool, test, ten = {}, [], [], []
    for i, label in enumerate(y):
        seen[label] = seen.get(label, 0) + 1
        (test if seen[label] <= 10 else pool).append(i)
        if 10 < seen[label] <= 20:
            ten.append(i)
    pool, test, ten = np.array(pool), np.array(test), np.array(ten)
    row, conf, ok = head_study(f"banking77-short, 10 per intent ({len(ten)} -> {len(test)})", fs, y, ten, test,
                               (0.5, 0.65, 0.8, 0.9), (0.95,))
    prompt = prompt_study(fs, y, pool, test)
    print("banking77 (full) head:", json.dumps(row, default=str, indent=1))
    print("banking77 (full) prompt:", json.dumps(prompt, default=str, indent=1))
    budgets = [154, 231, 308, 385, 462, 539, 616, 770, 1155, 1540]
    sim = simulate(fs, y, pool, test, ("random", "uncertain", "margin", "diverse"), budgets, (0, 1, 2))
    table = {f"{s} @ {b}": (float(np.mean(v)), float(np.std(v))) for (s, b), v in sim.items()}
    print("suggest simulation (whole pool):", json.dumps(table, indent=1))
    whole = whole_pool_accuracy(fs, y, pool, test)
    print("head on the whole pool:", pct(whole))
    if args.plots:
        _plot_sim(sim, budgets, args.plots / "trust-suggest-banking77-full.png", len(pool), len(test))
        from prefixcache.eval.selective import plot_trust
        plot_trust(conf, ok, args.plots / "trust-banking77-full.png", f"banking77-short head, 10 per intent, {len(test)} held-out rows (calibrated)")
    return {"head": row, "prompt": prompt, "simulation": table, "pool": len(pool), "test": len(test), "whole_pool": whole}


def whole_pool_accuracy(fs, y, pool, test, C=0.1) -> float:
    """Held-out accuracy of the simulation's head fitted on every pool row (what labelling the whole pool buys)."""
    scaler = StandardScaler().fit(fs.features[pool])
    model = _fit(scaler.transform(fs.features), y, pool.tolist(), C, 0)
    return float((model.predict(scaler.transform(fs.features[test])) == y[test]).mean())


def natcs71(args):
    """NatCS-71 at the scale collected: the first 2 rows of each intent fitted, the others scored."""
    fs, y, s_per_row, _ = load(args.cache, "natcs71")
    seen, fit, test = {}, [], []
    for i, label in enumerate(y):
        seen[label] = seen.get(label, 0) + 1
        (fit if seen[label] <= 2 else test).append(i)
    row, _, _ = head_study(f"natcs71 ({len(fit)} -> {len(test)})", fs, y, np.array(fit), np.array(test),
                           (0.5, 0.65, 0.8), (0.95,))
    prompt = prompt_study(fs, y, np.array(fit), np.array(test))
    print("natcs71 head:", json.dumps(row, default=str))
    print("natcs71 prompt:", json.dumps(prompt, default=str))
    return {"head": row, "prompt": prompt, "ms_per_row": 1000 * s_per_row}


def _plot_sim(sim, budgets, path, pool, test):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for strategy in ("random", "uncertain", "margin", "diverse"):
        means = [np.mean(sim[(strategy, b)]) for b in budgets if (strategy, b) in sim]
        axis.plot(budgets[:len(means)], means, marker="o", label=strategy)
    axis.set(xlabel="labelled rows", ylabel=f"accuracy on {test} held-out rows",
             title=f"banking77: rows chosen from a pool of {pool} (mean of 3 seeds)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
