"""Which decoder serves a model: the lean one (:mod:`prefixcache.model.lean`) where it covers the architecture,
transformers elsewhere, as ``decoder=`` or ``$PREFIXCACHE_DECODER`` (``auto`` | ``lean`` | ``transformers``) asks.

Nothing here imports transformers: a folder's ``config.json`` is read as plain JSON.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..errors import ModelNotFoundError
from .lean.config import LeanConfig
from .lean.weights import build_lean, folder_reason

log = logging.getLogger(__name__)

DECODERS = ("auto", "lean", "transformers")  # auto: lean where it covers the architecture
DECODER_ENV = "PREFIXCACHE_DECODER"


def choose_decoder(source: str, decoder: str | None = None) -> str:
    """``"lean"`` or ``"transformers"`` for the model at ``source`` (a folder or a Hugging Face id), as ``decoder``
    (or ``$PREFIXCACHE_DECODER``, default ``auto``) asks.

    Raises:
        ModelNotFoundError: an unknown ``decoder``, or ``lean`` for a model the lean decoder does not cover.
    """
    wanted = decoder or os.environ.get(DECODER_ENV) or "auto"
    if wanted not in DECODERS:
        raise ModelNotFoundError(f"decoder must be one of {', '.join(DECODERS)} (decoder= or ${DECODER_ENV}), not {wanted!r}")
    if wanted == "transformers":
        return wanted
    folder = model_folder(source)
    reason = folder_reason(folder) if folder is not None else "the model is not in a local folder"
    if reason is not None and wanted == "lean":
        raise ModelNotFoundError(f"the lean decoder does not cover {source}: {reason}; use the transformers decoder")
    if reason is not None:
        log.info("the lean decoder does not cover %s (%s): using transformers", source, reason)
    return "transformers" if reason is not None else "lean"


def model_folder(source: str) -> Path | None:
    """The local folder holding ``source``: itself, or a Hugging Face id's cached snapshot (None if not cached)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(source, "config.json")
    return Path(cached).parent if isinstance(cached, str) else None


def as_lean(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers ``model``'s weights in the lean decoder (shared, not copied, except the fused q/k/v and
    gate/up projections, which are stacked copies).

    Raises:
        ValueError: the lean decoder does not cover its architecture (the message says why).
    """
    config = LeanConfig.of(model.config.to_dict())
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    lean = build_lean(config, dict(model.state_dict()), eos)
    return lean.to(next(model.parameters()).device)
