# Study behind docs/accuracy.md, "A tuned prefix": the comparison table and its JSON under docs/bench/.
r"""Prompt alone, linear head, tuned prefix, tuned prefix + a head refitted on its states, and LoRA on the model's
weights (record tokens only; alone and + a refitted head), side by side, on rows held out of every fit and of the
prompt.

Each run writes one JSON (``--json``) that names its machine, the rows and every figure: accuracy and calibration
error on the scored rows, fit wall time, and classification ms/record (batched, same machine, same run) for the
prompt's prefix and the tuned one. Everything is computed by the package itself: ``collect_features`` and
``fit_head`` (what ``prefixcache fit`` runs), ``tune_prefix`` (the prefix and head ``fit --tune prefix
--no-refit-head`` writes), ``refit_head`` (the head ``fit --tune prefix`` writes with the prefix by default) and
``Classifier`` (what ``classify --head`` runs); LoRA by ``studies/lora_tuning.py`` through the same tuning loop.

``--prompt-examples K`` (banking77, natcs71) puts K of each intent's fitted rows in the prompt as worked examples
(the first K of each intent's fitted rows, in the split's fixed order), in the ``examples:`` form of
``docs/tasks/banking77.yaml``; they stay fitted, and the scored rows are the same as without them.

``--only`` runs some methods and writes their rows into the existing ``--json`` (same data, split, model and seed,
else refused), each row with its own run's commit, date, machine and command.

    .venv/bin/python studies/tuning_study.py banking77 --per-label 10 --scored-per-label 4 --json docs/bench/tuning-banking77.json
    .venv/bin/python studies/tuning_study.py tickets --json docs/bench/tuning-tickets.json
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python studies/tuning_study.py banking77 --per-label 10 \
        --scored-per-label 4 --epochs 4 --prompt-examples 1 --only head prefix --threads 1 \
        --json docs/bench/tuning-banking77-examples.json
    .venv/bin/python studies/tuning_study.py tickets --epochs 3 --only lora --threads 1 \
        --json docs/bench/tuning-tickets.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_study import (  # noqa: E402  (the data sets and splits of the head study)
    BUNDLED_TICKETS, HANDWRITTEN, NATCS71_INSTRUCTION, NATCS71_LABELS, TASK_DIR, banking77_rows, jsonl_rows,
    load_task_file, natcs71_rows, normalize_text, stratified_take, without_examples, write_task,
)

from prefixcache.engine.confidence import (  # noqa: E402
    calibration_error_floor, confidence_and_correct, expected_calibration_error, risk_coverage,
)
from prefixcache.engine.scoring import LabelScorer  # noqa: E402
from prefixcache.eval.fit_head import fit_head  # noqa: E402
from prefixcache.eval.tune_config import RefitConfig, TuneConfig  # noqa: E402
from prefixcache.eval.tune_prefix import Hooks, tune_prefix, tuned_manifest  # noqa: E402
from prefixcache.eval.tune_refit import refit_head, refit_manifest  # noqa: E402
from prefixcache.model.machine import machine_info  # noqa: E402
from prefixcache.scheduler.classify import Classifier  # noqa: E402
from prefixcache.scheduler.feature_pass import collect_features, own_rows  # noqa: E402
from prefixcache.task.definition import Task  # noqa: E402
from prefixcache.types import Mode, Record, RunConfig  # noqa: E402

DATA = {"banking77": ("banking77-short", banking77_rows), "natcs71": ("natcs-71-short", natcs71_rows)}
# Gemma's turn markers as a chat template, for a pretrained model whose tokenizer has none (Gemma 3 270M's .gguf)
TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
METHODS = ("prompt", "head", "prefix", "lora")  # --only's choices: the rows each gives are in measure()
SAME_SPLIT = ("data", "task", "model", "fit_rows", "scored_rows", "labels", "seed")  # what --only checks
COVERAGE = 0.65  # the share of scored rows accepted, most confident first, for ``accuracy_at_coverage``


def ids_hash(rows: list[dict]) -> str:
    """The rows' ids, sorted and hashed (16 hex digits): which rows a figure was measured on."""
    return hashlib.sha256("\n".join(sorted(r["id"] for r in rows)).encode()).hexdigest()[:16]


def commit() -> str:
    """The repository's short HEAD commit, or ``unknown``."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def data_task(data: str):
    """The task a data set is classified with. ``natcs-71-short`` (natcs-71's instruction and its 71 intents'
    names, no descriptions and no examples, as banking77-short is to banking77) is written on first use."""
    name = "support-tickets" if data == "tickets" else DATA[data][0]
    path = TASK_DIR / f"{name}.yaml"
    if name == "natcs-71-short" and not path.exists():
        write_task(path, ["natcs-71 with the instruction and the intent names only (no descriptions, no examples):",
                          "the short prompt of studies/tuning_study.py and tuning_curves.py. See docs/accuracy.md."],
                   name, NATCS71_INSTRUCTION, {label: "" for label in NATCS71_LABELS}, [], "Customer: {text}")
    return load_task_file(name)


def records(rows: list[dict]) -> list[Record]:
    return [Record(r["id"], {"text": r["text"], "label": r["label"]}) for r in rows]


def split(args, task) -> tuple[list[dict], list[dict]]:
    """The fitted rows and the scored rows (disjoint, neither in the prompt's examples)."""
    if args.data == "tickets":
        return jsonl_rows(BUNDLED_TICKETS), jsonl_rows(HANDWRITTEN)
    rows = without_examples(DATA[args.data][1](), task.examples or [])
    fit = stratified_take(rows, args.per_label, args.seed)
    taken = {r["id"] for r in fit}
    return fit, stratified_take(rows, args.scored_per_label, args.seed + 1, exclude=taken)


def with_prompt_examples(task, fit_rows: list[dict], scored_rows: list[dict], k: int):
    """``task`` with the first ``k`` fitted rows of each intent (in ``fit_rows``' order) as its examples, in the
    labels' order, named ``<task>-examples<k>``; ``task`` itself when ``k`` is 0. Asserts that no scored row is
    fitted or shown (by id or by normalized text)."""
    fitted, scored = {r["id"] for r in fit_rows}, {r["id"] for r in scored_rows}
    assert not fitted & scored, "a scored row is fitted"
    if k == 0:
        return task
    counts: dict[str, int] = {}
    shown = []
    for row in fit_rows:
        counts[row["label"]] = counts.get(row["label"], 0) + 1
        if counts[row["label"]] <= k:
            shown.append(row)
    order = list(task.labels)
    shown.sort(key=lambda r: order.index(r["label"]))
    assert all(counts.get(label, 0) >= k for label in order), f"an intent has fewer than {k} fitted rows"
    texts = {normalize_text(r["text"]) for r in shown}
    assert not scored & {r["id"] for r in shown}, "a scored row is in the prompt"
    assert not texts & {normalize_text(r["text"]) for r in scored_rows}, "a scored row's text is in the prompt"
    return Task.model_validate(task.model_dump() | {
        "name": f"{task.name}-examples{k}", "examples": [{"text": r["text"], "label": r["label"]} for r in shown]})


def figures(logprobs: np.ndarray, gold: np.ndarray) -> dict:
    """Accuracy and calibration error of label log-probs ``[N, L]`` as ``classify`` gives them (calibrated by the
    head's stored temperature, where it has one), and the accuracy of the rows accepted most confident first down
    to ``COVERAGE`` of them (rows of equal confidence accepted together, so the coverage reached is recorded); and the
    calibration error a perfectly calibrated model would show with the same confidences on as many rows."""
    confidence, correct = confidence_and_correct(logprobs, gold)
    curve = risk_coverage(confidence, correct)
    at = curve.reaching(COVERAGE)
    floor, floor_95 = calibration_error_floor(confidence)
    return {"accuracy": float(correct.mean()), "ece": expected_calibration_error(confidence, correct),
            "ece_floor": floor, "ece_floor_p95": floor_95,
            "accuracy_at_coverage": float(curve.accuracy[at]), "coverage": float(curve.coverage[at])}


def timed_classify(loaded, task, head, scored: list[Record]) -> tuple[np.ndarray, float]:
    """Label log-probs of the scored rows through ``head`` (None: the prompt alone), and batched ms/record."""
    classifier = Classifier(loaded, task, head=head)
    classifier.classify_all(scored[:8], RunConfig(Mode.BATCHED, 32))  # the prefix built, the kernels warm
    started = time.perf_counter()
    predictions = classifier.classify_all(scored, RunConfig(Mode.BATCHED, 32))
    ms = 1000 * (time.perf_counter() - started) / len(scored)
    return np.array([p.scores.logprobs for p in predictions]), ms


def linear_head(loaded, task, fit_rows: list[dict], seed: int):
    """What ``fit --tune head`` fits on ``fit_rows``: the head and its wall seconds, features included."""
    started = time.perf_counter()
    features = collect_features(loaded, task, records(fit_rows), config=RunConfig(batch_size=32))
    head = fit_head(features, [r["label"] for r in fit_rows], folds=5, seed=seed).head
    return head, time.perf_counter() - started


def tuned_prefix_head(loaded, task, fit_rows: list[dict], config: TuneConfig, hooks: Hooks = Hooks()):
    """What ``fit --tune prefix`` fits on ``fit_rows`` (its manifest filled in), and the prompt's own rows."""
    labels = list(task.labels)
    own = own_rows(loaded, task, records(fit_rows))
    scorer = LabelScorer(loaded.model, own.prompt, "first-token")
    fit_gold = np.array([labels.index(r["label"]) for r in fit_rows])
    tuned = tune_prefix(loaded, scorer, own.prompt.prefix_ids, own.rows, fit_gold, config, hooks)
    tuned.head.manifest.update(tuned_manifest(tuned, loaded, own, config, task.name))
    return tuned, own


def refitted_head(loaded, task, fit_rows: list[dict], tuned, seed: int):
    """What ``fit --tune prefix`` writes by default (``refit_head``): ``fit``'s head over features collected through
    ``tuned``'s prefix, carrying that prefix, calibrated on the tuning's held-out rows; and its seconds (the
    tuning's included)."""
    refitted = refit_head(loaded, task, records(fit_rows), [r["label"] for r in fit_rows], tuned,
                          RefitConfig(seed=seed), RunConfig(batch_size=32))
    refitted.tuned.head.manifest.update(refit_manifest(refitted, tuned.head.manifest))
    return refitted.tuned.head, tuned.seconds + refitted.seconds


def scored_figures(loaded, task, head, scored_rows: list[dict]) -> dict:
    """Accuracy, calibration error and batched ms/record of ``head`` (None: the prompt alone) on ``scored_rows``."""
    labels = list(task.labels)
    gold = np.array([labels.index(r["label"]) for r in scored_rows])
    logprobs, ms = timed_classify(loaded, task, head, records(scored_rows))
    return figures(logprobs, gold) | {"ms_per_record": ms}


def tuned_figures(tuned) -> dict:
    """The tuning's own record: its epochs, best epoch, held-out accuracy and prefix length."""
    return {"epochs": [vars(e) for e in tuned.epochs], "best_epoch": tuned.best_epoch,
            "heldout_accuracy": tuned.heldout_accuracy, "prefix_tokens": tuned.head.prefix.length}


def lora_rows(args, base, task, fit_rows: list[dict], scored_rows: list[dict]) -> dict:
    """LoRA on the weights, record tokens only (``studies/lora_tuning.py``), alone and with a head refitted on its
    states, on the transformers decoder for training and served merged on the lean one. Each row also carries
    ``base_ms_per_record``: the same head and prefix classified by ``base`` (the unadapted lean model) in the same
    run, the per-record cost LoRA is compared with."""
    from lora_tuning import LoraSettings, tune_lora

    from prefixcache.cli.loading import open_model

    trained_on = open_model("smollm2-135m", args.dtype, args.threads, decoder="transformers")
    labels = list(task.labels)
    own = own_rows(trained_on, task, records(fit_rows))
    config = TuneConfig(epochs=args.epochs, lr=args.lora_lr, seed=args.seed)
    settings = LoraSettings()
    lora = tune_lora(trained_on, own, np.array([labels.index(r["label"]) for r in fit_rows]), config, settings,
                     Hooks(on_epoch=lambda e: print(e, file=sys.stderr, flush=True)), task.name)
    same_head = replace(lora.head, manifest=lora.head.manifest | {"model": base.identity})
    base_ms = scored_figures(base, task, same_head, scored_rows)["ms_per_record"]
    about = {"lora": lora.head.manifest["tuned"]["lora"], "lr": args.lora_lr, "base_ms_per_record": base_ms}
    rows = {"LoRA (record tokens)": scored_figures(lora.served, task, lora.head, scored_rows) | {
        "fit_seconds": lora.tuned.seconds} | tuned_figures(lora.tuned) | about}
    refit, seconds = refitted_head(lora.served, task, fit_rows, lora.tuned, args.seed)
    rows["LoRA (record tokens) + head"] = scored_figures(lora.served, task, refit, scored_rows) | {
        "fit_seconds": seconds, "base_ms_per_record": base_ms}
    return rows


def measure(args, loaded, task, fit_rows: list[dict], scored_rows: list[dict]) -> tuple[dict, int]:
    """The rows of the methods ``args.only`` names, in the table's order, and the prompt's prefix length."""
    results, only = {}, set(args.only)
    own = own_rows(loaded, task, records(fit_rows[:1]))
    if "prompt" in only:
        results["prompt alone"] = scored_figures(loaded, task, None, scored_rows) | {"fit_seconds": 0.0}
    if "head" in only:
        head, seconds = linear_head(loaded, task, fit_rows, args.seed)
        results["linear head"] = scored_figures(loaded, task, head, scored_rows) | {"fit_seconds": seconds}
    if "prefix" in only:
        config = TuneConfig(epochs=args.epochs, seed=args.seed, virtual_tokens=args.virtual_tokens)
        tuned, own = tuned_prefix_head(loaded, task, fit_rows, config,
                                       Hooks(on_epoch=lambda e: print(e, file=sys.stderr, flush=True)))
        results["tuned prefix"] = scored_figures(loaded, task, tuned.head, scored_rows) | {
            "fit_seconds": tuned.seconds} | tuned_figures(tuned)
        refit, seconds = refitted_head(loaded, task, fit_rows, tuned, args.seed)
        results["tuned prefix + head"] = scored_figures(loaded, task, refit, scored_rows) | {"fit_seconds": seconds}
    if "lora" in only:
        results |= lora_rows(args, loaded, task, fit_rows, scored_rows)
    return results, len(own.prompt.prefix_ids)


def write(args, document: dict, results: dict, head: str) -> None:
    """Write ``document`` with ``results`` to ``args.json``: as it is when every method ran; with ``--only``, the
    rows merged into the existing file (a row of the same name replaced, the others kept), each carrying this
    run's ``run`` record (``head``: the commit checked out when the run started). Refuses a file of another data
    set, split, model or seed."""
    if set(args.only) == set(METHODS) or not args.json.exists():
        document["results"] = results
        args.json.write_text(json.dumps(document, indent=1))
        return
    existing = json.loads(args.json.read_text())
    differ = [k for k in SAME_SPLIT if existing.get(k) != document[k]]
    if differ:
        raise SystemExit(f"{args.json} was measured on another {', '.join(differ)}; write another file")
    run = {"commit": head, "date": datetime.date.today().isoformat(), "machine": document["machine"],
           "fit_ids_sha256": document["fit_ids_sha256"], "scored_ids_sha256": document["scored_ids_sha256"]}
    existing["results"] = existing["results"] | {name: row | {"run": run} for name, row in results.items()}
    args.json.write_text(json.dumps(existing, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", choices=["tickets", *DATA])
    parser.add_argument("--per-label", type=int, default=10)
    parser.add_argument("--scored-per-label", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=TuneConfig.epochs)
    parser.add_argument("--virtual-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="float32: torch's CPU backward is faster than bfloat16's here")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--only", nargs="+", choices=METHODS, default=list(METHODS),
                        help="the methods to run (default: all); a subset is merged into the existing --json")
    parser.add_argument("--prompt-examples", type=int, default=0,
                        help="K: the first K fitted rows of each intent also shown as the prompt's worked examples")
    parser.add_argument("--lora-lr", type=float, default=2e-3, help="the LoRA adapters' learning rate (AdamW)")
    parser.add_argument("--model", default="smollm2-135m",
                        help="another model (a .gguf path); one without a chat template is given Gemma's turns")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    from prefixcache.cli.loading import open_model

    head = commit()  # read now: other commits may land while the run goes on
    loaded = open_model(args.model, args.dtype, args.threads)
    if loaded.tokenizer.chat_template is None:
        loaded.tokenizer.chat_template = TURNS
    task = data_task(args.data)
    fit_rows, scored_rows = split(args, task)
    if args.prompt_examples and args.data == "tickets":
        parser.error("--prompt-examples is for banking77 and natcs71")
    task = with_prompt_examples(task, fit_rows, scored_rows, args.prompt_examples)
    results, prompt_tokens = measure(args, loaded, task, fit_rows, scored_rows)
    document = {"data": args.data, "task": task.name, "model": loaded.identity, "fit_rows": len(fit_rows),
                "scored_rows": len(scored_rows), "labels": len(task.labels), "prompt_tokens": prompt_tokens,
                "prompt_examples_per_label": args.prompt_examples, "seed": args.seed,
                "fit_ids_sha256": ids_hash(fit_rows), "scored_ids_sha256": ids_hash(scored_rows),
                "machine": machine_info(str(loaded.dtype).removeprefix("torch."), args.threads),
                "commit": head, "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}
    write(args, document, results, head)
    for name, row in results.items():
        print(f"{name:28s} accuracy {row['accuracy']:.1%}  ECE {row['ece']:.1%}  fit {row['fit_seconds']:.0f} s  "
              f"{row['ms_per_record']:.1f} ms/record  "
              f"{row['accuracy_at_coverage']:.1%} at {row['coverage']:.0%} coverage")


if __name__ == "__main__":
    main()
