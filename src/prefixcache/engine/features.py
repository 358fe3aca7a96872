"""Features: the hidden states a fitted label head reads, pooled per row in one packed pass.

A feature spec is a string. Its parts, joined by ``+``, are concatenated in the order written:

* ``last``: the final layer's state (after the final norm) at the row's last token, exactly what
  :func:`~prefixcache.engine.rows.last_hidden_packed` returns and the prompt's label rows read;
* ``mean``: the final layer's states averaged over the record's own tokens;
* ``last@K`` / ``mean@K``: the same at decoder layer ``K``'s output, indexed as transformers'
  ``hidden_states``: ``0`` is the token embeddings, ``K`` the K-th decoder layer's output (1-based),
  and ``K`` = the number of layers is the final, normed state (so ``last@N`` equals ``last``);
* ``last@P/Q`` / ``mean@P/Q``: depth-relative, the layer ``floor(N * P / Q)`` of an ``N``-layer model
  (``mean@3/4`` is layer 22 of the embedded model's 30, layer 1 of a 2-layer one), so one spec fits
  every model. :meth:`FeatureSpec.resolve` turns it into absolute layers; a fitted head's manifest
  keeps the resolved form, so a head file names the exact layers it was fitted on.

"The record's own tokens" are the prompt's tokens from the stored prefix's length on: for a row fed
after the prefix, all of its tokens; for a row re-encoded in full (``full`` mode, or a record that
crosses the prefix boundary), its tokens from position ``own_start`` on. Both paths therefore
average the same positions, and the cached and the full path give the same features (invariant 1).

This module knows nothing about records, tasks or labels: only token rows and hidden states.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch

from ..attention.shared_prefix import Packing, use_shared_prefix_attention
from ..cache.kv import PrefixKV
from ..errors import InputError

POOLS = ("last", "mean")
_PART = re.compile(r"^(last|mean)(?:@(\d+)(?:/(\d+))?)?$")


@dataclass(frozen=True)
class FeaturePart:
    """One pooled state: ``pool`` (one of :data:`POOLS`) at ``layer`` (None: the final, normed layer), or at
    the depth ``fraction`` = (P, Q) of the model's layers until :meth:`resolved` against a model."""

    pool: str
    layer: int | None = None
    fraction: tuple[int, int] | None = None

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.pool}@{self.fraction[0]}/{self.fraction[1]}"
        return self.pool if self.layer is None else f"{self.pool}@{self.layer}"

    def resolved(self, layers: int) -> FeaturePart:
        """This part at an absolute layer of an ``layers``-layer model (a fraction rounds down)."""
        if self.fraction is None:
            return self
        return FeaturePart(self.pool, layers * self.fraction[0] // self.fraction[1])


@dataclass(frozen=True)
class FeatureSpec:
    """A parsed feature spec (see the module docstring). ``str(spec)`` is its canonical text."""

    parts: tuple[FeaturePart, ...]

    @classmethod
    def parse(cls, text: str) -> FeatureSpec:
        """``"last+mean@15"`` -> a spec of two parts.

        Raises:
            InputError: an empty part, an unknown pool, or a layer that is not a whole number.
        """
        parts = []
        for piece in str(text).split("+"):
            match = _PART.match(piece.strip())
            if match is None:
                raise InputError(
                    f"feature {text!r}: part {piece.strip()!r} is not one of last, mean, last@K, mean@K, "
                    "last@P/Q, mean@P/Q (K a layer number, P/Q a fraction of the depth); join parts with '+', "
                    "like last+mean@3/4"
                )
            parts.append(_part(text, *match.groups()))
        if len(set(parts)) != len(parts):
            raise InputError(f"feature {text!r} names a part twice")
        return cls(tuple(parts))

    def __str__(self) -> str:
        return "+".join(str(p) for p in self.parts)

    @property
    def layers(self) -> tuple[int, ...]:
        """The decoder layers (hidden-state indices) the spec reads besides the final one, ascending.

        Raises:
            ValueError: the spec has a depth-relative part; :meth:`resolve` it first.
        """
        if any(p.fraction is not None for p in self.parts):
            raise ValueError(f"feature {self} has a depth-relative part: resolve it against a model first")
        return tuple(sorted({p.layer for p in self.parts if p.layer is not None}))

    def resolve(self, model: torch.nn.Module) -> FeatureSpec:
        """This spec with absolute layers for ``model`` (depth fractions resolved), checked against its depth.

        Raises:
            InputError: a layer outside ``0 .. num_hidden_layers``, or two parts that resolve to the same one.
        """
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        resolved = FeatureSpec(tuple(p.resolved(layers) for p in self.parts))
        bad = [k for k in resolved.layers if k > layers]
        if bad:
            raise InputError(f"feature {self}: the model has {layers} layers, so K in @K must be 0..{layers}, not {bad[0]}")
        if len(set(resolved.parts)) != len(resolved.parts):
            raise InputError(f"feature {self}: two parts name the same layer of this {layers}-layer model ({resolved})")
        return resolved

    def check(self, model: torch.nn.Module) -> None:
        """Raise InputError unless the spec reads only layers ``model`` has (see :meth:`resolve`)."""
        self.resolve(model)

    def width(self, hidden_size: int) -> int:
        """Features per row: one hidden state per part."""
        return len(self.parts) * hidden_size


def _part(text: str, pool: str, number: str | None, denominator: str | None) -> FeaturePart:
    """A parsed part: ``pool``, ``pool@K`` or ``pool@P/Q`` (0 <= P <= Q, Q > 0)."""
    if number is None:
        return FeaturePart(pool)
    if denominator is None:
        return FeaturePart(pool, int(number))
    p, q = int(number), int(denominator)
    if q == 0 or p > q:
        raise InputError(f"feature {text!r}: a depth fraction P/Q needs 0 <= P <= Q and Q > 0, not {p}/{q}")
    return FeaturePart(pool, fraction=(p, q))


@dataclass(frozen=True)
class RowStates:
    """What one packed pass returns: ``features [B, F]`` (float32) and ``last [B, H]``, the final layer's
    state at each row's last token (the input of the prompt's label rows)."""

    features: torch.Tensor
    last: torch.Tensor


@torch.inference_mode()
def packed_features(
    model: torch.nn.Module, prefix: PrefixKV, rows: Sequence[Sequence[int]], own_starts: Sequence[int], spec: FeatureSpec
) -> RowStates:
    """Run ``rows`` after ``prefix`` laid end to end (as :func:`~prefixcache.engine.rows.last_hidden_packed`)
    and pool each row's states as ``task`` says.

    Args:
        own_starts: per row, the first of its tokens that ``mean`` averages over (0 for a row fed after
            the stored prefix; the stored prefix's length for a row re-encoded in full). Clamped so every
            row averages at least its last token.

    The prefix is only read; the fork is used for this one pass, so concurrent calls are safe.
    """
    use_shared_prefix_attention(model)
    device = prefix.keys[0].device
    lengths = [len(r) for r in rows]
    packing = Packing.of(lengths, device)
    ids = torch.tensor([token for row in rows for token in row], dtype=torch.long, device=device)[None]  # [1, N]
    positions = (prefix.length + packing.offsets)[None]  # [1, N]
    extra = {"output_hidden_states": list(spec.layers)} if spec.layers else {}
    out = model.base_model(input_ids=ids, position_ids=positions, cache=prefix.fork(1, packing), use_cache=True, **extra)
    final = out.last_hidden_state[0]  # [N, H]
    states = {None: final} | {k: out.hidden_states[k][0] for k in spec.layers}  # layer -> [N, H]
    weights = _own_token_weights(packing, lengths, own_starts, device)  # [B, N]
    pooled = []
    for part in spec.parts:
        layer_states = states[part.layer].float()  # [N, H]
        pooled.append(layer_states[packing.last] if part.pool == "last" else weights @ layer_states)  # [B, H]
    return RowStates(torch.cat(pooled, dim=-1), final[packing.last])


def _own_token_weights(packing: Packing, lengths: Sequence[int], own_starts: Sequence[int], device) -> torch.Tensor:
    """``[B, N]`` float32: row b's weight on each packed token, ``1/count`` on its own tokens, 0 elsewhere."""
    starts = torch.tensor([min(max(0, s), n - 1) for s, n in zip(own_starts, lengths)], device=device)  # [B]
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))  # [N]
    own = packing.offsets >= starts[row]  # [N]
    weights = torch.zeros(len(lengths), int(row.numel()), device=device)
    weights[row[own], torch.arange(row.numel(), device=device)[own]] = 1.0
    return weights / weights.sum(dim=1, keepdim=True)
