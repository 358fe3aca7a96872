"""The model's context window, read from its config: how many positions it takes.

The task layer's context policy (``task/context.py``) takes this number as a plain int; it never reads a model.
"""

from __future__ import annotations

import torch

def context_limit(model: torch.nn.Module) -> int | None:
    """The most positions the model takes (its config's ``max_position_embeddings`` or kin), or None if unknown."""
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
