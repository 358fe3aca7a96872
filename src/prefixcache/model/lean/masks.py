"""The attention mask and positions of one forward pass, built once (not once per layer).

The engine hands the decoder one of three masks (``engine/rows.py``):

* None: causal over the cache (prefix builds, packed rows, whose own part is causal per row);
* a 2-D padding mask ``[B, K]`` over the K keys the cache holds after this pass (prefix + own + new):
  combined here with causality by cache index, as transformers does;
* a 4-D mask ``[B, 1, T, K]``, boolean (True = attend) or additive (0 = attend), used as given (a tree
  of label tokens).
"""

from __future__ import annotations

import torch


def pass_mask(mask: torch.Tensor | None, width: int, past: int) -> torch.Tensor | None:
    """The mask every layer of a pass of ``width`` new tokens after ``past`` cached ones reads.

    Returns None (causal) or boolean ``[B|1, 1, T, K]`` with K = ``past + width``.

    Raises:
        ValueError: a mask of another rank, or a 2-D mask whose width is not ``past + width``.
    """
    if mask is None:
        return None
    if mask.dim() == 4:
        return mask if mask.dtype == torch.bool else mask == 0
    if mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D [B, K] or 4-D [B, 1, T, K], not {tuple(mask.shape)}")
    keys = past + width
    if mask.shape[1] != keys:
        raise ValueError(f"a 2-D attention_mask must cover the {keys} cached and new keys, not {mask.shape[1]}")
    key_index = torch.arange(keys, device=mask.device)  # [K]
    query_index = torch.arange(past, keys, device=mask.device)  # [T]: each new token's index in the cache
    causal = key_index[None, :] <= query_index[:, None]  # [T, K]
    return causal[None, None] & mask.bool()[:, None, None, :]  # [B, 1, T, K]


def default_positions(batch: int, width: int, past: int, device) -> torch.Tensor:
    """Positions ``[B, T]`` continuing ``past`` cached tokens, when the caller gives none."""
    return (torch.arange(width, device=device) + past)[None].expand(batch, width)
