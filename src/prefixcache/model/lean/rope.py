"""Rotary position embeddings: inverse frequencies (``default`` and Llama 3's ``llama3`` scaling), the cos/sin
tables of one pass, and their application to queries and keys. Computed in float32, then cast to the
activations' dtype, in the same order of operations as the reference implementation so float32 agrees bit
for bit."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(rope: dict[str, Any], head_dim: int) -> torch.Tensor:
    """``[head_dim / 2]`` float32 inverse frequencies for the RoPE settings ``rope``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** exponents)
    if rope["rope_type"] == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by ``factor``, short ones kept, the band between smoothed."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions`` ``[B, T]`` -> cos, sin ``[B, 1, T, head_dim]`` in ``dtype`` (broadcast over heads)."""
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device)  # [B, T, d/2]
    table = torch.cat((freqs, freqs), dim=-1)  # [B, T, d]
    return table.cos().to(dtype)[:, None], table.sin().to(dtype)[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to ``x`` ``[B, h, T, d]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
