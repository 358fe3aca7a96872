"""Build a :class:`~prefixcache.model.lean.decoder.LeanForCausalLM` from a model folder: ``config.json`` read as
plain JSON, weights read straight from safetensors (one ``model.safetensors`` or the shards a
``model.safetensors.index.json`` lists), the converted copy of an embedded ``.gguf`` or a Hugging Face folder.

The module is built on the ``meta`` device and the tensors are assigned to it, so no random initialisation
is ever paid for. A tied output head may be stored under either name (the embeddings' or the head's). The
checkpoint's q/k/v and gate/up projections are stacked into the decoder's fused ones as they load
(:data:`~prefixcache.model.lean.layers.FUSED`); every other tensor loads by its own name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import LeanConfig, lean_reason
from .decoder import LeanForCausalLM
from .layers import FUSED

HEAD, EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed from the config, never read


def read_config(folder: str | Path) -> dict:
    """The folder's ``config.json`` as a dict."""
    return json.loads((Path(folder) / "config.json").read_text())


def folder_reason(folder: str | Path) -> str | None:
    """Why the lean decoder cannot serve the model in ``folder`` (None: it can)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return "no config.json"
    if not _weight_files(folder):
        return "no safetensors weights"
    return lean_reason(read_config(folder))


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in shards]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def read_tensors(folder: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every stored tensor of ``folder``'s safetensors files, cast to ``dtype`` (float tensors only)."""
    tensors = {}
    for path in _weight_files(Path(folder)):
        with safe_open(str(path), framework="pt", device="cpu") as file:
            for name in file.keys():
                if not name.endswith(IGNORED_SUFFIXES):
                    tensor = file.get_tensor(name)
                    tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return tensors


def _generation_eos(folder: Path):
    path = folder / "generation_config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("eos_token_id")


def build_lean(config: LeanConfig, tensors: dict[str, torch.Tensor], eos_token_id=None) -> LeanForCausalLM:
    """A lean model of ``config`` holding ``tensors`` (named as in the Llama family's checkpoints).

    Raises:
        ValueError: a tensor is missing, left over, or of the wrong shape.
    """
    tensors = dict(tensors)
    if config.tie_word_embeddings:
        shared = tensors.pop(HEAD, None)
        tensors.setdefault(EMBEDDINGS, shared)
        if tensors[EMBEDDINGS] is None:
            raise ValueError(f"the weights hold neither {EMBEDDINGS} nor {HEAD}")
    with torch.device("meta"):
        model = LeanForCausalLM(config, eos_token_id)
    expected = {part for name in model.state_dict() for part in checkpoint_names(name)}
    expected -= {HEAD} if config.tie_word_embeddings else set()
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise ValueError(f"the weights do not fit the config: missing {missing[:5]}, unexpected {extra[:5]}")
    try:
        model.load_state_dict(fuse_projections(tensors, model.state_dict()), strict=False, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"the weights do not fit the config: {exc}") from None
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    model.requires_grad_(False)
    return model


def _fused_of(name: str) -> str | None:
    """The fused projection (a key of FUSED) the lean model's parameter ``name`` belongs to, or None."""
    return next((fused for fused in FUSED if f".{fused}." in name), None)


def checkpoint_names(name: str) -> list[str]:
    """The checkpoint tensors behind the lean model's parameter ``name``: several for a fused projection
    (``model.layers.0.self_attn.qkv_proj.weight`` -> its ``q_proj``, ``k_proj``, ``v_proj`` weights), else itself."""
    fused = _fused_of(name)
    return [name] if fused is None else [name.replace(f".{fused}.", f".{part}.") for part in FUSED[fused]]


def fuse_projections(tensors: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """``tensors`` named as in the checkpoint, with each fused projection's parts stacked along the output dim
    (dim 0) under the fused name; ``names`` are the lean model's parameter names. The parts are not kept."""
    fused = {}
    for name in names:
        parts = checkpoint_names(name)
        if len(parts) > 1 and all(part in tensors for part in parts):
            fused[name] = torch.cat([tensors[part] for part in parts], dim=0)  # [sum of N_i, K] or [sum of N_i]
    used = {part for name in fused for part in checkpoint_names(name)}
    return {**{k: v for k, v in tensors.items() if k not in used}, **fused}


def checkpoint_tensors(model: LeanForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors named and shaped as in a Hugging Face checkpoint of its family (the fused projections
    split back into their parts; a tied head stored once, as the embeddings), ready for ``safetensors``."""
    config, tensors = model.config, {}
    attention = (config.num_attention_heads * config.head_dim, *(2 * (config.num_key_value_heads * config.head_dim,)))
    sizes = {"self_attn.qkv_proj": attention, "mlp.gate_up_proj": (config.intermediate_size,) * 2}
    for name, tensor in model.state_dict().items():
        fused = _fused_of(name)
        pieces = (tensor,) if fused is None else tensor.split(sizes[fused], dim=0)
        tensors.update((part, piece.contiguous()) for part, piece in zip(checkpoint_names(name), pieces))
    if config.tie_word_embeddings:
        tensors.pop(HEAD, None)
    return tensors


def load_lean(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LeanForCausalLM:
    """Load the model in ``folder`` into the lean decoder, at ``dtype`` on ``device``.

    Raises:
        ValueError: the lean decoder does not cover the model (the message names why), or the weights do not fit.
    """
    folder = Path(folder)
    reason = folder_reason(folder)
    if reason is not None:
        raise ValueError(f"the lean decoder does not cover {folder}: {reason}")
    config = LeanConfig.of(read_config(folder))
    model = build_lean(config, read_tensors(folder, dtype), _generation_eos(folder))
    return model.to(device)
