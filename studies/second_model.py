"""A linear head on a second small model's states, beside the embedded model's, through one code path.

The prefix cache refuses models with sliding-window layers (Gemma 3 interleaves five 512-token sliding layers
with one full layer), so this study does not use it: every model here runs through transformers' own forward pass
and its own ``DynamicCache`` (the prompt computed once, copied for each batch of records; sliding windows are
transformers' to apply). The embedded model runs through the same path, so its row checks the path against the
product's own figure (``fit`` on the same rows, docs/accuracy.md).

Rows are tokenized by the product (``own_rows``: the task's chat prompt, each record's own tokens after the
prompt's prefix). A base model without a chat template gets :data:`TURNS`, Gemma's turn markers written as a
template. Features are ``fit``'s default, ``last+mean@3/4``: the final normed state at the record's last token and
the mean of the record's tokens at three quarters of the depth. The head is ``fit_head``'s (``C`` by stratified
5-fold cross-validation on the fitted rows), scored on rows held out of the fit and of the prompt: the splits of
``tuning_study.py`` (banking77: 10 fitted and 4 scored rows per intent; tickets: the 600 bundled -> the 75
hand-written). "Prompt alone" is the first-token label scores (labels sharing a first token tie).

    OMP_NUM_THREADS=1 .venv/bin/python studies/second_model.py banking77 --model /path/gemma-3-270m-q4_k_m.gguf \
        --threads 1 --json docs/bench/second-model.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tuning_study import TURNS, commit, data_task, figures, ids_hash, records, split  # noqa: E402

from prefixcache.eval.fit_curve import subset  # noqa: E402
from prefixcache.eval.fit_head import fit_head, gold_indices, split_log_probs  # noqa: E402
from prefixcache.model.load import DEFAULT_MODEL, load_model  # noqa: E402
from prefixcache.model.machine import machine_info  # noqa: E402
from prefixcache.scheduler.feature_pass import FeatureSet, own_rows  # noqa: E402

BATCH = 16


def prompt_cache(model, prefix_ids: tuple[int, ...]):
    """transformers' cache of the prompt's prefix ``[1, P]``, computed once."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([prefix_ids]), use_cache=True).past_key_values  # transformers' cache


def batch_states(model, cache, prefix_len: int, rows: list[tuple[int, ...]], depth: int, label_firsts: list[int]):
    """For a batch of records' own tokens after the prefix: ``last`` ``[B, H]``, ``mean@depth`` ``[B, H]`` and the
    first-token label log-probs ``[B, L]`` (not normalized over labels)."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, S], right-padded
    mask = torch.zeros(len(rows), prefix_len + width, dtype=torch.long)  # [B, P + S]
    mask[:, :prefix_len] = 1
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, prefix_len : prefix_len + len(row)] = 1
    forked = copy.deepcopy(cache)
    forked.batch_repeat_interleave(len(rows))
    positions = torch.arange(prefix_len, prefix_len + width)[None, :].expand(len(rows), -1)  # [B, S]
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=forked,
                    use_cache=True, output_hidden_states=True)
    ends = torch.tensor([len(r) - 1 for r in rows])  # [B]
    picked = torch.arange(len(rows))
    own = (mask[:, prefix_len:].unsqueeze(-1)).float()  # [B, S, 1]
    inner = out.hidden_states[depth].float()  # [B, S, H]
    mean = (inner * own).sum(1) / own.sum(1)  # [B, H]
    last = out.hidden_states[-1][picked, ends].float()  # [B, H]
    logprobs = torch.log_softmax(out.logits[picked, ends].float(), dim=-1)[:, label_firsts]  # [B, L]
    return last, mean, logprobs


def features(loaded, task, rows: list[dict], label: str) -> tuple[FeatureSet, int]:
    """``last+mean@3/4`` features and first-token prompt scores of ``rows`` through transformers' own cache, and
    the prompt's prefix length in tokens."""
    own = own_rows(loaded, task, records(rows))
    prefix = own.prompt.prefix_ids
    cache = prompt_cache(loaded.model, prefix)
    layers = loaded.model.config.get_text_config(decoder=True).num_hidden_layers
    depth = int(0.75 * layers)
    firsts = [own.prompt.label_ids[label][0] for label in task.labels]
    parts = []
    for start in tqdm(range(0, len(own.rows), BATCH), desc=f"{label}: states", unit="batch"):
        parts.append(batch_states(loaded.model, cache, len(prefix), own.rows[start : start + BATCH], depth, firsts))
    last, mean, scores = (torch.cat(p).numpy() for p in zip(*parts))
    scores = scores - np.logaddexp.reduce(scores, axis=1, keepdims=True)  # over the labels
    return FeatureSet(own.ids, np.concatenate([last, mean], axis=1).astype(np.float32), scores.astype(np.float32),
                      tuple(task.labels), f"last+mean@{depth}", "", loaded.identity, dtype=str(loaded.dtype)), len(prefix)


def measure(spec: str, task_name: str, fit_rows: list[dict], scored_rows: list[dict], dtype: str) -> dict:
    """One model's row: prompt alone and a linear head, on the scored rows."""
    started = time.perf_counter()
    loaded = load_model(spec, dtype=dtype, decoder="transformers")
    if loaded.tokenizer.chat_template is None:
        loaded.tokenizer.chat_template = TURNS
    task = data_task(task_name)
    feature_set, prompt_tokens = features(loaded, task, fit_rows + scored_rows, loaded.identity)
    n_fit = len(fit_rows)
    y = gold_indices(feature_set, {r["id"]: r["label"] for r in fit_rows + scored_rows})
    fitted = fit_head(subset(feature_set, range(n_fit)), {r["id"]: r["label"] for r in fit_rows}, folds=5, seed=0)
    scored = np.arange(n_fit, len(y))
    head = split_log_probs(feature_set, y, np.arange(n_fit), scored, fitted.C)
    calibrated = fitted.calibration.apply(head)  # the temperature fitted out of fold on the fitted rows
    return {"model": loaded.identity, "layers": loaded.model.config.get_text_config(decoder=True).num_hidden_layers,
            "prompt_tokens": prompt_tokens, "temperature": fitted.calibration.temperature,
            "feature": feature_set.feature, "C": fitted.C, "seconds": time.perf_counter() - started,
            "prompt alone": figures(feature_set.prompt_logprobs[scored], y[scored]),
            "linear head": figures(head, y[scored]) | {"ece_calibrated": figures(calibrated, y[scored])["ece"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", choices=["banking77", "tickets"])
    parser.add_argument("--model", action="append", required=True, help="a second model (repeatable)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    split_args = argparse.Namespace(data=args.data, per_label=10, scored_per_label=4, seed=0)
    task_name = "tickets" if args.data == "tickets" else args.data
    fit_rows, scored_rows = split(split_args, data_task(task_name))
    document = json.loads(args.json.read_text()) if args.json.exists() else {"data": {}}
    runs = document["data"].setdefault(args.data, {"fit_rows": len(fit_rows), "scored_rows": len(scored_rows),
                                                   "scored_ids": ids_hash(scored_rows), "models": {}})
    if runs["scored_ids"] != ids_hash(scored_rows):
        raise SystemExit(f"{args.json}: its {args.data} rows are not this split's")
    started_at = commit()  # the commit checked out when the run started
    for spec in [DEFAULT_MODEL, *args.model]:
        row = measure(spec, task_name, fit_rows, scored_rows, args.dtype)
        document["machine"] = machine_info(args.dtype, args.threads)  # the latest run's; each row keeps its own
        row |= {"commit": started_at, "date": time.strftime("%Y-%m-%d"), "machine": document["machine"]}
        runs["models"][row["model"]] = row
        print(json.dumps({k: row[k] for k in ("model", "prompt alone", "linear head", "seconds")}))
        args.json.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
