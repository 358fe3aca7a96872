"""The lean decoder's linear layer (model/lean/layers.Linear): a few rows are multiplied as ``W @ x^T`` on a CPU in
float32, for speed; whatever the row count, shape, bias or dtype, it gives what ``F.linear`` gives."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from prefixcache.model.lean.layers import Linear, output_head


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 80), width=st.integers(1, 48), out=st.integers(1, 48), bias=st.booleans(),
       lead=st.sampled_from([(), (1,), (2,)]), seed=st.integers(0, 2**16))
def test_every_row_count_gives_what_f_linear_gives(rows, width, out, bias, lead, seed):
    torch.manual_seed(seed)
    layer = Linear(width, out, bias=bias)
    x = torch.randn(*lead, rows, width)  # [*, M, K]
    got = layer(x)
    assert got.shape == (*lead, rows, out) and got.is_contiguous(), "attention kernels downstream read it as dense"
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_the_transposed_product_serves_few_float32_rows_only(monkeypatch):
    """Which path serves a call (F.linear spied on): a few float32 rows take ``W @ x^T``; one row, many rows and
    bfloat16 take F.linear."""
    from prefixcache.model.lean import layers

    calls: list[int] = []
    linear = F.linear
    monkeypatch.setattr(layers.F, "linear", lambda x, w, b=None: calls.append(x.shape[-2]) or linear(x, w, b))
    torch.manual_seed(0)
    layer = Linear(64, 96)
    for rows in (1, 2, 64, 65, 100):
        layer(torch.randn(rows, 64))
    assert calls == [1, 65, 100], f"rows served by F.linear: {calls}"
    layer.to(torch.bfloat16)(torch.randn(8, 64, dtype=torch.bfloat16))
    assert calls[-1] == 8, "bfloat16 rows take F.linear"
    head = output_head(64, 1000)
    assert head.few_rows == range(2, 33) and head.bias is None
