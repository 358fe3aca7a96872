# LoRA on the model's weights for studies/tuning_study.py: the row docs/accuracy.md, "A tuned prefix", compares.
"""LoRA adapters on the model's weights, applied to the records' own tokens only, trained and scored as a tuned
prefix is.

The task prompt's prefix is computed once by the frozen model, before any adapter exists (the base model's keys and
values: what the prompt alone and a linear head read). Rank-8 LoRA adapters (``peft``) on every layer's ``q_proj``
and ``v_proj`` then act on the records' own tokens only: they change what a record's tokens compute over that
frozen prefix, never the prefix. So a record costs what it costs after the prompt: the same pass over the same
tokens. They are trained by the package's own tuning loop (:func:`~prefixcache.eval.tune_prefix.tune_body`): the
prompt's first-token label scores plus a joint linear head started at zero, AdamW, batches of 16, a stratified
fifth held out to pick the epoch and fit the temperature on. The only difference from the tuned prefix is what is
trained.

The lean decoder computes q, k and v in one fused matmul (``qkv_proj``), where ``peft`` can put one adapter over
all three but not one on q and one on v; so the adapters are trained on transformers' ``LlamaForCausalLM`` (the
package's fallback decoder, same weights). Once trained they are merged into the weights, and the merged model is
served by the lean decoder (:func:`~prefixcache.model.decoder_choice.as_lean`) through ``Classifier``, as the
other rows are.

The variant with adapters everywhere (the prompt's prefix recomputed through the adapted weights at every step) is
not built here: every training row would then carry the whole prompt.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, replace
from typing import Sequence

import numpy as np
import torch

from prefixcache.cache.kv import PrefixKV
from prefixcache.engine.head import FittedHead
from prefixcache.engine.rows import packed_last_states
from prefixcache.engine.scoring import LabelScorer
from prefixcache.eval.tune_config import TuneConfig
from prefixcache.eval.tune_prefix import Hooks, Tuned, tune_body, tuned_manifest
from prefixcache.model.decoder_choice import as_lean
from prefixcache.model.load import LoadedModel


@dataclass(frozen=True)
class LoraSettings:
    """The adapters: rank, scale ``alpha / rank``, which linear layers (by name, in every decoder layer), dropout."""

    rank: int = 8
    alpha: int = 16
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0


class LoraBody:
    """LoRA adapters as the :class:`~prefixcache.eval.tune_prefix.Body` that tuning trains: ``tensors`` are the
    adapters' A and B matrices (B starts at zero, so training starts from the base model exactly); ``states`` runs
    the records' own tokens through the adapted model, packed after the base prefix; ``carried`` is that base prefix.

    Construction changes ``loaded.model`` in place (the adapters are injected into it) and draws the adapters' A
    from torch's generator; the base weights are never written until :meth:`merge`.
    """

    def __init__(self, loaded: LoadedModel, prefix_ids: Sequence[int], settings: LoraSettings = LoraSettings()):
        from peft import LoraConfig, LoraModel

        built = PrefixKV.build(loaded.model, tuple(int(t) for t in prefix_ids))  # before any adapter exists
        self.prefix = PrefixKV(built.token_ids, tuple(k.clone() for k in built.keys),
                               tuple(v.clone() for v in built.values))  # outside inference mode: autograd reads them
        config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=list(settings.targets),
                            lora_dropout=settings.dropout, bias="none")
        self.lora = LoraModel(loaded.model, config, "default")
        self.model = self.lora.model
        self.tensors = [p for name, p in self.model.named_parameters() if "lora_" in name]
        for tensor in self.tensors:
            tensor.requires_grad_(True)

    def states(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        return packed_last_states(self.model, self.prefix, rows)  # [B, H]

    def carried(self) -> PrefixKV:
        return PrefixKV(self.prefix.token_ids, tuple(k.detach().float().cpu().contiguous() for k in self.prefix.keys),
                        tuple(v.detach().float().cpu().contiguous() for v in self.prefix.values))

    def digest(self) -> str:
        """The adapters' values, hashed (16 hex digits): what tells the adapted model's identity from the base's."""
        sha = hashlib.sha256()
        for tensor in self.tensors:
            sha.update(tensor.detach().float().cpu().numpy().tobytes())
        return sha.hexdigest()[:16]

    def merge(self) -> torch.nn.Module:
        """The model with the adapters merged into its weights and removed (training is over after this)."""
        return self.lora.merge_and_unload()


@dataclass(frozen=True, eq=False)
class TunedLora:
    """A LoRA tuning's result: the tuning (its head carries the base prefix), and the adapted model as served (the
    lean decoder over the merged weights, its identity the base's plus the adapters' digest) with the head's
    manifest filled in for it."""

    tuned: Tuned
    served: LoadedModel
    head: FittedHead


def tune_lora(
    loaded: LoadedModel,
    own,
    gold: np.ndarray,
    config: TuneConfig,
    settings: LoraSettings = LoraSettings(),
    hooks: Hooks = Hooks(),
    task_name: str = "",
) -> TunedLora:
    """Train LoRA adapters and a joint head on ``own.rows`` (the records' own token ids after ``own.prompt``'s
    prefix, as ``feature_pass.own_rows`` gives them) with ``gold [N]`` label indices, as ``tune_prefix`` trains a
    prefix (``config``: its epochs, learning rates, batch size, held-out share and seed; ``virtual_tokens`` unused).

    ``loaded`` must be a transformers model (``decoder="transformers"``): its ``q_proj``/``v_proj`` take the
    adapters, which are merged into its weights at the end (``loaded.model`` is changed in place). ``Tuned.seconds``
    counts the base prefix, the adapters and the training.
    """
    started = time.perf_counter()
    torch.manual_seed(config.seed)  # the adapters' A
    body = LoraBody(loaded, own.prompt.prefix_ids, settings)
    scorer = LabelScorer(loaded.model, own.prompt, "first-token")
    tuned = tune_body(scorer, body, own.rows, gold, config, hooks, started)
    digest = body.digest()
    lean = as_lean(body.merge()).eval().requires_grad_(False)
    served = replace(loaded, model=lean, identity=f"{loaded.identity}+lora:{digest}")
    manifest = tuned_manifest(tuned, served, own, config, task_name)
    manifest["tuned"].update(body="lora", lora=asdict(settings), trained_on="transformers", served_on="lean, merged")
    tuned.head.manifest.update(manifest)
    return TunedLora(tuned, served, tuned.head)
