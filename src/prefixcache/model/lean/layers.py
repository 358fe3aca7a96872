"""The layers of the lean decoder: RMSNorm, attention over the cache the engine hands in, the SiLU-gated MLP.

Parameter names match the Hugging Face checkpoints of the Llama family (``self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm`` ...), so a safetensors file loads by name with no renaming table.

Attention: the layer calls ``cache.update(k, v, layer_idx)`` as the transformers layers do. A fork of a
stored prefix answers with :class:`~prefixcache.attention.shared_prefix.SharedKV`, which goes straight to
:func:`~prefixcache.attention.shared_prefix.shared_prefix_attention`; any other cache (or none) answers plain
tensors, which go to torch's SDPA. The mask and the RoPE tables come in a :class:`PassState` built once per
forward pass (:mod:`prefixcache.model.lean.masks`), never per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...attention.shared_prefix import SharedKV, shared_prefix_attention
from .config import LeanConfig
from .rope import rotate


@dataclass(frozen=True)
class PassState:
    """What every layer of one forward pass shares.

    ``mask``: None (causal over the cache), or boolean ``[B|1, 1, T, K]`` (True = attend) over the cache's K
    keys after this pass's update.
    """

    cos: torch.Tensor  # [B, 1, T, head_dim]
    sin: torch.Tensor  # [B, 1, T, head_dim]
    mask: torch.Tensor | None


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and scaled in the input's dtype."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.float32)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with RoPE, optional q/k/v (and o) biases and optional q/k norms (Qwen3)."""

    def __init__(self, config: LeanConfig, layer_idx: int):
        super().__init__()
        width, heads, kv_heads, self.head_dim = (
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.layer_idx = layer_idx
        self.scale = config.attention_multiplier or self.head_dim**-0.5
        self.q_proj = nn.Linear(width, heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, width, bias=config.output_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, state: PassState, cache) -> torch.Tensor:
        """``x`` ``[B, T, H]`` -> ``[B, T, H]``; appends this pass's keys/values to ``cache`` (if any)."""
        batch, width, _ = x.shape
        q = self.q_proj(x).view(batch, width, -1, self.head_dim)  # [B, T, heads, d]
        k = self.k_proj(x).view(batch, width, -1, self.head_dim)  # [B, T, kv_heads, d]
        v = self.v_proj(x).view(batch, width, -1, self.head_dim).transpose(1, 2)  # [B, kv_heads, T, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotate(q.transpose(1, 2), state.cos, state.sin)  # [B, heads, T, d]
        k = rotate(k.transpose(1, 2), state.cos, state.sin)  # [B, kv_heads, T, d]
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if isinstance(k, SharedKV):
            out, _ = shared_prefix_attention(self, q, k, v, state.mask, scaling=self.scale)  # [B, T, heads, d]
        else:
            out = dense_attention(q, k, v, state.mask, self.scale).transpose(1, 2)  # [B, T, heads, d]
        return self.o_proj(out.reshape(batch, width, -1))


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """SDPA of ``q`` ``[B, h, T, d]`` over plain keys/values ``[B, kv, K, d]``; ``mask`` None means causal with
    the queries the last T of the K keys. Returns ``[B, h, T, d]``."""
    width, keys = q.shape[-2], k.shape[-2]
    causal = mask is None and width == keys and width > 1
    if mask is None and width != keys:
        queries = torch.arange(keys - width, keys, device=q.device)  # [T]: the queries' places among the keys
        mask = torch.arange(keys, device=q.device)[None, :] <= queries[:, None]  # [T, K]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LeanConfig):
        super().__init__()
        width, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(width, inner, bias=bias)
        self.up_proj = nn.Linear(width, inner, bias=bias)
        self.down_proj = nn.Linear(inner, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added to the residual (scaled by Granite's multiplier)."""

    def __init__(self, config: LeanConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, state: PassState, cache) -> torch.Tensor:
        update = self.self_attn(self.input_layernorm(x), state, cache)
        x = x + (update if self.residual_multiplier == 1.0 else update * self.residual_multiplier)
        update = self.mlp(self.post_attention_layernorm(x))
        return x + (update if self.residual_multiplier == 1.0 else update * self.residual_multiplier)
