"""Prefix tuning: the task's cached prefix fitted by gradient descent on labelled rows, with a linear head.

The trained object has the shape of the product's one object, a :class:`~prefixcache.cache.kv.PrefixKV`: every
layer's keys and values. It starts from the prompt's own prefix (or, with ``virtual_tokens``, from a shorter one:
the prompt's first token and its last ``K - 1``, encoded afresh) and is trained through the very pass that serves
it (:func:`~prefixcache.engine.rows.packed_last_states`: records' own tokens only, packed, over the shared
prefix); the model's weights stay frozen. Jointly with it a linear head over the final state at each record's last
token corrects the prompt's first-token label scores, exactly as a :class:`~prefixcache.engine.head.FittedHead`
on the prompt applies them:

    log_probs = log_softmax(first_token_logprobs(h) + h @ W.T + b)       h [B, H], W [L, H], b [L]

The head starts at zero over standardized states (a head started from a logistic regression on the untuned
prefix's states measured worse on banking77: docs/accuracy.md). The result *is* a fitted head that carries its prefix
(``FittedHead.prefix``), and every path that takes a head serves it unchanged. A stratified part of the rows (``holdout``) is never trained on: it picks the best
epoch (early stopping) and calibrates the confidence (a temperature, and the rows ``--target-accuracy`` reads).

The training itself is :func:`tune_body`, over any :class:`Body` that makes the states the head reads:
:class:`PrefixBody` (the prefix's keys and values) here; ``studies/lora_tuning.py`` trains LoRA adapters on the
model's weights the same way, scored and stopped exactly as the prefix is.

``prefixcache fit --tune prefix`` writes, by default, the tuned prefix with a head refitted on its states instead
of this joint head (:mod:`prefixcache.eval.tune_refit`). This module knows nothing about files, flags or printing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from ..cache.kv import PrefixKV
from ..engine.confidence import Calibration, confidence_and_correct, expected_calibration_error, fit_temperature
from ..engine.head import FittedHead, fold_standardization
from ..engine.head_file import FORMAT, library_versions, prefix_hash
from ..engine.rows import packed_last_states
from ..engine.scoring import LabelScorer
from ..errors import InputError
from ..model.load import LoadedModel
from .tune_config import TuneConfig

MIN_ERRORS = 5  # wrong held-out rows needed before a temperature is fitted (else the identity)


@dataclass(frozen=True)
class Epoch:
    """One epoch's figures: mean training loss, held-out accuracy and loss, wall seconds so far."""

    epoch: int
    train_loss: float
    heldout_accuracy: float
    heldout_loss: float
    seconds: float


@dataclass(frozen=True, eq=False)
class Tuned:
    """What :func:`tune_prefix` returns: the head (with its tuned prefix; ``manifest`` left to the caller),
    the epochs' figures, the untuned start's held-out accuracy, the calibration fitted on the held-out rows,
    and those rows' calibrated confidences and correctness."""

    head: FittedHead
    epochs: list[Epoch]
    best_epoch: int
    start_accuracy: float  # held-out accuracy where training starts: the untuned prefix's first-token scores
    calibration: Calibration
    heldout: np.ndarray  # [M] indices of the held-out rows
    confidence: np.ndarray  # [M] calibrated
    correct: np.ndarray  # [M]
    ece: tuple[float, float]  # held-out calibration error, (raw, calibrated)
    seconds: float = 0.0
    notes: dict = field(default_factory=dict)

    @property
    def heldout_accuracy(self) -> float:
        return float(self.correct.mean()) if len(self.correct) else float("nan")


class Body(Protocol):
    """What :func:`tune_body` trains beneath the joint head, and the pass the head reads.

    ``tensors``: the leaves the optimizer moves (at ``TuneConfig.lr``, float32); early stopping copies them and
    writes the best epoch's values back into them in place. ``states(rows)``: each row's final state at its last
    token ``[B, H]`` (records' own token ids, packed after the body's prefix), differentiable in ``tensors`` under
    grad mode. ``carried()``: that prefix as the head carries it (float32, detached, the tensors' current values).
    """

    tensors: list[torch.Tensor]

    def states(self, rows: Sequence[Sequence[int]]) -> torch.Tensor: ...

    def carried(self) -> PrefixKV: ...


class PrefixBody:
    """The prefix's keys and values as float32 leaves, read by the frozen model: the :class:`Body` that
    :func:`tune_prefix` trains. The model's weights are never written."""

    def __init__(self, loaded: LoadedModel, prefix: PrefixKV):
        leaves = lambda ts: [t.detach().float().clone().requires_grad_(True) for t in ts]  # noqa: E731
        self.model, self.dtype, self.token_ids = loaded.model, loaded.dtype, prefix.token_ids
        self.keys, self.values = leaves(prefix.keys), leaves(prefix.values)
        self.tensors = self.keys + self.values

    def prefix(self) -> PrefixKV:
        """The prefix in the model's dtype (differentiable casts of the leaves)."""
        dtype = self.dtype
        return PrefixKV(self.token_ids, tuple(k.to(dtype) for k in self.keys), tuple(v.to(dtype) for v in self.values))

    def states(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        return packed_last_states(self.model, self.prefix(), rows)  # [B, H]

    def carried(self) -> PrefixKV:
        return PrefixKV(self.token_ids, tuple(k.detach().float().cpu().contiguous() for k in self.keys),
                        tuple(v.detach().float().cpu().contiguous() for v in self.values))


def start_prefix(loaded: LoadedModel, prefix_ids: Sequence[int], virtual_tokens: int | None) -> PrefixKV:
    """The prefix training starts from: the prompt's own, or a ``virtual_tokens``-long one made of its first token
    (the attention sink every record leans on) and its last ``K - 1`` (the lead-in right before a record)."""
    ids = tuple(int(t) for t in prefix_ids)
    if virtual_tokens is not None and virtual_tokens < len(ids):
        ids = ids[:1] + ids[len(ids) - virtual_tokens + 1:]
    return PrefixKV.build(loaded.model, ids)


@dataclass(frozen=True)
class Hooks:
    """What a caller hears while tuning: ``on_batch(rows, loss)`` after each training batch, ``on_epoch(Epoch)``
    after each epoch."""

    on_batch: Callable[[int, float], None] | None = None
    on_epoch: Callable[[Epoch], None] | None = None


def tune_prefix(
    loaded: LoadedModel,
    scorer: LabelScorer,
    prefix_ids: Sequence[int],
    rows: Sequence[Sequence[int]],
    gold: np.ndarray,
    config: TuneConfig = TuneConfig(),
    hooks: Hooks = Hooks(),
) -> Tuned:
    """Tune the prefix of ``prefix_ids`` and a head on ``rows`` (each record's own token ids, as fed after the
    prompt's prefix) with ``gold [N]`` label indices into ``scorer.labels``.

    Deterministic for a seed on one machine and thread count. The model is only read.

    Raises:
        InputError: fewer than 4 rows (some must be held out).
    """
    started = time.perf_counter()
    body = PrefixBody(loaded, start_prefix(loaded, prefix_ids, config.virtual_tokens))
    return tune_body(scorer, body, rows, gold, config, hooks, started)


def tune_body(
    scorer: LabelScorer,
    body: Body,
    rows: Sequence[Sequence[int]],
    gold: np.ndarray,
    config: TuneConfig = TuneConfig(),
    hooks: Hooks = Hooks(),
    started: float | None = None,
) -> Tuned:
    """Train ``body`` (at ``config.lr``) and a joint head (at ``config.head_lr``, from zero) on ``rows`` with
    ``gold [N]`` label indices into ``scorer.labels``, holding out a stratified ``config.holdout`` share of the rows
    to pick the best epoch and fit the temperature on; ``body`` is left at the best epoch's values. ``started``
    (a ``time.perf_counter()`` reading, default now) is where ``Tuned.seconds`` and the epochs' seconds count from.

    Deterministic for a seed on one machine and thread count (the seed is set here, after ``body`` was made).

    Raises:
        InputError: fewer than 4 rows (some must be held out).
    """
    started = time.perf_counter() if started is None else started
    torch.manual_seed(config.seed)
    train, heldout = split_rows(gold, config.holdout, config.seed)
    trainer = _Trainer(scorer, body, rows, gold, config, _standardization(body, rows, train))
    start_accuracy = float((trainer.log_probs(heldout).argmax(1) == gold[heldout]).mean())
    epochs = _early_stopped(trainer, train, heldout, hooks, started)
    calibration, confidence, correct, ece = calibrate(trainer.log_probs(heldout), gold[heldout])
    best_epoch = max(range(len(epochs)), key=lambda i: (epochs[i].heldout_accuracy, -epochs[i].heldout_loss)) + 1
    return Tuned(trainer.head(), epochs, best_epoch, start_accuracy, calibration, heldout, confidence, correct, ece,
                 time.perf_counter() - started)


def _early_stopped(trainer: _Trainer, train: np.ndarray, heldout: np.ndarray, hooks: Hooks,
                   started: float) -> list[Epoch]:
    """Train epoch after epoch (at most ``config.epochs``; ``config.patience`` epochs without a better held-out
    (accuracy, -loss) stop it); leaves ``trainer`` at its best epoch's values and returns every epoch's figures."""
    config, gold = trainer.config, trainer.gold
    best, best_key, epochs, stale = trainer.snapshot(), (-1.0, 0.0), [], 0
    order = np.random.default_rng(config.seed)
    for epoch in range(1, config.epochs + 1):
        loss = trainer.train_epoch(order.permutation(train), hooks.on_batch)
        logprobs = trainer.log_probs(heldout)
        figures = Epoch(epoch, loss, float((logprobs.argmax(1) == gold[heldout]).mean()),
                        float(-logprobs[np.arange(len(heldout)), gold[heldout]].mean()), time.perf_counter() - started)
        epochs.append(figures)
        if hooks.on_epoch is not None:
            hooks.on_epoch(figures)
        if (figures.heldout_accuracy, -figures.heldout_loss) > best_key:
            best, best_key, stale = trainer.snapshot(), (figures.heldout_accuracy, -figures.heldout_loss), 0
        elif (stale := stale + 1) >= config.patience:
            break
    trainer.restore(best)
    return epochs


def split_rows(gold: np.ndarray, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices to train on and to hold out, stratified by label where every label has two rows or more.

    Raises:
        InputError: too few rows to hold any out, or to train on.
    """
    from sklearn.model_selection import train_test_split

    index = np.arange(len(gold))
    counts = np.bincount(gold)
    stratify = gold if counts[counts > 0].min() >= 2 and round(holdout * len(gold)) >= len(counts[counts > 0]) else None
    if len(gold) < 4:
        raise InputError(f"prefix tuning needs at least 4 labelled rows (some held out to stop and calibrate on), "
                         f"got {len(gold)}")
    train, heldout = train_test_split(index, test_size=holdout, random_state=seed, stratify=stratify)
    return np.sort(train), np.sort(heldout)


def calibrate(logprobs: np.ndarray, gold: np.ndarray) -> tuple[Calibration, np.ndarray, np.ndarray, tuple[float, float]]:
    """A temperature fitted on held-out ``logprobs [M, L]`` (the identity under :data:`MIN_ERRORS` wrong rows),
    those rows' calibrated confidences and correctness, and the (raw, calibrated) calibration error."""
    wrong = int((logprobs.argmax(1) != gold).sum())
    calibration = fit_temperature(logprobs, gold) if wrong >= MIN_ERRORS else Calibration(1.0, 0)
    raw = expected_calibration_error(*confidence_and_correct(logprobs, gold))
    confidence, correct = confidence_and_correct(calibration.apply(logprobs), gold)
    return calibration, confidence, correct, (raw, expected_calibration_error(confidence, correct))


def _standardization(body: Body, rows, train: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The training rows' final-state mean and scale ``[H]`` under ``body`` as it starts: what standardizes the
    states the head reads."""
    with torch.inference_mode():
        states = torch.cat([body.states([rows[i] for i in chunk]).float()
                            for chunk in np.array_split(train, max(1, len(train) // 32))])  # [N_train, H]
    return states.mean(0), states.std(0).clamp_min(1e-4)  # [H], [H]


class _Trainer:
    """The training state of one :func:`tune_body` call: the rows it reads, the body and the head it changes."""

    def __init__(self, scorer: LabelScorer, body: Body, rows, gold: np.ndarray, config: TuneConfig,
                 standardization: tuple[torch.Tensor, torch.Tensor]):
        self.scorer, self.body, self.rows, self.gold, self.config = scorer, body, rows, gold, config
        self.mean, self.scale = standardization
        labels, width = len(scorer.labels), self.mean.shape[0]
        self.weight = torch.zeros(labels, width, device=self.mean.device, requires_grad=True)  # [L, H]
        self.bias = torch.zeros(labels, device=self.mean.device, requires_grad=True)  # [L]
        self.optimizer = torch.optim.AdamW([{"params": list(body.tensors), "lr": config.lr},
                                            {"params": [self.weight, self.bias], "lr": config.head_lr}],
                                           weight_decay=0.0)

    def batch_log_probs(self, index: Sequence[int]) -> torch.Tensor:
        """The head's label log-probs ``[B, L]`` of the rows at ``index`` (differentiable under grad mode)."""
        hidden = self.body.states([self.rows[i] for i in index])  # [B, H]
        standard = (hidden.float() - self.mean) / self.scale  # [B, H]
        return torch.log_softmax(self.scorer.first_token(hidden) + standard @ self.weight.T + self.bias, dim=-1)

    def train_epoch(self, order: np.ndarray, on_batch) -> float:
        """One pass over the training rows in ``order``, in batches; returns the mean loss."""
        total, size = 0.0, self.config.batch_size
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            loss = torch.nn.functional.nll_loss(self.batch_log_probs(chunk), torch.as_tensor(self.gold[chunk], device=self.mean.device))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total += float(loss.detach()) * len(chunk)
            if on_batch is not None:
                on_batch(len(chunk), float(loss.detach()))
        return total / max(len(order), 1)

    def log_probs(self, index: np.ndarray) -> np.ndarray:
        """Label log-probs ``[len(index), L]`` of the rows at ``index``, without grad."""
        step = 2 * self.config.batch_size
        with torch.inference_mode():
            parts = [self.batch_log_probs(index[s : s + step]) for s in range(0, len(index), step)]
        return torch.cat(parts).float().cpu().numpy() if parts else np.zeros((0, len(self.scorer.labels)), np.float32)

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of everything training changes: the body's tensors, then the head's weight and bias."""
        return [t.detach().clone() for t in [*self.body.tensors, self.weight, self.bias]]

    def restore(self, snapshot: list[torch.Tensor]) -> None:
        """Write a :meth:`snapshot` back into the tensors it was taken from (in place)."""
        with torch.no_grad():
            for tensor, saved in zip([*self.body.tensors, self.weight, self.bias], snapshot, strict=True):
                tensor.copy_(saved)

    def head(self) -> FittedHead:
        """The parameters as a head on the prompt (prompt scale 1) over raw ``last`` states, with the body's prefix."""
        cpu = lambda t: t.detach().cpu().numpy()  # noqa: E731
        weight, bias = fold_standardization(cpu(self.weight), cpu(self.bias), cpu(self.mean), cpu(self.scale))
        return FittedHead(weight, bias, 1.0, tuple(self.scorer.labels), "last", {}, self.body.carried())


def tuned_manifest(tuned: Tuned, loaded: LoadedModel, own, config: TuneConfig, task: str) -> dict:
    """The head file's manifest for a tuned prefix (:mod:`~prefixcache.engine.head_file`): the model, the prompt it
    was tuned from, the labels, every training row's text hash (held-out rows included: ``eval`` refuses them all),
    ``cv`` (the held-out figures), the held-out calibration and rows, and ``tuned`` (how and how well)."""
    head = tuned.head
    return {
        "format": FORMAT, "model": loaded.identity, "dtype": str(loaded.dtype).removeprefix("torch."),
        "prefix_sha256": prefix_hash(own.prompt), "labels": list(head.labels), "task": task,
        "training": {"rows": len(own.ids), "text_sha256": sorted(set(own.text_hashes))},
        "versions": library_versions(), **head_manifest(tuned),
        "tuned": {"prefix_tokens": head.prefix.length, "prompt_tokens": len(own.prompt.prefix_ids),
                  "epochs": [vars(e) for e in tuned.epochs], "best_epoch": tuned.best_epoch,
                  "lr": config.lr, "head_lr": config.head_lr, "batch_size": config.batch_size, "holdout": config.holdout,
                  "seed": config.seed, "seconds": round(tuned.seconds, 1), "heldout_accuracy": tuned.heldout_accuracy,
                  "start_heldout_accuracy": tuned.start_accuracy, "head": "joint"},
    }


def head_manifest(tuned: Tuned) -> dict:
    """The manifest entries that describe ``tuned``'s head: what it reads (``feature``, ``prompt_scale``), its
    held-out figures (``cv``), the temperature fitted on the held-out rows and those rows (``calibration``, ``oof``:
    what ``--target-accuracy`` reads)."""
    figures = {"accuracy": tuned.heldout_accuracy, "heldout_rows": len(tuned.correct), "folds": 0,
               "start_accuracy": tuned.start_accuracy, "ece_raw": tuned.ece[0], "ece_calibrated": tuned.ece[1]}
    return {"feature": tuned.head.feature, "prompt_scale": tuned.head.prompt_scale, "cv": figures,
            "calibration": tuned.calibration.to_json(),
            "oof": {"confidence": [round(float(c), 5) for c in tuned.confidence],
                    "correct": [int(k) for k in tuned.correct]}}
