"""Sliding-window layers over a shared prefix: which keys a query may see when its layer attends to the last
``window`` positions only (Gemma 3 interleaves such layers with full ones; Mistral and Qwen2 may use them).

A key at position ``j`` is visible to a query at position ``q`` when ``q - window < j <= q`` (transformers' sliding
window). The prefix is stored whole, so a record's queries see only its last part: :meth:`Window.prefix_band`.
Padded rows see their own keys through the same rule, from the positions the fork recorded for them
(:meth:`Window.own_mask`), and rows laid end to end see theirs by the positions the model passes for them
(:meth:`Window.packed_own_mask`). A step over a slot store attends each row's stored own keys causally, so there a
row must fit inside the window (:meth:`Window.require_rows_inside`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import PromptError


@dataclass(frozen=True)
class Window:
    """One sliding-window layer's view of a pass: ``positions`` ``[B|1, T]`` are the queries' positions."""

    size: int
    prefix_len: int
    positions: torch.Tensor  # [B|1, T]

    @classmethod
    def of(cls, kwargs: dict, prefix_len: int, own_len: int, width: int, device) -> Window | None:
        """The window of an attention call (its ``sliding_window`` and ``position_ids`` keyword arguments), or None
        for a layer without one. With no positions given the rows continue the prefix and their ``own_len - width``
        earlier own tokens."""
        size = kwargs.get("sliding_window")
        if size is None:
            return None
        positions = kwargs.get("position_ids")
        if positions is None:
            start = prefix_len + own_len - width
            positions = torch.arange(start, start + width, device=device)[None, :]  # [1, T]
        return cls(int(size), prefix_len, positions)

    @functools.cached_property
    def reach(self) -> torch.Tensor:
        """``[B|1, T]``: each query sees keys after this position."""
        return self.positions - self.size

    @functools.cached_property
    def furthest(self) -> int:
        """The latest position after which some query's window starts (read from the tensor once per layer call)."""
        return int(self.reach.max())

    def prefix_band(self) -> torch.Tensor | None:
        """bool ``[B|1, T, P]``: the prefix keys each query sees; None when every query sees the whole prefix. A
        query may see none (its window starts after the prefix)."""
        if self.prefix_len == 0 or self.furthest < 0:
            return None
        keys = torch.arange(self.prefix_len, device=self.positions.device)  # [P]
        return keys[None, None, :] > self.reach[..., None]  # [B|1, T, P]

    def own_mask(self, mask: torch.Tensor | None, own_positions: torch.Tensor | None) -> torch.Tensor | None:
        """``mask`` (``[B|1, 1, T, S]`` bool, or None: causal with T == S) narrowed to the own keys inside each
        query's window; ``mask`` itself when no own key can fall outside one (every window starts in the prefix).

        Raises:
            PromptError: a window starts inside the rows' own tokens and the fork did not record their positions.
        """
        if self.furthest < self.prefix_len:
            return mask
        if own_positions is None:
            raise PromptError(f"a record reaches past this model's {self.size}-token sliding window, and its tokens' "
                              "positions were not recorded to apply it")
        inside = own_positions[:, None, None, :] > self.reach[:, None, :, None]  # [B, 1, T, S]
        if mask is None:
            width = self.positions.shape[-1]
            mask = torch.ones(width, width, dtype=torch.bool, device=inside.device).tril()[None, None]  # [1, 1, T, S]
        return mask & inside

    def packed_own_mask(self, packing) -> torch.Tensor | None:
        """bool ``[B, 1, T, T]``: for rows laid end to end (``positions`` packed, ``[1, N]``), unpacked to right-padded
        rows by ``packing`` (a :class:`~prefixcache.attention.shared_prefix.Packing`), the row's own keys each
        query sees: causal, and inside its window. None (causal alone) when every window starts in the prefix."""
        if self.furthest < self.prefix_len:
            return None
        at = packing.unpack(self.positions[:, None, :, None])[..., 0]  # [B, 1, T]: each token's position; pads 0
        width = at.shape[-1]
        causal = torch.ones(width, width, dtype=torch.bool, device=at.device).tril()  # [T, T]
        return causal & (at[..., None, :] > at[..., :, None] - self.size)  # [B, 1, T, T]

    def require_rows_inside(self) -> None:
        """A step over a slot store attends each row's stored own keys causally, without a window.

        Raises:
            PromptError: a row is longer than the window.
        """
        if self.furthest >= self.prefix_len:
            longest = int(self.positions.max()) - self.prefix_len + 1
            raise PromptError(f"a record of {longest} tokens after a {self.prefix_len}-token prefix is longer than "
                              f"this model's {self.size}-token sliding window; a step over a slot store serves rows of "
                              f"at most {self.size} tokens")
