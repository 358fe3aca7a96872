"""The lean decoder stack and its causal-LM wrapper: the calling convention of the engine, in plain torch.

:class:`LeanModel` is what the engine calls as ``model.base_model(input_ids=..., attention_mask=...,
position_ids=..., cache=..., use_cache=True, output_hidden_states=...)``; it returns a :class:`LeanOutput`
with ``last_hidden_state`` (after the final norm) and, when asked, ``hidden_states``: one entry per layer
boundary (0 = the embeddings, ``L`` = ``last_hidden_state``), None where a list of indices left it out.

:class:`LeanForCausalLM` adds the output head and the attributes the rest of the package reads from a model
(``config``, ``base_model``, ``get_input_embeddings``/``get_output_embeddings``, ``generation_config``).
A transformers model answers the same, so the engine does not tell the two apart.

This module knows nothing about files (see :mod:`prefixcache.model.lean.weights`) or prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from .config import LeanConfig
from .layers import DecoderLayer, PassState, RMSNorm, output_head
from .masks import default_positions, pass_mask
from .rope import cos_sin, inverse_frequencies


@dataclass
class LeanOutput:
    """What one forward pass returns (the fields the engine reads)."""

    last_hidden_state: torch.Tensor  # [B, T, H]
    cache: object | None = None
    hidden_states: tuple[torch.Tensor | None, ...] | None = None
    logits: torch.Tensor | None = None  # [B, T', V] from LeanForCausalLM only


class _GrowingLayer:
    """One layer of :class:`LeanCache`: keys/values ``[B, kv_heads, K, head_dim]`` appended pass by pass."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:  # contiguous: a layer's keys/values may be views into its fused projection's output
            self.keys, self.values = keys.contiguous(), values.contiguous()
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values


class LeanCache:
    """A plain key/value cache (the lean counterpart of a ``DynamicCache``): what a prefix build fills.

    ``layers[i].keys`` / ``.values`` hold every token fed so far, ``[B, kv_heads, K, head_dim]``.
    """

    def __init__(self, layers: int):
        self.layers = [_GrowingLayer() for _ in range(layers)]

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(keys, values)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        keys = self.layers[layer_idx].keys
        return 0 if keys is None else keys.shape[-2]


class LeanModel(nn.Module):
    """Embeddings, decoder layers and the final norm (parameter names as in the Llama family's checkpoints)."""

    def __init__(self, config: LeanConfig):
        super().__init__()
        self.config = config
        # ``_weight`` skips the random init: the weights are assigned from the checkpoint, and initializing an
        # embedding on the meta device imports torch's compiler stack (sympy, about a second of start-up)
        weight = torch.empty(config.vocab_size, config.hidden_size)  # [V, H]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._inv_freq = {}  # device -> [head_dim / 2] float32 (not a buffer: a dtype cast must not round it)

    def new_cache(self) -> LeanCache:
        """An empty plain cache for this model (what ``PrefixKV.build`` fills)."""
        return LeanCache(self.config.num_hidden_layers)

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = inverse_frequencies(self.config.rope, self.config.head_dim).to(device)
        return self._inv_freq[device]

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                output_hidden_states=None, **kwargs) -> LeanOutput:
        """Run ``input_ids`` ``[B, T]`` after what ``cache`` holds (and append to it).

        ``position_ids`` ``[B|1, T]`` default to continuing the cache; ``use_cache`` with no cache starts a
        :class:`LeanCache`. ``output_hidden_states``: True (all), or an index or indices to keep.

        Raises:
            TypeError: an argument the lean decoder does not take (it never ignores one silently).
        """
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if unknown:
            raise TypeError(f"the lean decoder takes no {', '.join(unknown)}")
        if use_cache and cache is None:
            cache = self.new_cache()
        x = self.embed_tokens(input_ids)  # [B, T, H]
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        batch, width = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = default_positions(batch, width, past, x.device)
        cos, sin = cos_sin(self.inverse_frequencies(x.device), position_ids, x.dtype)
        state = PassState(cos, sin, pass_mask(attention_mask, width, past))
        keep = _kept_states(output_hidden_states, len(self.layers))
        states: list[torch.Tensor | None] = [x if 0 in keep else None]
        for layer in self.layers:
            x = layer(x, state, cache)
            states.append(x if len(states) in keep else None)
        x = self.norm(x)
        hidden = None
        if keep:
            states[-1] = x if len(self.layers) in keep else None
            hidden = tuple(states)
        return LeanOutput(x, cache, hidden)


def _kept_states(selection, layers: int) -> frozenset[int]:
    """Which of the ``layers + 1`` hidden states to return (negative indices count from the end)."""
    if selection is None or selection is False:
        return frozenset()
    if selection is True:
        return frozenset(range(layers + 1))
    indices = [selection] if isinstance(selection, int) else list(selection)
    return frozenset(i % (layers + 1) for i in indices)


class LeanForCausalLM(nn.Module):
    """The decoder stack with its output head (tied to the embeddings when the config says so)."""

    decoder = "lean"

    def __init__(self, config: LeanConfig, eos_token_id=None):
        super().__init__()
        self.config = config
        self.model = LeanModel(config)
        self.lm_head = output_head(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        eos = config.eos_token_id if eos_token_id is None else eos_token_id
        self.generation_config = SimpleNamespace(eos_token_id=eos)

    @property
    def base_model(self) -> LeanModel:
        return self.model

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids=None, logits_to_keep: int = 0, **kwargs) -> LeanOutput:
        """The decoder's pass (same arguments as :meth:`LeanModel.forward`) plus logits ``[B, T', V]`` of the
        last ``logits_to_keep`` positions (0: all), divided by Granite's ``logits_scaling``."""
        out = self.model(input_ids=input_ids, **kwargs)
        hidden = out.last_hidden_state[:, -logits_to_keep:] if logits_to_keep else out.last_hidden_state
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        out.logits = logits
        return out
