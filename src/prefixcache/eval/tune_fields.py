"""Prefix tuning for an extraction task: the extraction prompt's cached prefix fitted by gradient descent on the gold
answers' token log-likelihood under teacher forcing.

Each training row is the record's own tokens (as fed after the prompt's prefix) followed by its gold answer in the
task's answer format (:func:`~prefixcache.task.answer.answer_json`: the tokens greedy constrained generation emits
right after the record's suffix, then the end-of-turn token generation stops at). The rows run packed over the
prefix being tuned (:func:`~prefixcache.engine.rows.packed_states_at`, the pass that serves it), the model's output
head turns the state at each answer position into the next token's logits, and the loss is the mean negative
log-likelihood of the answer's tokens. The model's weights stay frozen; only the prefix's keys and values (float32
leaves, every layer) move. A part of the rows (``holdout``) is never trained on: it picks the epoch kept (lowest
held-out loss: early stopping) and gives the held-out token accuracy.

The result is a :class:`~prefixcache.engine.head.FittedHead` with no labels that carries the tuned prefix
(``FittedHead.prefix``): an ``Extractor`` whose ``tuned`` is set from it generates after that prefix.

This module knows nothing about files, flags or printing: see ``prefixcache fit --task T --tune prefix``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from ..cache.kv import PrefixKV
from ..engine.head import FittedHead
from ..engine.head_file import FORMAT, library_versions, prefix_hash
from ..engine.rows import packed_states_at
from ..model.load import LoadedModel
from ..task.answer import answer_json
from ..task.definition import ExtractTask
from .tune_config import TuneConfig
from .tune_prefix import Epoch, Hooks, split_rows, start_prefix


def end_of_answer(tokenizer, eos_ids: Sequence[int]) -> int:
    """The token generation stops an answer at: the tokenizer's end-of-sequence (a chat model's end of turn) when it
    is one of ``eos_ids``, else the lowest of them."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return int(eos) if eos is not None and eos in eos_ids else int(min(eos_ids))


def answer_tokens(tokenizer, task: ExtractTask, values: Mapping[str, object], end: int) -> tuple[int, ...]:
    """The gold answer's tokens: ``values`` written in the task's answer format, then ``end``."""
    return (*tokenizer.encode(answer_json(task, values), add_special_tokens=False), int(end))


def gold_values(task: ExtractTask, records: Sequence, fallback: Sequence[Mapping] | None = None) -> list[dict]:
    """Each record's answer: a field whose column some record carries takes the record's value there (null where the
    record has none, or an empty one); a field no record carries takes ``fallback[i]``'s value (the untuned prompt's
    own answer, so tuning keeps it), else null."""
    carried = {name for name in task.fields if any(name in r.fields for r in records)}
    answers = []
    for i, record in enumerate(records):
        values = {}
        for name in task.fields:
            value = record.fields.get(name) if name in carried else (fallback[i].get(name) if fallback else None)
            values[name] = None if value == "" else value
        answers.append(values)
    return answers


@dataclass(frozen=True)
class Taught:
    """Rows as teacher forcing feeds them: the record's own tokens then its answer but the last token (``fed``), the
    positions whose states predict the answer's tokens (``at``) and those tokens (``targets``)."""

    fed: list[tuple[int, ...]]
    at: list[range]
    targets: list[tuple[int, ...]]

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> Taught:
        fed = [tuple(row) + tuple(answer[:-1]) for row, answer in zip(rows, answers)]
        at = [range(len(row) - 1, len(row) - 1 + len(answer)) for row, answer in zip(rows, answers)]
        return cls(fed, at, [tuple(a) for a in answers])


@dataclass(frozen=True, eq=False)
class TunedFields:
    """What :func:`tune_fields` returns: the head (no labels; its tuned prefix; ``manifest`` left to the caller), the
    epochs' figures (``heldout_accuracy``: the held-out answers' token accuracy), the untuned prompt's held-out loss
    and token accuracy, the held-out row indices and the wall seconds."""

    head: FittedHead
    epochs: list[Epoch]
    best_epoch: int
    start_loss: float
    start_accuracy: float
    heldout: np.ndarray
    seconds: float

    @property
    def best(self) -> Epoch:
        return self.epochs[self.best_epoch - 1]


def tune_fields(
    loaded: LoadedModel,
    prefix_ids: Sequence[int],
    rows: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    config: TuneConfig = TuneConfig(),
    hooks: Hooks = Hooks(),
) -> TunedFields:
    """Tune the prefix of ``prefix_ids`` on ``rows`` (each record's own token ids, as fed after the prompt's prefix)
    and their gold ``answers`` (:func:`answer_tokens`). Deterministic for a seed on one machine and thread count.

    Raises:
        InputError: fewer than 4 rows (some must be held out).
    """
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    train, heldout = split_rows(np.zeros(len(rows), dtype=np.int64), config.holdout, config.seed)
    trainer = _Trainer(loaded, Taught.of(rows, answers), config, start_prefix(loaded, prefix_ids, config.virtual_tokens))
    start_loss, start_accuracy = trainer.evaluate(heldout)
    best, best_loss, epochs, stale = trainer.snapshot(), float("inf"), [], 0
    order = np.random.default_rng(config.seed)
    for epoch in range(1, config.epochs + 1):
        loss = trainer.train_epoch(order.permutation(train), hooks.on_batch)
        heldout_loss, accuracy = trainer.evaluate(heldout)
        figures = Epoch(epoch, loss, accuracy, heldout_loss, time.perf_counter() - started)
        epochs.append(figures)
        if hooks.on_epoch is not None:
            hooks.on_epoch(figures)
        if heldout_loss < best_loss:
            best, best_loss, stale = trainer.snapshot(), heldout_loss, 0
        elif (stale := stale + 1) >= config.patience:
            break
    best_epoch = min(range(len(epochs)), key=lambda i: epochs[i].heldout_loss) + 1
    return TunedFields(_head(loaded, best), epochs, best_epoch, start_loss, start_accuracy, heldout,
                       time.perf_counter() - started)


def _head(loaded: LoadedModel, prefix: PrefixKV) -> FittedHead:
    """A head with no labels (weight ``[0, H]``, bias ``[0]``) that carries the tuned prefix (float32)."""
    hidden = loaded.model.config.get_text_config(decoder=True).hidden_size
    return FittedHead(torch.zeros(0, hidden), torch.zeros(0), 0.0, (), "last", {}, prefix)


class _Trainer:
    """The training state of one :func:`tune_fields` call: the frozen model, the taught rows, the prefix's leaves."""

    def __init__(self, loaded: LoadedModel, taught: Taught, config: TuneConfig, prefix: PrefixKV):
        self.loaded, self.taught, self.config = loaded, taught, config
        self.token_ids = prefix.token_ids
        leaves = lambda ts: [t.detach().float().clone().requires_grad_(True) for t in ts]  # noqa: E731
        self.keys, self.values = leaves(prefix.keys), leaves(prefix.values)
        self.optimizer = torch.optim.AdamW(self.keys + self.values, lr=config.lr, weight_decay=0.0)
        self.output = loaded.model.get_output_embeddings()
        self.softcap = getattr(loaded.model.config.get_text_config(decoder=True), "final_logit_softcapping", None)

    def batch(self, index: Sequence[int]) -> tuple[torch.Tensor, int, int]:
        """The summed negative log-likelihood of the answers at ``index`` (differentiable under grad mode), their
        token count and how many of them the model's argmax gets right."""
        dtype = self.loaded.dtype
        prefix = PrefixKV(self.token_ids, tuple(k.to(dtype) for k in self.keys), tuple(v.to(dtype) for v in self.values))
        taught = self.taught
        states = packed_states_at(self.loaded.model, prefix, [taught.fed[i] for i in index], [taught.at[i] for i in index])
        logits = self.output(states).float()  # [M, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        targets = torch.tensor([t for i in index for t in taught.targets[i]], device=logits.device)  # [M]
        nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
        return nll, len(targets), int((logits.argmax(1) == targets).sum())

    def train_epoch(self, order: np.ndarray, on_batch) -> float:
        """One pass over the training rows in ``order``, in batches; returns the mean loss per answer token."""
        total, tokens, size = 0.0, 0, self.config.batch_size
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            nll, count, _ = self.batch(chunk)
            loss = nll / count
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total, tokens = total + float(nll.detach()), tokens + count
            if on_batch is not None:
                on_batch(len(chunk), float(loss.detach()))
        return total / max(tokens, 1)

    def evaluate(self, index: np.ndarray) -> tuple[float, float]:
        """Mean loss per answer token and token accuracy of the rows at ``index``, without grad."""
        total, tokens, right, step = 0.0, 0, 0, 2 * self.config.batch_size
        with torch.inference_mode():
            for start in range(0, len(index), step):
                nll, count, correct = self.batch(index[start : start + step])
                total, tokens, right = total + float(nll), tokens + count, right + correct
        return total / max(tokens, 1), right / max(tokens, 1)

    def snapshot(self) -> PrefixKV:
        """The prefix as it stands, float32, detached."""
        return PrefixKV(self.token_ids, tuple(k.detach().float().clone().contiguous() for k in self.keys),
                        tuple(v.detach().float().clone().contiguous() for v in self.values))


def fields_manifest(tuned: TunedFields, loaded: LoadedModel, own, config: TuneConfig, task: ExtractTask) -> dict:
    """The head file's manifest for an extraction task's tuned prefix (:mod:`~prefixcache.engine.head_file`): the
    model, the prompt it was tuned from, the task's field names (``fields``, which ``check_fields`` compares), every
    training row's text hash (held-out rows included), ``cv`` (the held-out figures) and ``tuned`` (how, how well)."""
    best = tuned.best
    figures = {"token_accuracy": best.heldout_accuracy, "loss": best.heldout_loss, "heldout_rows": len(tuned.heldout),
               "folds": 0, "prompt_token_accuracy": tuned.start_accuracy, "prompt_loss": tuned.start_loss}
    return {
        "format": FORMAT, "model": loaded.identity, "dtype": str(loaded.dtype).removeprefix("torch."),
        "prefix_sha256": prefix_hash(own.prompt), "feature": "last", "labels": [], "prompt_scale": 0.0,
        "task": task.name, "fields": list(task.fields),
        "training": {"rows": len(own.ids), "text_sha256": sorted(set(own.text_hashes))},
        "cv": figures, "versions": library_versions(),
        "tuned": {"objective": "answer tokens (teacher forcing)", "prefix_tokens": tuned.head.prefix.length,
                  "prompt_tokens": len(own.prompt.prefix_ids), "epochs": [vars(e) for e in tuned.epochs],
                  "best_epoch": tuned.best_epoch, "lr": config.lr, "batch_size": config.batch_size,
                  "holdout": config.holdout, "seed": config.seed, "seconds": round(tuned.seconds, 1),
                  "heldout_token_accuracy": best.heldout_accuracy, "heldout_loss": best.heldout_loss,
                  "untuned_heldout_token_accuracy": tuned.start_accuracy, "untuned_heldout_loss": tuned.start_loss},
    }
