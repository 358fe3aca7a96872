"""The layers of the lean decoder: RMSNorm, attention over the cache the engine hands in, the SiLU-gated MLP.

Parameter names match the Hugging Face checkpoints of the Llama family (``self_attn.o_proj``,
``mlp.down_proj``, ``input_layernorm`` ...), except for two fused projections: ``self_attn.qkv_proj`` holds
``q_proj``, ``k_proj`` and ``v_proj`` stacked (one matmul where there were three), and ``mlp.gate_up_proj``
holds ``gate_proj`` and ``up_proj`` (:data:`FUSED`; :mod:`prefixcache.model.lean.weights` stacks them as it
loads). A decode step of one row is a few hundred small calls, so each call saved is time saved.

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

# fused parameter (module path inside a layer) -> the checkpoint's modules it stacks, in order (dim 0)
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass(frozen=True)
class PassState:
    """What every layer of one forward pass shares.

    ``mask``: None (causal over the cache), or boolean ``[B|1, 1, T, K]`` (True = attend) over the cache's K
    keys after this pass's update.
    """

    cos: torch.Tensor  # [B, 1, T, head_dim]
    sin: torch.Tensor  # [B, 1, T, head_dim]
    mask: torch.Tensor | None


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same result within float rounding) that multiplies a few rows as ``W @ x^T``.

    On a CPU in float32, BLAS runs ``W @ x^T`` faster than ``x @ W^T`` when the rows are few (a decoding step of
    a handful of sequences): a decode step of 4 to 32 rows of the embedded model took 1.07x to 1.31x less time
    on a 2-core AVX2 EPYC, one row the same (``docs/benchmarks.md``, "Lean decoder"). One row, many rows, other
    dtypes and other devices take ``F.linear``. ``few_rows``: the row counts that take the transposed product.
    """

    def __init__(self, *args, few_rows: range = range(2, 65), **kwargs):
        super().__init__(*args, **kwargs)
        self.few_rows = few_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows not in self.few_rows or x.device.type != "cpu" or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        # [M, N], made contiguous: kernels downstream (the CPU flash attention) read the last dim as dense
        out = (self.weight @ x.reshape(rows, -1).t()).t().contiguous()
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], -1)


def output_head(width: int, vocab: int) -> Linear:
    """The output head (no bias); its tens of thousands of rows gain from the transposed product up to 32 rows."""
    return Linear(width, vocab, bias=False, few_rows=range(2, 33))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and scaled in the input's dtype (torch's fused kernel: one call
    in float32; in a narrower dtype the normalized value is rounded before the scale, as the reference does)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with RoPE, optional q/k/v (and o) biases and optional q/k norms (Qwen3); the q/k/v
    projections are one fused matmul."""

    def __init__(self, config: LeanConfig, layer_idx: int):
        super().__init__()
        width, heads, kv_heads, self.head_dim = (
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.layer_idx = layer_idx
        self.scale = config.attention_multiplier or self.head_dim**-0.5
        self.heads, self.kv_heads = heads, kv_heads
        self.qkv_proj = Linear(width, (heads + 2 * kv_heads) * self.head_dim, bias=config.attention_bias)
        self.o_proj = Linear(heads * self.head_dim, width, bias=config.output_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, state: PassState, cache) -> torch.Tensor:
        """``x`` ``[B, T, H]`` -> ``[B, T, H]``; appends this pass's keys/values to ``cache`` (if any)."""
        batch, width, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, width, -1, self.head_dim)  # [B, T, heads + 2 kv_heads, d]
        q, k, v = qkv.split((self.heads, self.kv_heads, self.kv_heads), dim=2)
        v = v.transpose(1, 2)  # [B, kv_heads, T, d]
        if self.q_norm is not None:
            q = rotate(self.q_norm(q).transpose(1, 2), state.cos, state.sin)  # [B, heads, T, d]
            k = rotate(self.k_norm(k).transpose(1, 2), state.cos, state.sin)  # [B, kv_heads, T, d]
        else:  # queries and keys rotated in one go: [B, heads + kv_heads, T, d]
            q, k = rotate(qkv[:, :, : self.heads + self.kv_heads].transpose(1, 2), state.cos, state.sin).split(
                (self.heads, self.kv_heads), dim=1)
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
    """``down(silu(gate(x)) * up(x))``, gate and up one fused matmul."""

    def __init__(self, config: LeanConfig):
        super().__init__()
        width, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = Linear(width, 2 * inner, bias=bias)
        self.down_proj = Linear(inner, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [B, T, inner] each
        return self.down_proj(F.silu(gate) * up)


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
