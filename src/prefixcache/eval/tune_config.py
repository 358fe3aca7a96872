"""How ``fit --tune prefix`` tunes a prefix (:class:`TuneConfig`); torch-free, so the CLI reads its defaults at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..types import DEFAULT_FEATURE

TUNE_CHOICES = ("head", "prefix")  # what `fit --tune` fits


@dataclass(frozen=True)
class TuneConfig:
    """How a prefix is tuned. ``virtual_tokens``: the tuned prefix's length (None: the prompt's whole prefix)."""

    epochs: int = 4
    lr: float = 3e-3  # what is trained beneath the head: the prefix's keys and values (AdamW)
    head_lr: float = 1e-2  # the linear head, over standardized states
    batch_size: int = 16
    holdout: float = 0.2  # share of the rows kept out of training: early stopping and calibration
    seed: int = 0
    virtual_tokens: int | None = None
    patience: int = 2  # epochs without a better held-out accuracy before stopping

    def __post_init__(self):
        if self.epochs < 1 or self.batch_size < 1 or not 0.0 < self.holdout < 1.0 or self.patience < 1:
            raise InputError(f"prefix tuning needs epochs >= 1, batch size >= 1, 0 < holdout < 1, patience >= 1 ({self})")
        if self.virtual_tokens is not None and self.virtual_tokens < 2:
            raise InputError(f"a tuned prefix needs at least 2 virtual tokens, not {self.virtual_tokens}")


@dataclass(frozen=True)
class RefitConfig:
    """The head ``fit --tune prefix`` writes with its tuned prefix. ``enabled`` (the default): a head refitted on
    the tuned prefix's states by ``fit``'s own logistic fit, with ``fit``'s settings (``feature``, ``folds``,
    ``on_prompt``); measured better than the head trained jointly with the prefix (docs/accuracy.md, "A tuned
    prefix"). ``enabled=False``: the jointly trained head."""

    enabled: bool = True
    feature: str = DEFAULT_FEATURE
    folds: int = 5
    on_prompt: bool = False
    seed: int = 0  # the folds' (fit's --seed, as tuning's)
