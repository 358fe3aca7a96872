"""The label scorer's arithmetic against independent oracles (plain torch on a whole-vocabulary head).

The exactness tests elsewhere compare cached with full re-encoding, and both go through this module, so
a wrong formula here would agree with itself. These tests check each method of ``LabelScorer`` and each
property of ``LabelScores`` against a direct computation, on a head with a bias (the tiny models' heads
have none) and with hidden states of more than two dimensions.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from prefixcache.engine.scoring import LabelScorer, LabelScores

VOCAB, HIDDEN = 11, 6
LABEL_IDS = {"billing": (7, 2), "outage": (3,), "other": (9, 4, 1)}


class HeadModel(torch.nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias)
        if bias:  # large enough that forgetting it changes every answer
            torch.nn.init.uniform_(self.lm_head.bias, -3.0, 3.0)

    def get_output_embeddings(self):
        return self.lm_head


def make_head(bias: bool) -> tuple[HeadModel, LabelScorer]:
    model = HeadModel(bias)
    prompt = SimpleNamespace(label_ids=LABEL_IDS, first_token_ids=lambda: [ids[0] for ids in LABEL_IDS.values()])
    return model, LabelScorer(model, prompt, "first-token")


FIRST = [ids[0] for ids in LABEL_IDS.values()]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_first_token_is_the_label_set_softmax_of_the_label_logits(bias):
    model, head = make_head(bias)
    hidden = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(1))
    want = torch.log_softmax(model.lm_head(hidden)[:, FIRST], dim=-1)
    got = head.first_token(hidden)
    assert got.shape == (4, len(LABEL_IDS))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_vocab_logprobs_normalize_over_the_whole_vocabulary_on_the_last_axis(bias):
    model, head = make_head(bias)
    hidden = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(2))  # [B, T, H]
    want = torch.log_softmax(model.lm_head(hidden), dim=-1)
    got = head.vocab_logprobs(hidden)
    assert got.shape == (2, 3, VOCAB) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_first_step_is_the_vocab_logprob_of_each_labels_first_token(bias):
    model, head = make_head(bias)
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(3))
    want = torch.log_softmax(model.lm_head(hidden), dim=-1)[:, FIRST]
    got = head.first_step(hidden)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got.exp().sum(-1) < 1).all(), "vocab-normalized: the labels do not take all the mass"


def test_normalize_renormalizes_each_row_over_the_label_set():
    logprobs = torch.tensor([[-1.0, -2.0, -4.0], [-9.0, -0.5, -3.0]])
    got = LabelScorer.normalize(logprobs)
    torch.testing.assert_close(got, torch.log_softmax(logprobs, dim=-1))
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(2))


def test_to_scores_keeps_the_label_order_and_every_value():
    _, head = make_head(False)
    rows = torch.tensor([[-0.1, -2.5, -3.0], [-4.0, -0.02, -5.0]], dtype=torch.float32)
    scores = head.to_scores(rows)
    assert [s.labels for s in scores] == [tuple(LABEL_IDS)] * 2
    assert [s.label for s in scores] == ["billing", "outage"]
    for s, row in zip(scores, rows.double()):
        assert s.logprobs == tuple(float(x) for x in row)
        assert all(isinstance(x, float) for x in s.logprobs)


def test_label_scores_best_label_probabilities_and_margin():
    s = LabelScores(("a", "b", "c"), (math.log(0.2), math.log(0.7), math.log(0.1)))
    assert s.best == 1 and s.label == "b"
    assert s.probabilities == pytest.approx({"a": 0.2, "b": 0.7, "c": 0.1}, abs=1e-12)
    assert s.margin == pytest.approx(math.log(0.7) - math.log(0.2), abs=1e-12)
    first = LabelScores(("a", "b"), (-0.1, -3.0))
    assert first.best == 0 and first.label == "a" and first.margin == pytest.approx(2.9)


def test_a_single_label_has_infinite_margin():
    s = LabelScores(("only",), (0.0,))
    assert s.best == 0 and s.label == "only"
    assert s.margin == float("inf")
    assert s.probabilities == {"only": 1.0}


def test_a_head_without_a_bias_attribute_scores_like_a_bias_free_linear():
    """``get_output_embeddings()`` need not be an ``nn.Linear``: a module with only a ``weight`` (no ``bias``
    attribute at all) is a head without bias, not an error."""
    linear, head = make_head(False)

    class WeightOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = linear.lm_head.weight

    bare = SimpleNamespace(get_output_embeddings=lambda: WeightOnly())
    prompt = SimpleNamespace(label_ids=LABEL_IDS, first_token_ids=lambda: FIRST)
    bare_head = LabelScorer(bare, prompt, "first-token")
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(bare_head.first_token(hidden), head.first_token(hidden), atol=1e-6, rtol=0)
    torch.testing.assert_close(bare_head.vocab_logprobs(hidden), head.vocab_logprobs(hidden), atol=1e-6, rtol=0)


@pytest.mark.parametrize("label_pass", ["trie", "per-label"])
def test_the_label_pass_asked_for_is_the_one_kept(label_pass):
    """``engine/forward.py`` routes ``full`` scoring by ``head.label_pass``: a head that lost it would score every
    record label by label (the same numbers, far slower: mutation testing found it unpinned)."""
    model = HeadModel(False)
    prompt = SimpleNamespace(label_ids=LABEL_IDS, first_token_ids=lambda: FIRST)
    assert LabelScorer(model, prompt, "full", label_pass).label_pass == label_pass


def test_an_unknown_label_pass_is_refused_naming_the_choices():
    prompt = SimpleNamespace(label_ids=LABEL_IDS, first_token_ids=lambda: FIRST)
    with pytest.raises(ValueError) as refused:
        LabelScorer(HeadModel(False), prompt, "full", "fast")
    assert str(refused.value) == "label_pass must be one of ('trie', 'per-label'), got 'fast'"


@pytest.mark.parametrize("method", ["auto", "head:last", "first_token"])
def test_a_method_the_head_cannot_score_is_refused_naming_the_choices(method):
    """``auto`` is resolved by the prompt and a fitted head scores on its own: a LabelScorer is only ever made for
    the two ways of scoring the prompt's label tokens, and anything else is a caller's bug, refused at once."""
    prompt = SimpleNamespace(label_ids=LABEL_IDS, first_token_ids=lambda: FIRST)
    with pytest.raises(ValueError) as refused:
        LabelScorer(HeadModel(False), prompt, method)
    assert str(refused.value) == f"method must be one of ('first-token', 'full'), got {method!r}"
