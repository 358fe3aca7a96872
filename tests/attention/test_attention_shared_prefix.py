"""The shared-prefix attention equals plain attention over the concatenated sequence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.attention import shared_prefix as attention
from prefixcache.attention.shared_prefix import _attend_cpu_flash, _attend_eager
from prefixcache.engine.rows import empty_prefix, forward_rows, last_hidden_packed, pad_rows
from prefixcache.cache.kv import PrefixKV

def random_rows(test):
    """Run ``test`` on random prefix lengths (0-24 tokens), 1-5 rows of 1-9 tokens, and a seed."""
    cases = given(
        prefix_len=st.integers(0, 24),
        lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
        seed=st.integers(0, 2**31),
    )
    return settings(max_examples=20, deadline=None)(cases(test))


def random_case(model, prefix_len: int, lengths: list[int], seed: int):
    """(prefix ids, rows, the prefix's cache) of random tokens; an empty prefix when ``prefix_len`` is 0."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prefix_ids = torch.randint(3, vocab, (prefix_len,), generator=gen).tolist()
    rows = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    prefix = PrefixKV.build(model, prefix_ids) if prefix_ids else empty_prefix(model)
    return prefix_ids, rows, prefix


@random_rows
def test_fork_hidden_states_equal_plain_forward(tiny, prefix_len, lengths, seed):
    model = tiny.model
    prefix_ids, rows, prefix = random_case(model, prefix_len, lengths, seed)
    ids, mask, _ = pad_rows(rows, torch.device("cpu"))  # [B, S]
    batch = len(rows)
    with torch.inference_mode():
        hidden = forward_rows(
            model,
            prefix.fork(batch),
            ids,
            mask,
            torch.full((batch,), prefix_len),
            torch.ones(batch, prefix_len, dtype=torch.bool),
        )  # [B, S, H]
        for i, row in enumerate(rows):
            whole = torch.tensor([prefix_ids + row])  # [1, P + n], no cache: transformers' own SDPA path
            ref = model.base_model(input_ids=whole).last_hidden_state[0, prefix_len:]  # [n, H]
            torch.testing.assert_close(hidden[i, : len(row)], ref, atol=1e-4, rtol=1e-4)


@random_rows
def test_packed_rows_give_each_rows_plain_forward(tiny, prefix_len, lengths, seed):
    """Rows laid end to end (no padding) still never see each other: each row's last hidden state is
    transformers' own forward over prefix + that row alone."""
    model = tiny.model
    prefix_ids, rows, prefix = random_case(model, prefix_len, lengths, seed)
    before = prefix.checksum()
    with torch.inference_mode():
        last = last_hidden_packed(model, prefix, rows)  # [B, H]
        for i, row in enumerate(rows):
            whole = torch.tensor([prefix_ids + row])  # [1, P + n], no cache
            ref = model.base_model(input_ids=whole).last_hidden_state[0, -1]  # [H]
            torch.testing.assert_close(last[i], ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"row {i} of {lengths}: {m}")
    assert prefix.checksum() == before, "a packed pass changed the stored prefix"


def test_a_packed_fork_serves_one_pass(tiny):
    from prefixcache.attention.shared_prefix import Packing

    prefix = PrefixKV.build(tiny.model, [5, 6, 7])
    with pytest.raises(ValueError, match="one sequence"):
        prefix.fork(2, Packing.of([1, 2], torch.device("cpu")))
    with pytest.raises(ValueError, match="at least one token"):
        Packing.of([3, 0], torch.device("cpu"))
    cache = prefix.fork(1, Packing.of([2, 1], torch.device("cpu")))
    layer = cache.layers[0]
    kv = torch.zeros(1, prefix.keys[0].shape[1], 3, prefix.keys[0].shape[-1])
    layer.update(kv, kv)
    with pytest.raises(ValueError, match="one forward pass"):
        layer.update(kv, kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_eager_partial_attention_agree_including_empty_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 16, generator=gen).to(dtype) for n in (5, 7, 7))
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool).tril(2)
    mask[1, 0, 3] = False  # a query that sees nothing
    out_f, lse_f = _attend_cpu_flash(q, k, v, mask, 0.25)
    out_e, lse_e = _attend_eager(q, k, v, mask, 0.25)
    assert torch.isneginf(lse_f[1, :, 3]).all() and torch.isneginf(lse_e[1, :, 3]).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lse_f, lse_e, atol=tol, rtol=tol)
    torch.testing.assert_close(out_f.float(), out_e.float(), atol=tol, rtol=tol)


def test_the_fused_kernel_is_fed_dense_last_dims_whatever_the_callers_layout():
    """torch's fused CPU kernel, called directly, returns garbage for a last dim that is not dense; queries, keys and
    values that arrive as transposed views (a projection's output read as ``W @ x^T``) still attend exactly."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(16, 2, 3, n, generator=gen).permute(1, 2, 3, 0) for n in (5, 7, 7))  # [2, 3, n, 16]
    assert q.stride(-1) != 1 and k.stride(-1) != 1 and v.stride(-1) != 1
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool).tril(2)
    out_f, lse_f = _attend_cpu_flash(q, k, v, mask, 0.25)
    out_e, lse_e = _attend_eager(q.contiguous(), k.contiguous(), v.contiguous(), mask, 0.25)
    torch.testing.assert_close(lse_f, lse_e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_f, out_e, atol=1e-5, rtol=1e-5)


def test_attention_features_it_cannot_share_are_refused():
    from prefixcache.attention.shared_prefix import SharedKV, shared_prefix_attention

    q = torch.zeros(1, 2, 1, 4)
    kv = SharedKV(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 1, 4))
    with pytest.raises(NotImplementedError, match="softcap"):
        shared_prefix_attention(torch.nn.Module(), q, kv, kv, None, softcap=30.0)


def test_a_mask_that_is_not_boolean_is_refused_naming_the_format_it_expects():
    """An additive float mask (the eager format) would be read as True/False by mistake: it is refused."""
    from prefixcache.attention.shared_prefix import SharedKV, shared_prefix_attention

    q = torch.zeros(1, 2, 1, 4)
    kv = SharedKV(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 1, 4))
    additive = torch.zeros(1, 1, 1, 4)  # [B, 1, T, P + S], 0.0 = attend
    with pytest.raises(TypeError) as raised:
        shared_prefix_attention(torch.nn.Module(), q, kv, kv, additive)
    assert str(raised.value) == "prefixcache attention expects a boolean mask (sdpa format)"


def _reference_attention(q, prefix_k, prefix_v, own_k, own_v, own_visible, scale):
    """Plain softmax attention over [prefix ; own] keys, kv heads repeated per query head, in float64.
    q: [B, H, T, d]; prefix_*: [1, kv, P, d]; own_*: [B, kv, S, d]; own_visible: [B, T, S] bool.
    Returns [B, T, H, d] (the attention function's output layout)."""
    batch, heads, width, _ = q.shape
    groups = heads // own_k.shape[1]
    keys = torch.cat([prefix_k.expand(batch, -1, -1, -1), own_k], dim=2).repeat_interleave(groups, dim=1).double()
    values = torch.cat([prefix_v.expand(batch, -1, -1, -1), own_v], dim=2).repeat_interleave(groups, dim=1).double()
    visible = torch.cat([torch.ones(batch, width, prefix_k.shape[2], dtype=torch.bool), own_visible], dim=2)
    scores = (q.double() @ keys.transpose(-1, -2)) * scale  # [B, H, T, P + S]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2)


SHAPES = dict(batch=3, heads=6, kv_heads=2, prefix=5, head_dim=8)  # 3 query heads per kv head: groups != kv heads


def _qkv(gen, batch, heads, kv_heads, width, own, prefix, head_dim):
    q = torch.randn(batch, heads, width, head_dim, generator=gen)
    prefix_k, prefix_v = (torch.randn(1, kv_heads, prefix, head_dim, generator=gen) for _ in range(2))
    own_k, own_v = (torch.randn(batch, kv_heads, own, head_dim, generator=gen) for _ in range(2))
    return q, prefix_k, prefix_v, own_k, own_v


@pytest.mark.parametrize("kernel", ["fused", "eager"])
@pytest.mark.parametrize("scaling", [None, 0.3], ids=["default-scale", "model-scale"])
def test_shared_prefix_attention_equals_attention_over_the_concatenated_keys(monkeypatch, scaling, kernel):
    """Padded rows with the model's boolean mask, grouped-query heads (groups != kv heads), and the
    model's own ``scaling`` (or the default ``head_dim ** -0.5`` when it passes none); on the CPU's fused
    kernel and on the eager path other devices take."""
    if kernel == "eager":
        monkeypatch.setattr(attention, "_has_cpu_flash", lambda q: False)
    from prefixcache.attention.shared_prefix import SharedKV, shared_prefix_attention

    b, h, kv, p, d = (SHAPES[k] for k in ("batch", "heads", "kv_heads", "prefix", "head_dim"))
    width = 4
    q, prefix_k, prefix_v, own_k, own_v = _qkv(torch.Generator().manual_seed(5), b, h, kv, width, width, p, d)
    lengths = torch.tensor([4, 2, 3])  # right-padded rows
    own_visible = torch.ones(width, width, dtype=torch.bool).tril()[None] & (torch.arange(width) < lengths[:, None])[:, None]
    mask = torch.cat([torch.ones(b, width, p, dtype=torch.bool), own_visible], dim=2)[:, None]  # [B, 1, T, P + S]
    out, _ = shared_prefix_attention(
        torch.nn.Module(), q, SharedKV(prefix_k, own_k), SharedKV(prefix_v, own_v), mask, scaling=scaling
    )
    scale = d**-0.5 if scaling is None else scaling
    want = _reference_attention(q, prefix_k, prefix_v, own_k, own_v, own_visible, scale)
    assert out.shape == (b, width, h, d)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_shared_prefix_attention_without_a_mask_is_causal_from_the_last_query():
    """No mask (transformers drops an all-true one): queries are the last ``T`` of ``S`` own tokens, each
    seeing the whole prefix and the own tokens up to its own position."""
    from prefixcache.attention.shared_prefix import SharedKV, shared_prefix_attention

    b, h, kv, p, d = (SHAPES[k] for k in ("batch", "heads", "kv_heads", "prefix", "head_dim"))
    width, own = 2, 5
    q, prefix_k, prefix_v, own_k, own_v = _qkv(torch.Generator().manual_seed(6), b, h, kv, width, own, p, d)
    query_pos = torch.arange(own - width, own)[:, None]
    own_visible = (torch.arange(own)[None, :] <= query_pos).expand(b, width, own)
    out, _ = shared_prefix_attention(torch.nn.Module(), q, SharedKV(prefix_k, own_k), SharedKV(prefix_v, own_v), None)
    want = _reference_attention(q, prefix_k, prefix_v, own_k, own_v, own_visible, d**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    with torch.device("meta"):  # the causal mask it makes is on the queries' device (see test_device_placement.py)
        again, _ = shared_prefix_attention(torch.nn.Module(), q, SharedKV(prefix_k, own_k), SharedKV(prefix_v, own_v), None)
    assert torch.equal(again, out)


def test_plain_keys_go_to_transformers_sdpa_with_the_models_mask_and_scale():
    """Plain key/value tensors (building a prefix, a full re-encode) are not shared: the call is transformers'
    own SDPA attention, with the model's mask and its ``scaling`` passed through."""
    from prefixcache.attention.shared_prefix import shared_prefix_attention

    b, h, kv, _, d = (SHAPES[k] for k in ("batch", "heads", "kv_heads", "prefix", "head_dim"))
    width = 4
    q, _, _, own_k, own_v = _qkv(torch.Generator().manual_seed(7), b, h, kv, width, width, 0, d)
    lengths = torch.tensor([4, 2, 3])
    own_visible = torch.ones(width, width, dtype=torch.bool).tril()[None] & (torch.arange(width) < lengths[:, None])[:, None]
    module = torch.nn.Module()
    module.num_key_value_groups = h // kv
    out, weights = shared_prefix_attention(module, q, own_k, own_v, own_visible[:, None], scaling=0.3)
    empty = torch.zeros(1, kv, 0, d)
    want = _reference_attention(q, empty, empty, own_k, own_v, own_visible, 0.3)
    assert weights is None and out.shape == (b, width, h, d)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    # The rest of the model's arguments reach it too: its dropout (1.0 drops every weight) and ``is_causal``
    # (False with no mask: every query sees every key).
    dropped, _ = shared_prefix_attention(module, q, own_k, own_v, own_visible[:, None], scaling=0.3, dropout=1.0)
    assert not dropped.any()
    bidirectional, _ = shared_prefix_attention(module, q, own_k, own_v, None, scaling=0.3, is_causal=False)
    everything = torch.ones(b, width, width, dtype=torch.bool)
    want = _reference_attention(q, empty, empty, own_k, own_v, everything, 0.3)
    torch.testing.assert_close(bidirectional.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scaling", [None, 0.3], ids=["default-scale", "model-scale"])
def test_packed_shared_prefix_attention_equals_each_rows_own_attention(scaling):
    """Rows laid end to end (one sequence of N tokens): each row sees the whole prefix and its own
    tokens causally, never another row's, with grouped-query heads and the model's ``scaling``."""
    from prefixcache.attention.shared_prefix import Packing, SharedKV, shared_prefix_attention

    h, kv, p, d = (SHAPES[k] for k in ("heads", "kv_heads", "prefix", "head_dim"))
    lengths = [3, 1, 4]
    packing = Packing.of(lengths, torch.device("cpu"))
    n = sum(lengths)
    q, prefix_k, prefix_v, own_k, own_v = _qkv(torch.Generator().manual_seed(7), 1, h, kv, n, n, p, d)
    out, _ = shared_prefix_attention(
        torch.nn.Module(), q, SharedKV(prefix_k, own_k, packing), SharedKV(prefix_v, own_v, packing), None,
        scaling=scaling,
    )
    assert out.shape == (1, n, h, d)
    scale = d**-0.5 if scaling is None else scaling
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        causal = torch.ones(length, length, dtype=torch.bool).tril()[None]
        want = _reference_attention(
            q[:, :, rows], prefix_k, prefix_v, own_k[:, :, rows], own_v[:, :, rows], causal, scale
        )
        torch.testing.assert_close(out[:, rows].double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"row {rows}: {m}")
        start += length


@pytest.mark.parametrize("feature", ["softcap", "s_aux"])
def test_each_attention_feature_it_cannot_share_is_refused(feature):
    from prefixcache.attention.shared_prefix import SharedKV, shared_prefix_attention

    q = torch.zeros(1, 2, 1, 4)
    kv = SharedKV(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 1, 4))
    with pytest.raises(NotImplementedError, match=feature):
        shared_prefix_attention(torch.nn.Module(), q, kv, kv, None, **{feature: 1})
    with pytest.raises(NotImplementedError, match="s_aux, softcap"):  # every one named, sorted
        shared_prefix_attention(torch.nn.Module(), q, kv, kv, None, softcap=30.0, s_aux=torch.zeros(2))


@pytest.mark.parametrize("causal", [True, False])
def test_attend_takes_the_fused_kernel_on_the_cpu_and_the_eager_path_agrees_elsewhere(monkeypatch, causal):
    """On the CPU ``_attend`` runs the fused kernel; where it is missing (other devices) the eager path, with
    its own causal mask for ``causal``, must give the same output and log-sum-exp."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 16, generator=gen) for n in (6, 6, 6))
    mask = None if causal else torch.ones(2, 1, 6, 6, dtype=torch.bool).tril(1)
    fused_calls = []
    monkeypatch.setattr(attention, "_attend_cpu_flash", lambda *a: fused_calls.append(1) or _attend_cpu_flash(*a))
    out_f, lse_f = attention._attend(q, k, v, mask, 0.25, causal)
    assert fused_calls == [1], "the CPU did not take the fused kernel"
    monkeypatch.setattr(attention, "_has_cpu_flash", lambda q: False)
    with torch.device("meta"):  # the causal mask it makes is on q's device, not torch's default one
        out_e, lse_e = attention._attend(q, k, v, mask, 0.25, causal)
    assert fused_calls == [1]
    torch.testing.assert_close(lse_e, lse_f, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_e, out_f, atol=1e-5, rtol=1e-5)


def test_the_fused_cpu_kernel_is_taken_for_cpu_tensors_only():
    """The fused kernel exists in every torch build, so the device must decide: tensors elsewhere take the
    eager path (a ``meta`` tensor stands in for an accelerator's)."""
    assert attention._has_cpu_flash(torch.zeros(1, 1, 1, 4))
    assert not attention._has_cpu_flash(torch.zeros(1, 1, 1, 4, device="meta"))
