"""Tiny models built in-process: a byte-level BPE tokenizer with a ChatML template, and random Llama/Qwen2
models over it. Nothing here touches the network or the disk outside pytest's tmp dirs."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from prefixcache.model.decoder_choice import as_lean
from prefixcache.model.lean.weights import checkpoint_tensors
from prefixcache.model.load import LoadedModel, build_random_model
from prefixcache.task.tokenizer import LeanTokenizer, load_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "Ticket: I was charged twice for my subscription, please refund the extra payment.",
    "Ticket: The app crashes every time I open the settings page on Android.",
    "Ticket: I cannot log in, the password reset email never arrives.",
    "Classify the customer support ticket into billing, technical or account.",
    "billing technical account invoice refund error crash login password email",
    "Categories: billing: money. technical: bugs. account: access.",
]

def make_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in-process, with ChatML special tokens and template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def tiny_config(arch: str, vocab: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "gemma3":  # sliding-window layers (48 tokens) beside full ones, as Gemma 3 interleaves them
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=48,
                                sliding_window_pattern=2)
    return Qwen2Config(**common, rope_theta=1e6, use_sliding_window=False)


def tiny_loaded(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, decoder: str = "lean") -> LoadedModel:
    """A tiny random ``arch`` model (seeded) on ``decoder``: ``lean`` (as the product runs these families; the oracle
    test ``tests/model/test_lean_oracle.py`` holds it equal to transformers) or ``transformers`` (the fallback)."""
    tokenizer = make_tokenizer()
    model = build_random_model(tiny_config(arch, len(tokenizer)), dtype=dtype, seed=seed)
    if decoder == "lean":
        model = as_lean(model)
    return LoadedModel(model, tokenizer, f"tiny-{arch}", f"tiny-{arch}-seed{seed}", dtype, torch.device("cpu"))


def save_tiny_model(tmp_path_factory, arch: str = "qwen2", loaded: LoadedModel | None = None) -> str:
    """Save a tiny model and its tokenizer to a fresh folder, usable as ``--model``; returns the folder.

    A lean model is written as a Hugging Face folder too (its ``config.json`` and a safetensors file)."""
    loaded = loaded or tiny_loaded(arch)
    folder = tmp_path_factory.mktemp(f"{loaded.spec}-model")
    if loaded.decoder == "lean":
        (folder / "config.json").write_text(json.dumps(loaded.model.config.raw))
        save_file(checkpoint_tensors(loaded.model), str(folder / "model.safetensors"))
    else:
        loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return str(folder)


def lean_tokenizer(hf_tokenizer: PreTrainedTokenizerFast, folder) -> LeanTokenizer:
    """``hf_tokenizer`` saved to ``folder`` and read back by prefixcache's own loader (no transformers)."""
    hf_tokenizer.save_pretrained(folder)
    return load_tokenizer(folder)
