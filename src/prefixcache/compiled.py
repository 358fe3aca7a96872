"""Fused elementwise work for large passes: each decoder layer's MLP and norms through ``torch.compile``.

On a CPU, a batched pass of 32 records (~860 tokens) spends about a quarter of its time in
elementwise ops that eager PyTorch runs one at a time over the whole activation (RMSNorm's
float32 round trip, the SwiGLU product), each a trip through memory. torch.compile (inductor)
fuses them. For one short row the same compiled call is slower than eager (its guards and
launch cost more than the few microseconds of work; measured, SmolLM2-135M bfloat16 on
2 cores: B = 32 passes 8-14% faster, single-record passes 4-7% slower). So every compiled
module keeps both forms and picks by the tokens in the call (:class:`BySize`): compiled from
``min_tokens`` up, eager below. Attention is not compiled (it is :mod:`prefixcache.attention`'s
own path).

Numerics: the compiled form computes the same function, but inductor keeps intermediates in
float32 where eager rounds them to the model's dtype; in float32 the two agree to rounding
(``tests/test_compiled.py``), in bfloat16 a record near a tie can change label, as with any
change of kernel (DESIGN.md: report agreement, flag near ties).

This module knows nothing about tasks or records.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

MIN_TOKENS = 128  # a single record (20-40 tokens) stays eager; a pass of 8 or more records is compiled
MODULES = ("mlp", "input_layernorm", "post_attention_layernorm")


class BySize:
    """A module's ``forward`` that runs ``compiled`` on calls of at least ``min_tokens`` tokens, else ``eager``."""

    def __init__(self, eager, compiled, min_tokens: int):
        self.eager = eager
        self.compiled = compiled
        self.min_tokens = min_tokens

    def __call__(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        tokens = hidden.numel() // hidden.shape[-1]  # hidden: [..., tokens, H]
        return (self.compiled if tokens >= self.min_tokens else self.eager)(hidden, *args, **kwargs)


def compile_layers(model: torch.nn.Module, min_tokens: int = MIN_TOKENS) -> int:
    """Give every decoder layer's MLP and norms a compiled form for calls of ``min_tokens`` or more.

    Returns the number of modules changed. Idempotent. Compilation itself happens on the first
    large call (seconds; warm up before timing). A model that has no such layers is left as it is.
    """
    layers = getattr(model.base_model, "layers", None) or ()
    changed = 0
    for layer in layers:
        for name in MODULES:
            module = getattr(layer, name, None)
            if module is None or isinstance(module.forward, BySize):
                continue
            eager = module.forward
            module.forward = BySize(eager, torch.compile(eager, dynamic=True), min_tokens)
            changed += 1
    log.info("compiled %d modules for calls of %d+ tokens", changed, min_tokens)
    return changed
