"""``score_rows`` routes each batch to the pass its head asks for.

The passes themselves are checked against full re-encoding elsewhere; every pass gives the same numbers
(to rounding), so a wrong route is invisible to those tests: only speed, or the reference path silently not
being the reference, would change. Here each pass is replaced by a recorder.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from prefixcache.engine import forward

PREFIX = object()  # score_rows hands it on untouched


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """Each replaced pass appends its name; the whole-label passes return a fixed [B, L] tensor."""
    seen: list[str] = []

    def whole(name):
        def run(model, prefix, rows, head):
            assert prefix is PREFIX
            seen.append(name)
            return torch.zeros(len(rows), 2)
        return run

    def packed(model, prefix, rows):
        seen.append("packed")
        return torch.zeros(len(rows), 4)

    def padded(model, prefix, rows):
        seen.append("padded")
        return SimpleNamespace(last=torch.zeros(len(rows), 4))

    monkeypatch.setattr(forward, "score_whole_labels", whole("trie"))
    monkeypatch.setattr(forward, "score_per_label", whole("per-label"))
    monkeypatch.setattr(forward, "last_hidden_packed", packed)
    monkeypatch.setattr(forward, "run_padded", padded)
    return seen


def _head(method: str, label_pass: str = "trie"):
    return SimpleNamespace(method=method, label_pass=label_pass, first_token=lambda hidden: hidden[:, :2])


@pytest.mark.parametrize("label_pass", ["trie", "per-label"])
def test_whole_labels_take_the_label_pass_the_head_names(calls, label_pass):
    out = forward.score_rows(None, PREFIX, [[1, 2], [3]], _head("full", label_pass))
    assert calls == [label_pass]
    assert out.shape == (2, 2)


@pytest.mark.parametrize(("rows", "expected"), [([[1, 2], [3]], "packed"), ([[1, 2], [3, 4]], "padded"), ([[5]], "padded")])
def test_first_token_packs_rows_of_unequal_length_and_pads_rows_of_one(calls, rows, expected):
    """Rows of one length have no padding to save, so they run padded (the cheaper layout for them)."""
    out = forward.score_rows(None, PREFIX, rows, _head("first-token"))
    assert calls == [expected]
    assert out.shape == (len(rows), 2)
