"""The lean decoder against its oracle: random tiny transformers models of every covered family, saved and
loaded back through the lean loader (the real path), must give the same logits within 1e-5 (float32) on
every path the engine takes: full prompts, a stored prefix and its fork, right-padded and packed rows, a tree
mask (label tokens), greedy decode steps and selected hidden states.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, GraniteConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from prefixcache.cache.kv import PrefixKV
from prefixcache.engine.rows import forward_rows, forward_visible, last_hidden_packed, pad_rows, run_padded
from prefixcache.model.lean.weights import load_lean

VOCAB = 61
TOL = 1e-5
FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral", "granite")


@st.composite
def configs(draw):
    """A random tiny config of one covered family (layers, heads, kv heads, head dim, RoPE, biases, tying)."""
    family = draw(st.sampled_from(FAMILIES))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([8, 16]))
    common = dict(
        vocab_size=VOCAB, num_hidden_layers=draw(st.integers(1, 3)), num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=draw(st.sampled_from([24, 40])),
        max_position_embeddings=256, tie_word_embeddings=draw(st.booleans()), rms_norm_eps=1e-6,
    )
    theta = draw(st.sampled_from([100.0, 10000.0, 1e6]))
    rope = {"rope_type": "default", "rope_theta": theta}
    # transformers requires heads to divide the hidden size; outside Qwen2 head_dim is still free of it
    hidden = heads * head_dim if family == "qwen2" else heads * draw(st.sampled_from([8, 12]))
    if family != "qwen2":
        common["head_dim"] = head_dim
    if family == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    if family in ("llama", "llama3", "granite"):
        common["attention_bias"] = draw(st.booleans())
        common["mlp_bias"] = draw(st.booleans())
    if family == "granite":
        common.update(embedding_multiplier=draw(st.sampled_from([1.0, 6.0])), attention_multiplier=0.1,
                      residual_multiplier=draw(st.sampled_from([0.22, 1.0])), logits_scaling=4.0)
    kind = {"llama": LlamaConfig, "llama3": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
            "mistral": MistralConfig, "granite": GraniteConfig}[family]
    extra = {"sliding_window": None} if family == "mistral" else {}
    return kind(hidden_size=hidden, rope_parameters=rope, **common, **extra)


def oracle_and_lean(config, seed: int):
    """A random transformers model of ``config`` (every weight and bias drawn, norms included) and the same
    weights loaded by the lean loader from a ``save_pretrained`` folder."""
    torch.manual_seed(seed)
    oracle = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for param in oracle.parameters():
            param.uniform_(-0.5, 0.5)
    oracle.requires_grad_(False)
    with tempfile.TemporaryDirectory() as folder:
        oracle.save_pretrained(folder)
        lean = load_lean(folder, torch.float32)
    return oracle, lean


def head(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.get_output_embeddings()(hidden)


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = (a - b).abs().max().item()
    assert diff <= TOL, f"{what}: lean differs from transformers by {diff:.2e} (> {TOL})"


rows_of = st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=7), min_size=1, max_size=4)


@settings(max_examples=30, deadline=None)
@given(config=configs(), prefix=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12), rows=rows_of,
       seed=st.integers(0, 2**16))
def test_lean_logits_equal_transformers_on_every_engine_path(config, prefix, rows, seed):
    oracle, lean = oracle_and_lean(config, seed)
    with torch.inference_mode():
        whole = torch.tensor([prefix + rows[0]])
        expected = oracle(input_ids=whole, output_hidden_states=True)
        got = lean(input_ids=whole, output_hidden_states=[1, -1])
        close(got.logits, expected.logits, "full prompt")
        close(got.hidden_states[1], expected.hidden_states[1], "hidden state after layer 1")
        assert got.hidden_states[0] is None and got.hidden_states[-1] is got.last_hidden_state

        stored = {name: PrefixKV.build(m, prefix) for name, m in (("oracle", oracle), ("lean", lean))}
        for k_oracle, k_lean in zip(stored["oracle"].keys, stored["lean"].keys):
            close(k_lean, k_oracle, "stored prefix keys")
        padded = {name: run_padded(m, stored[name], rows) for name, m in (("oracle", oracle), ("lean", lean))}
        close(head(lean, padded["lean"].last), head(oracle, padded["oracle"].last), "right-padded rows after a prefix")
        packed = [last_hidden_packed(m, stored[name], rows) for name, m in (("oracle", oracle), ("lean", lean))]
        close(head(lean, packed[1]), head(oracle, packed[0]), "packed rows after a prefix")
        _tree_pass_agrees(oracle, lean, padded, stored["lean"].length, seed)
        _decode_agrees(oracle, lean, stored, rows)


def _tree_pass_agrees(oracle, lean, padded, prefix_len: int, seed: int) -> None:
    """Two nodes fed after every row under a 4-D boolean mask (the labels' trie pass)."""
    generator = torch.Generator().manual_seed(seed)
    seen = padded["lean"].seen  # [B, P + S]
    batch = seen.shape[0]
    tree = torch.tensor([[True, False], [bool(torch.randint(2, (1,), generator=generator)), True]])
    visible = torch.cat([seen[:, None, None, :].expand(batch, 1, 2, -1), tree[None, None].expand(batch, 1, 2, 2)], -1)
    nodes = torch.randint(1, VOCAB, (1, 2), generator=generator).expand(batch, 2)
    positions = (prefix_len + padded["lean"].lengths - 1)[:, None] + torch.tensor([1, 2])[None]
    pairs = (("oracle", oracle), ("lean", lean))
    out = [forward_visible(m, padded[n].cache, nodes, positions, visible) for n, m in pairs]
    close(head(lean, out[1]), head(oracle, out[0]), "a tree of label tokens (4-D mask)")


def _decode_agrees(oracle, lean, stored, rows, steps: int = 3) -> None:
    """Greedy decoding as ``generate_rows`` runs it: a prefill of right-padded rows, then one token per row per
    step with each row's own position and mask; both decoders are fed the oracle's tokens."""
    ids, mask, lengths = pad_rows(rows, torch.device("cpu"))
    batch, prefix_len = len(rows), stored["lean"].length
    forks = {name: stored[name].fork(batch) for name in stored}
    past = torch.ones(batch, prefix_len, dtype=torch.bool)
    start = torch.full((batch,), prefix_len)
    last = {}
    for name, model in (("oracle", oracle), ("lean", lean)):
        hidden = forward_rows(model, forks[name], ids, mask, start, past)
        last[name] = head(model, hidden[torch.arange(batch), lengths - 1])
    attention, positions = torch.cat([past, mask], dim=1), lengths + prefix_len
    for step in range(steps):
        close(last["lean"], last["oracle"], f"decode step {step}")
        next_ids = last["oracle"].argmax(-1)[:, None]  # [B, 1]
        step_mask = torch.ones(batch, 1, dtype=torch.bool)
        for name, model in (("oracle", oracle), ("lean", lean)):
            last[name] = head(model, forward_rows(model, forks[name], next_ids, step_mask, positions, attention)[:, -1])
        attention, positions = torch.cat([attention, step_mask], dim=1), positions + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_covered_and_agrees_on_a_fixed_model(family):
    """One fixed model per family, so each family is tried on every run whatever hypothesis draws."""
    config = {
        "llama": LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, attention_bias=True),
        "llama3": LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, rope_parameters={
                                  "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        "qwen2": Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        "qwen3": Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        "mistral": MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
        "granite": GraniteConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=12.0,
                                 attention_multiplier=0.05, residual_multiplier=0.3, logits_scaling=8.0),
    }[family]
    oracle, lean = oracle_and_lean(config, seed=1)
    assert lean.decoder == "lean"
    with torch.inference_mode():
        ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7]])
        close(lean(input_ids=ids).logits, oracle(input_ids=ids).logits, f"{family}: a 26-token prompt")
