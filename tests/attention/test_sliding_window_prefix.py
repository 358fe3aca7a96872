"""Sliding-window layers over a shared prefix (Gemma 3 interleaves them with full layers): a record's tokens see
only the prefix keys inside their window, so the cached path must give what encoding prefix and record whole gives.

A tiny random Gemma 3 (transformers' decoder, the fallback) with a 6-token window makes every case reachable:
prefixes shorter and longer than the window, packed and padded rows, records that reach the window's edge.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.attention.sliding_window import Window
from prefixcache.cache.kv import PrefixKV, build_in_chunks
from prefixcache.engine.rows import empty_prefix, last_hidden_packed, run_padded
from prefixcache.errors import PromptError
from prefixcache.model.load import build_random_model

WINDOW = 6
VOCAB = 97


@pytest.fixture(scope="module")
def gemma():
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=WINDOW, max_position_embeddings=128,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    return build_random_model(config, seed=3)


def whole(model, prefix: list[int], row: list[int]) -> torch.Tensor:
    """The hidden state at the row's last token with prefix and row encoded whole, no cache. ``[H]``."""
    with torch.inference_mode():
        return model.base_model(input_ids=torch.tensor([prefix + row])).last_hidden_state[0, -1]


tokens = st.integers(min_value=0, max_value=VOCAB - 1)


@settings(max_examples=25, deadline=None)
@given(prefix=st.lists(tokens, min_size=1, max_size=20),
       rows=st.lists(st.lists(tokens, min_size=1, max_size=WINDOW - 1), min_size=1, max_size=4),
       packed=st.booleans())
def test_rows_over_a_shared_prefix_equal_the_whole_encoding_in_sliding_window_layers(gemma, prefix, rows, packed):
    stored = PrefixKV.build(gemma, prefix)
    assert all(k.shape[-2] == len(prefix) for k in stored.keys)  # stored whole in every layer, sliding ones too
    if packed:
        got = last_hidden_packed(gemma, stored, rows)  # [B, H]
    else:
        with torch.inference_mode():
            got = run_padded(gemma, stored, rows).last  # [B, H]
    for i, row in enumerate(rows):
        torch.testing.assert_close(got[i], whole(gemma, prefix, row), atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"prefix {len(prefix)}, row {row}: {m}")


@settings(max_examples=25, deadline=None)
@given(prefix=st.lists(tokens, min_size=0, max_size=12),
       rows=st.lists(st.lists(tokens, min_size=1, max_size=3 * WINDOW), min_size=1, max_size=4))
def test_records_longer_than_the_window_equal_the_whole_encoding_packed_and_padded(gemma, prefix, rows):
    """A record past its window sees only its own keys inside it: laid end to end (the window from the positions
    the model passes) and padded (from the model's mask) alike."""
    stored = PrefixKV.build(gemma, prefix) if prefix else empty_prefix(gemma)
    packed = last_hidden_packed(gemma, stored, rows)  # [B, H]
    with torch.inference_mode():
        padded = run_padded(gemma, stored, rows).last  # [B, H]
    for i, row in enumerate(rows):
        expected = whole(gemma, prefix, row)
        torch.testing.assert_close(packed[i], expected, atol=1e-4, rtol=1e-4, msg=lambda m: f"packed {row}: {m}")
        torch.testing.assert_close(padded[i], expected, atol=1e-4, rtol=1e-4, msg=lambda m: f"padded {row}: {m}")


def test_a_packed_window_mask_is_causal_inside_each_rows_window():
    from prefixcache.attention.shared_prefix import Packing

    packing = Packing.of([4, 2], "cpu")
    window = Window(2, 3, torch.tensor([[3, 4, 5, 6, 3, 4]]))  # two rows after a 3-token prefix, laid end to end
    assert window.packed_own_mask(packing).tolist() == [
        [[[True, False, False, False], [True, True, False, False], [False, True, True, False], [False, False, True, True]]],
        [[[True, False, False, False], [True, True, False, False], [True, True, True, False], [True, True, True, True]]]]
    assert Window(4, 3, torch.tensor([[3, 4, 5, 6, 3, 4]])).packed_own_mask(packing) is None  # windows start in it


def band(positions, size, prefix_len):
    return Window(size, prefix_len, torch.tensor(positions)).prefix_band()


def test_the_band_shows_each_query_the_prefix_keys_inside_its_window():
    assert band([[8, 9]], 6, 8).tolist() == [[[False, False, False, True, True, True, True, True],
                                              [False, False, False, False, True, True, True, True]]]
    assert band([[3, 4]], 6, 3) is None  # the whole prefix is inside every window
    assert band([[20]], 6, 8).tolist() == [[[False] * 8]]  # its window starts after the prefix
    assert band([[20]], 6, 0) is None  # no prefix
    assert Window.of({}, 8, 3, 2, "cpu") is None  # not a sliding layer
    derived = Window.of({"sliding_window": 6}, 8, 3, 2, "cpu")  # two new tokens after one earlier own token
    assert derived.positions.tolist() == [[9, 10]]


def test_own_keys_outside_a_query_window_are_hidden_and_unknown_positions_are_refused():
    window = Window(3, 2, torch.tensor([[5, 6]]))  # two queries after a 2-token prefix and 3 earlier own tokens
    own = torch.tensor([[2, 3, 4, 5, 6]])  # [1, S]
    seen = torch.ones(1, 1, 2, 5, dtype=torch.bool)
    assert window.own_mask(seen, own).tolist() == [[[[False, True, True, True, True],
                                                     [False, False, True, True, True]]]]
    with pytest.raises(PromptError, match="3-token sliding window"):
        window.own_mask(seen, None)
    assert Window(8, 2, torch.tensor([[5, 6]])).own_mask(seen, None) is seen  # every window starts in the prefix


@pytest.mark.parametrize("chunk", [1, 4, WINDOW, 9])
def test_a_prefix_built_in_chunks_equals_one_built_whole_past_the_window(gemma, chunk):
    """Each chunk attends to the stored chunks before it through the fork: inside its window only."""
    ids = [(5 * i + 2) % VOCAB for i in range(20)]
    whole_prefix = PrefixKV.build(gemma, ids)
    *_, chunked = build_in_chunks(gemma, ids, chunk)
    for got, want in zip((*chunked.keys, *chunked.values), (*whole_prefix.keys, *whole_prefix.values)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_llama_cpp_placement_refuses_a_model_with_sliding_window_layers(gemma):
    """llama.cpp keeps sliding-window layers in cells of their own, which the placement does not write: it refuses
    before it decodes anything (the llama.cpp handle here only answers its RoPE type)."""
    from types import SimpleNamespace

    from prefixcache.errors import BackendError
    from prefixcache.scheduler.torch_prefill import TorchPrefill

    with pytest.raises(BackendError, match="sliding-window layers"):
        TorchPrefill(gemma, SimpleNamespace(rope_type=2), scratch=0)
