"""FittedHead: a linear label head fitted on labelled rows, applied to a record's features.

Its logits are ``prompt_scale * prompt_logprobs + features @ weight.T + bias``, normalized over the
label set. ``prompt_scale`` is 0 for a head fitted from scratch; for a head fitted *on the prompt*
it is the fitted weight of the prompt's own label log-probs, which the linear part then corrects.
Standardization of the features is already folded into ``weight`` and ``bias`` (see
:func:`fold_standardization`), so applying a head is one ``[B, F] x [F, L]`` product.

A head may carry a *tuned prefix* (``prefix``): the task prompt's keys and values, fitted by gradient descent
with the head (:mod:`prefixcache.eval.tune_prefix`). Records then follow that prefix instead of the prompt's
own; everything else about applying the head is the same.

This module knows nothing about files, fitting or records: see :mod:`prefixcache.engine.head_file`
(save, load, check) and :mod:`prefixcache.eval.fit_head` (the fit).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..cache.kv import PrefixKV
from .features import FeatureSpec, packed_features
from .scoring import LabelScorer


@dataclass(frozen=True, eq=False)
class FittedHead:
    """A fitted linear head over ``labels`` (in this order) reading features of spec ``feature``.

    Attributes:
        weight: ``[L, F]`` float32.
        bias: ``[L]`` float32.
        prompt_scale: the weight of the prompt's label log-probs in the logits (0: a head from scratch).
        manifest: the head file's manifest when the head was loaded or fitted (model, prompt, training rows).
        prefix: the tuned prefix records follow (float32, batch 1), or None: they follow the prompt's own.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    prompt_scale: float
    labels: tuple[str, ...]
    feature: str
    manifest: dict = field(default_factory=dict)
    prefix: PrefixKV | None = None

    def __post_init__(self):
        if self.weight.ndim != 2 or self.weight.shape[0] != len(self.labels) or self.bias.shape != (len(self.labels),):
            raise ValueError(
                f"a head over {len(self.labels)} labels needs weight [L, F] and bias [L], "
                f"got {tuple(self.weight.shape)} and {tuple(self.bias.shape)}"
            )

    @property
    def width(self) -> int:
        """Features per row the head reads (F)."""
        return int(self.weight.shape[1])

    @property
    def spec(self) -> FeatureSpec:
        return FeatureSpec.parse(self.feature)

    def digest(self) -> str:
        """A hash of what the head computes (weights, bias, labels, feature, prompt scale, tuned prefix), 16 hex
        digits. Computed once (a head is never changed after it is made)."""
        if "_digest" not in self.__dict__:
            content = hashlib.sha256()
            for tensor in (self.weight, self.bias):
                content.update(tensor.detach().float().contiguous().cpu().numpy().tobytes())
            content.update(json.dumps([list(self.labels), self.feature, self.prompt_scale]).encode())
            if self.prefix is not None:
                content.update(self.prefix.checksum().encode())
            self.__dict__["_digest"] = content.hexdigest()[:16]  # a frozen dataclass's own cache
        return self.__dict__["_digest"]

    @property
    def tuned(self) -> bool:
        """Whether records follow a tuned prefix carried by the head."""
        return self.prefix is not None

    @property
    def on_prompt(self) -> bool:
        return self.prompt_scale != 0.0

    def log_probs(self, features, prompt_logprobs=None) -> torch.Tensor:
        """Label-set log-softmax of the head's logits. ``features [B, F]``, ``prompt_logprobs [B, L]`` -> ``[B, L]``.

        ``prompt_logprobs`` may be None only for a head from scratch. Arrays or tensors; float32 result.
        """
        x = torch.as_tensor(features).float()  # [B, F]
        logits = x @ self.weight.T + self.bias  # [B, L]
        if self.on_prompt:
            if prompt_logprobs is None:
                raise ValueError("a head fitted on the prompt needs the prompt's label log-probs")
            logits = logits + self.prompt_scale * torch.as_tensor(prompt_logprobs).float()
        return torch.log_softmax(logits, dim=-1)

    def predict(self, features, prompt_logprobs=None) -> list[str]:
        """The best label per row."""
        return [self.labels[i] for i in self.log_probs(features, prompt_logprobs).argmax(dim=-1).tolist()]


def fold_standardization(
    coef: np.ndarray, intercept: np.ndarray, mean: np.ndarray, scale: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights over raw features from weights over standardized ones.

    ``z = (x - mean) / scale``; ``z @ coef.T + intercept == x @ W.T + b`` with ``W = coef / scale`` and
    ``b = intercept - W @ mean``. ``coef [L, F]``, ``intercept [L]``, ``mean, scale [F]`` -> ``W [L, F]``, ``b [L]``
    (float32; the arithmetic is done in float64).
    """
    weight = np.asarray(coef, np.float64) / np.asarray(scale, np.float64)[None, :]
    bias = np.asarray(intercept, np.float64) - weight @ np.asarray(mean, np.float64)
    return torch.from_numpy(weight.astype(np.float32)), torch.from_numpy(bias.astype(np.float32))


@torch.inference_mode()
def head_rows(
    model: torch.nn.Module,
    prefix: PrefixKV,
    rows: Sequence[Sequence[int]],
    own_starts: Sequence[int],
    head: FittedHead,
    label_rows: LabelScorer,
) -> torch.Tensor:
    """Score rows after ``prefix`` through a fitted head: one packed pass, then one ``[B, F] x [F, L]`` product
    (plus the prompt's ``[B, H] x [H, L]`` label rows for a head on the prompt). Returns log-probs ``[B, L]``.

    No label continuation is ever run, whatever the labels' tokens. ``own_starts``: see
    :func:`~prefixcache.engine.features.packed_features`.
    """
    states = packed_features(model, prefix, rows, own_starts, head.spec)
    prompt = label_rows.first_token(states.last) if head.on_prompt else None  # [B, L]
    return head.log_probs(states.features, prompt)
