"""Token choice for generation (``engine/sampling.py``): greedy is argmax, top-p keeps the nucleus, a seeded row
draws the same tokens whatever shares its pass, and recorded log-probs are the raw log-softmax."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from prefixcache.engine.sampling import GREEDY, Sampling, TokenPicker, _nucleus


def test_greedy_is_argmax_and_records_nothing_unless_asked():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    ids, logprobs = TokenPicker(GREEDY, 5, torch.device("cpu")).pick(logits, range(5))
    assert ids.tolist() == logits.argmax(-1).tolist() and logprobs is None


def test_recorded_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    ids, logprobs = TokenPicker(Sampling(top_logprobs=4), 3, torch.device("cpu")).pick(logits, range(3))
    want = torch.log_softmax(logits, -1)
    for row, lp in enumerate(logprobs):
        assert lp.token_id == ids[row] and lp.logprob == pytest.approx(float(want[row].max()), abs=1e-6)
        assert [t for t, _ in lp.top] == want[row].topk(4).indices.tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=2, max_size=30), st.floats(0.01, 1.0))
def test_nucleus_keeps_the_smallest_set_reaching_top_p(weights, top_p):
    probs = torch.tensor(weights, dtype=torch.float64) + 1e-3
    probs = (probs / probs.sum())[None]
    kept = _nucleus(probs.clone(), top_p)[0]
    order = probs[0].argsort(descending=True)
    assert kept[order[0]] > 0, "the most likely token is always kept"
    mass_before = 0.0
    for index in order.tolist():  # kept exactly while the more likely tokens' mass is below top_p
        assert (kept[index] > 0) == (mass_before < top_p), (index, mass_before, top_p)
        mass_before += float(probs[0, index])


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_pass():
    gen = torch.Generator().manual_seed(2)
    steps = [torch.randn(4, 30, generator=gen) for _ in range(6)]
    sampling = Sampling(temperature=1.0, seed=11)
    alone = TokenPicker(sampling, 1, torch.device("cpu"))
    batched = TokenPicker(sampling, 4, torch.device("cpu"))
    for logits in steps:
        one, _ = alone.pick(logits[2:3], [0])
        many, _ = batched.pick(logits, [0, 1, 2, 3])
        assert int(one[0]) == int(many[2])


def test_bad_settings_are_refused():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_logprobs=-1)):
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token():
    probs = torch.softmax(torch.randn(3, 20, generator=torch.Generator().manual_seed(4)), -1)
    kept = _nucleus(probs.clone(), 5e-324)
    assert ((kept > 0).sum(-1) == 1).all() and (kept.argmax(-1) == probs.argmax(-1)).all()


def test_a_tiny_temperature_is_greedy_not_an_overflow():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(3)) * 50
    ids, _ = TokenPicker(Sampling(temperature=5e-324, seed=1), 2, torch.device("cpu")).pick(logits, [0, 1])
    assert ids.tolist() == logits.argmax(-1).tolist()
