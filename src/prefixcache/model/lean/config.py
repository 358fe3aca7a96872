"""The lean decoder's configuration, read from a model folder's ``config.json`` as plain JSON.

Covered: ``llama`` (SmolLM2, Llama 3 with ``llama3`` RoPE scaling), ``qwen2`` (q/k/v bias), ``qwen3`` (q/k
RMSNorm), ``mistral`` (without a sliding window) and ``granite`` (its four multipliers). Every layer is full
attention with a SiLU-gated MLP. :func:`lean_reason` names what keeps any other config out; transformers then
serves that model.

:class:`LeanConfig` answers the attributes the rest of the package reads from a model's config
(``get_text_config``, ``num_hidden_layers``, ``hidden_size``, ``head_dim`` ...), so the engine reads a lean
model as it reads a transformers one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "granite")
ROPE_TYPES = ("default", "llama3")


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a raw config, in transformers 5's ``rope_parameters`` form or the older
    ``rope_theta`` + ``rope_scaling`` form. Always holds ``rope_type`` and ``rope_theta``."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def lean_reason(raw: dict[str, Any]) -> str | None:
    """Why the lean decoder does not cover the config ``raw`` (a parsed ``config.json``), or None if it does."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        return f"model type {model_type!r} is not one of {', '.join(FAMILIES)}"
    if raw.get("hidden_act", "silu") != "silu":
        return f"activation {raw['hidden_act']!r} (the lean MLP is SiLU-gated)"
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) or raw.get("use_sliding_window"):
        return "sliding-window layers"
    if model_type == "mistral" and raw.get("sliding_window") is not None:
        return "a sliding window"
    rope = rope_parameters(raw)
    if rope["rope_type"] not in ROPE_TYPES:
        return f"RoPE type {rope['rope_type']!r}"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    if raw.get("pretraining_tp", 1) != 1:
        return "tensor-parallel pretraining slices (pretraining_tp)"
    return None


@dataclass
class LeanConfig:
    """What the lean decoder needs from ``config.json`` (see :func:`LeanConfig.of`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections (Qwen2: always)
    output_bias: bool  # o projection
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    embedding_multiplier: float = 1.0  # Granite's four multipliers; 1.0 elsewhere
    attention_multiplier: float | None = None  # the attention's scale (None: head_dim ** -0.5)
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    eos_token_id: int | list[int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, raw: dict[str, Any]) -> LeanConfig:
        """Read a parsed ``config.json``. Raises ValueError naming the reason when it is not covered."""
        reason = lean_reason(raw)
        if reason is not None:
            raise ValueError(f"the lean decoder does not cover this model: {reason}")
        kind = raw["model_type"]
        heads = raw["num_attention_heads"]
        bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=kind,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=rope_parameters(raw),
            max_position_embeddings=raw.get("max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=kind == "qwen2" or bias,
            output_bias=kind != "qwen2" and bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=kind == "qwen3",
            embedding_multiplier=raw.get("embedding_multiplier", 1.0) if kind == "granite" else 1.0,
            attention_multiplier=raw.get("attention_multiplier") if kind == "granite" else None,
            residual_multiplier=raw.get("residual_multiplier", 1.0) if kind == "granite" else 1.0,
            logits_scaling=raw.get("logits_scaling", 1.0) if kind == "granite" else 1.0,
            eos_token_id=raw.get("eos_token_id"),
            raw=raw,
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` this config was read from (a copy)."""
        return dict(self.raw)

    def get_text_config(self, decoder: bool = True) -> LeanConfig:
        """The decoder's config: this one (the transformers spelling, so callers need not tell models apart)."""
        return self

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention"] * self.num_hidden_layers
