"""A stored prefix's own operations (cache/kv.py): the head views of its first tokens and the copy that
owns its memory, which the pool uses to serve a shorter prefix out of a longer stored one.

Pure tensor checks on a prefix built by a tiny random Llama; the pool tests cover the same calls end to
end, but they are slow and out of the mutation run.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from prefixcache.attention.shared_prefix import Packing
from prefixcache.cache.kv import KVShape, PrefixKV, build_in_chunks
from prefixcache.engine.rows import empty_prefix
from prefixcache.errors import PromptError
from prefixcache.model.load import build_random_model

from tests.support.models import make_tokenizer, tiny_config

IDS = tuple(range(10, 17))  # a 7-token prefix


@pytest.fixture(scope="module")
def stored(tiny_llama) -> PrefixKV:
    return PrefixKV.build(tiny_llama.model, IDS)


@pytest.mark.parametrize("length", [0, 1, 4, 7])
def test_the_head_of_every_length_from_none_to_all_is_the_first_tokens_as_views(stored, length):
    head = stored.leading(length)
    assert head.token_ids == IDS[:length] and head.length == length
    for own, whole in zip((*head.keys, *head.values), (*stored.keys, *stored.values)):
        assert own.shape == (*whole.shape[:2], length, whole.shape[3])  # [1, kv_heads, length, head_dim]
        assert own.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()  # a view, no copy
        assert torch.equal(own, whole[..., :length, :])


@pytest.mark.parametrize("length", [-1, 8])
def test_a_leading_part_outside_the_prefix_is_refused_naming_both_lengths(stored, length):
    with pytest.raises(ValueError) as refused:
        stored.leading(length)
    assert str(refused.value) == f"leading({length}) of a 7-token prefix"


def test_a_copy_of_a_head_owns_contiguous_tensors_with_the_same_values(stored):
    head = stored.leading(3)
    assert not head.keys[0].is_contiguous()  # a slice along the token axis of [1, kv_heads, P, head_dim]
    copy = head.copy()
    assert copy.token_ids == head.token_ids
    for own, view in zip((*copy.keys, *copy.values), (*head.keys, *head.values)):
        assert own.is_contiguous() and torch.equal(own, view)
        assert own.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    assert copy.checksum() == head.checksum()


def test_a_copy_is_contiguous_even_of_dense_tensors_in_another_layout(stored):
    """A slice has gaps, so any clone of it is laid out afresh; tensors that are dense but transposed (as an
    unpacked storage layout may hand back) would keep their strides under a plain clone."""
    def transposed(tensors):
        return tuple(t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in tensors)

    keys, values = transposed(stored.keys), transposed(stored.values)
    assert not keys[0].is_contiguous() and not values[0].is_contiguous()
    copy = PrefixKV(stored.token_ids, keys, values).copy()
    assert all(t.is_contiguous() for t in (*copy.keys, *copy.values))
    assert all(torch.equal(a, b) for a, b in zip((*copy.keys, *copy.values), (*stored.keys, *stored.values)))


@pytest.mark.parametrize("head_dim", ["default", 24, "unset"])
def test_the_cache_geometry_predicts_the_bytes_a_built_prefix_holds(head_dim):
    """The pool sizes a prefix before building it from :class:`KVShape`. A model may set ``head_dim``
    apart from ``hidden_size // num_attention_heads`` (64 // 4 = 16 here; 24 set explicitly), or leave it
    unset (``None``: older configs), and the estimate must follow the one its attention uses."""
    config = tiny_config("llama", len(make_tokenizer()))
    if head_dim == 24:
        config = type(config).from_dict(config.to_dict() | {"head_dim": head_dim})
    model = build_random_model(config, seed=0)
    if head_dim == "unset":
        config.head_dim = None  # the attention layers already hold their 16; only the geometry reads it now
    shape = KVShape.of(config)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (2, 2, 24 if head_dim == 24 else 16)
    assert type(shape.head_dim) is int
    built = PrefixKV.build(model, IDS)
    assert shape.nbytes(len(IDS), 4) == built.nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_empty_prefix_is_laid_out_like_a_built_one_with_no_tokens(dtype):
    """Full re-encoding forks ``empty_prefix``; its tensors are concatenated with the rows' keys, so a float32
    empty prefix would promote a bfloat16 model's keys to float32 (other numbers than the model's own)."""
    model = build_random_model(tiny_config("qwen2", len(make_tokenizer())), dtype=dtype, seed=0)
    built, empty = PrefixKV.build(model, IDS), empty_prefix(model)
    assert empty.token_ids == () and empty.length == 0 and len(empty.keys) == len(empty.values) == len(built.keys)
    for made, ref in zip((*empty.keys, *empty.values), (*built.keys, *built.values)):
        assert made.shape == (*ref.shape[:2], 0, ref.shape[3]), made.shape
        assert (made.dtype, made.device) == (ref.dtype, ref.device) == (dtype, torch.device("cpu"))


@pytest.mark.parametrize("split", range(len(IDS)))
def test_extending_a_head_recomputes_the_rest_of_the_prefix(tiny_llama, stored, split):
    """``head(split).extend(rest)`` is the prefix built whole, for every split: from nothing (it builds), from
    one token, and from all but the last. The prefix extended is left as it was and shares nothing."""
    start = stored.leading(split).copy()
    before = start.checksum()
    grown = start.extend(tiny_llama.model, IDS[split:])
    assert grown.token_ids == IDS and start.checksum() == before
    for got, ref, old in zip((*grown.keys, *grown.values), (*stored.keys, *stored.values), (*start.keys, *start.values)):
        assert got.shape == ref.shape and got.data_ptr() != old.data_ptr()
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 7, 50])
def test_a_prefix_built_in_chunks_is_the_prefix_built_whole(tiny_llama, stored, chunk):
    """``build_in_chunks`` yields the prefix so far after each chunk (ceil(P / chunk) of them, growing), and the
    last is the prefix built in one pass."""
    steps = list(build_in_chunks(tiny_llama.model, IDS, chunk))
    assert [s.length for s in steps] == [min(len(IDS), chunk * (i + 1)) for i in range(-(-len(IDS) // chunk))]
    whole = steps[-1]
    assert whole.token_ids == IDS
    for got, ref in zip((*whole.keys, *whole.values), (*stored.keys, *stored.values)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        next(build_in_chunks(tiny_llama.model, (), 4))


def test_extending_by_nothing_is_refused_pointing_at_copy(tiny_llama, stored):
    with pytest.raises(ValueError) as refused:
        stored.extend(tiny_llama.model, ())
    assert str(refused.value) == "extend() needs at least one tail token; use copy()"


@pytest.mark.parametrize("length", [0, 7])
def test_the_tensors_written_to_disk_read_back_as_the_same_prefix(stored, length):
    """The disk tier's round trip: ``from_tensors(to_tensors())`` keeps every layer and the token ids, which are
    int64 even for an empty prefix (``torch.tensor(())`` alone would be float32)."""
    prefix = stored.leading(length)
    tensors = prefix.to_tensors()
    assert tensors["token_ids"].dtype == torch.int64 and tensors["token_ids"].tolist() == list(prefix.token_ids)
    back = PrefixKV.from_tensors(tensors)
    assert back.token_ids == prefix.token_ids and len(back.keys) == len(back.values) == len(stored.keys)
    for got, ref in zip((*back.keys, *back.values), (*prefix.keys, *prefix.values)):
        assert torch.equal(got, ref) and got.is_contiguous()


def test_a_fork_refuses_rows_it_was_not_made_for_and_a_packed_fork_a_second_pass(stored):
    """The fork's guards, whole: a batch of another size (``fork(2)`` fed 3 rows), and a packed fork fed twice
    (its rows' own keys would be laid end to end with the first pass's)."""
    layer = stored.fork(2).layers[0]
    own = torch.zeros(3, *stored.keys[0].shape[1:2], 1, stored.keys[0].shape[-1])  # [3, kv_heads, 1, head_dim]
    with pytest.raises(ValueError) as refused:
        layer.update(own, own)
    assert str(refused.value) == "fork was made for batch 2, got 3 rows"
    packed = stored.fork(1, Packing.of([1], "cpu")).layers[0]
    packed.update(own[:1], own[:1])
    with pytest.raises(ValueError) as refused:
        packed.update(own[:1], own[:1])
    assert str(refused.value) == "a packed fork serves one forward pass; fork again for another"


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"layer_types": ["full_attention", "linear_attention"]}, "['linear_attention']"),
        ({"layer_types": ["sliding_attention", "linear_attention"]}, "['linear_attention']"),
        ({"layer_types": ["chunked_attention", "mamba"]}, "['chunked_attention', 'mamba']"),
    ],
)
def test_a_model_with_layers_that_are_not_attention_is_refused_naming_them(stored, settings, named):
    """A linear-attention or state-space layer has no keys to share: building, and extending, a prefix for such a
    model is refused, naming the model type and the odd layer types. Sliding-window layers are not named: they are
    served (tests/attention/test_sliding_window_prefix.py)."""
    config = tiny_config("qwen2", 400)
    for name, value in settings.items():
        setattr(config, name, value)
    model = SimpleNamespace(config=config)
    message = (f"model type 'qwen2' uses layer types {named}; "
               "prefix sharing supports attention decoders only (full or sliding-window)")
    for attempt in (lambda: PrefixKV.build(model, IDS), lambda: stored.extend(model, IDS[:1])):
        with pytest.raises(PromptError) as refused:
            attempt()
        assert str(refused.value) == message


def test_an_empty_prefix_is_refused_before_the_model_runs():
    with pytest.raises(PromptError) as refused:
        PrefixKV.build(SimpleNamespace(), ())
    assert str(refused.value) == "the prefix is empty: nothing to cache"
