"""Which decoder serves a model: the lean one for the Llama family, transformers (the fallback) elsewhere, and
what forces either. The fallback is tried on a family the lean decoder does not cover (Phi-3: fused q/k/v),
through the whole engine path: a stored prefix, its fork and full re-encoding agree."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import Phi3Config

from prefixcache.cache.kv import PrefixKV
from prefixcache.engine.rows import empty_prefix, run_padded
from prefixcache.errors import ModelNotFoundError
from prefixcache.model.decoder_choice import DECODER_ENV, choose_decoder
from prefixcache.model.lean.decoder import LeanForCausalLM
from prefixcache.model.load import LoadedModel, build_random_model, load_model

from tests.support.models import make_tokenizer, save_tiny_model


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory, "qwen2")


@pytest.fixture(scope="module")
def phi3_folder(tmp_path_factory) -> str:
    tokenizer = make_tokenizer()
    config = Phi3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, initializer_range=0.2)
    loaded = LoadedModel(build_random_model(config), tokenizer, "tiny-phi3", "tiny-phi3", torch.float32,
                         torch.device("cpu"))
    return save_tiny_model(tmp_path_factory, loaded=loaded)


def test_a_llama_family_model_loads_on_the_lean_decoder(qwen2_folder, monkeypatch):
    monkeypatch.delenv(DECODER_ENV, raising=False)
    loaded = load_model(qwen2_folder, "float32", 1)
    assert loaded.decoder == "lean" and isinstance(loaded.model, LeanForCausalLM)


def test_the_environment_forces_the_transformers_decoder(qwen2_folder, monkeypatch):
    monkeypatch.setenv(DECODER_ENV, "transformers")
    loaded = load_model(qwen2_folder, "float32", 1)
    assert loaded.decoder == "transformers" and not isinstance(loaded.model, LeanForCausalLM)


def test_an_uncovered_family_falls_back_to_transformers_and_runs_the_engine(phi3_folder, monkeypatch):
    monkeypatch.delenv(DECODER_ENV, raising=False)
    loaded = load_model(phi3_folder, "float32", 1)
    assert loaded.decoder == "transformers"
    prefix_ids, rows = [5, 9, 12, 40, 7], [[30, 31, 32], [33]]
    with torch.inference_mode():
        cached = run_padded(loaded.model, PrefixKV.build(loaded.model, prefix_ids), rows).last  # [B, H]
        full = run_padded(loaded.model, empty_prefix(loaded.model), [prefix_ids + r for r in rows]).last
    assert torch.allclose(cached, full, atol=1e-5), "the fallback's cached rows must equal full re-encoding"


def test_asking_for_the_lean_decoder_on_an_uncovered_family_says_why(phi3_folder):
    with pytest.raises(ModelNotFoundError, match="phi3"):
        choose_decoder(phi3_folder, "lean")
    with pytest.raises(ModelNotFoundError, match="decoder must be one of"):
        choose_decoder(phi3_folder, "fast")


def test_the_lean_path_imports_no_transformers(qwen2_folder):
    """Loading the weights and running a prefix, a fork and a decode step on the lean decoder, in a fresh
    interpreter, leaves transformers unimported (the tokenizer is not part of this)."""
    script = (
        "import sys, torch\n"
        "from prefixcache.model.lean.weights import load_lean\n"
        "from prefixcache.cache.kv import PrefixKV\n"
        "from prefixcache.engine.rows import run_padded, last_hidden_packed\n"
        f"model = load_lean({qwen2_folder!r})\n"
        "prefix = PrefixKV.build(model, [5, 6, 7, 8])\n"
        "run_padded(model, prefix, [[9, 10], [11]]); last_hidden_packed(model, prefix, [[9, 10], [11]])\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
        "print(loaded); sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, f"the lean path imported transformers: {result.stdout} {result.stderr[-2000:]}"
