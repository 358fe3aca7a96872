"""The tuning loop over any body (``tune_body``): what it trains beneath the joint head need not be a prefix. A body of
one per-width gain on the final states (tiny random Llama, float32) is trained, left at its best epoch's values,
and its prefix is what the head carries; a run is repeatable for a seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixcache.cache.kv import PrefixKV
from prefixcache.engine.rows import packed_last_states
from prefixcache.engine.scoring import LabelScorer
from prefixcache.eval.tune_config import TuneConfig
from prefixcache.eval.tune_prefix import Hooks, PrefixBody, start_prefix, tune_body
from prefixcache.scheduler.feature_pass import own_rows
from tests.eval.test_tune_prefix import labelled
from tests.support.tasks import LABELS

CONFIG = TuneConfig(epochs=6, lr=5e-2, head_lr=1e-2, batch_size=8, patience=6)


class GainBody:
    """Final states times a trainable gain ``[H]`` (starting at one), after a fixed prefix."""

    def __init__(self, loaded, prefix: PrefixKV):
        self.model = loaded.model
        self.prefix = PrefixKV(prefix.token_ids, tuple(k.clone() for k in prefix.keys), tuple(v.clone() for v in prefix.values))
        self.gain = torch.ones(loaded.config.hidden_size, requires_grad=True)
        self.tensors = [self.gain]

    def states(self, rows):
        return packed_last_states(self.model, self.prefix, rows) * self.gain

    def carried(self) -> PrefixKV:
        return self.prefix


def rows_and_gold(loaded, task, count: int, seed: int):
    records = labelled(count, seed)
    own = own_rows(loaded, task, records)
    return own, np.array([LABELS.index(r.fields["label"]) for r in records])


def tune_gain(loaded, task):
    """A gain body tuned on 60 rows, and a copy of its gain after each epoch."""
    own, gold = rows_and_gold(loaded, task, 60, seed=0)
    body = GainBody(loaded, start_prefix(loaded, own.prompt.prefix_ids, None))
    scorer = LabelScorer(loaded.model, own.prompt, "first-token")
    seen = []
    tuned = tune_body(scorer, body, own.rows, gold, CONFIG, Hooks(on_epoch=lambda e: seen.append(body.gain.detach().clone())))
    return body, tuned, seen


@pytest.fixture(scope="module")
def gain_run(tiny_llama, task):
    return tune_gain(tiny_llama, task)


def test_the_bodys_tensors_are_trained_and_left_at_the_best_epoch(gain_run):
    body, tuned, seen = gain_run
    assert len(seen) == len(tuned.epochs) == CONFIG.epochs, "an epoch was skipped or stopped early with patience 6"
    assert not torch.equal(seen[0], torch.ones_like(seen[0])), "the first epoch did not move the body's tensor"
    best = seen[tuned.best_epoch - 1]
    assert torch.equal(body.gain.detach(), best), (
        f"the body holds another epoch's values than the best ({tuned.best_epoch} of {len(seen)})")
    assert tuned.heldout_accuracy >= tuned.start_accuracy, (tuned.heldout_accuracy, tuned.start_accuracy)


def test_the_head_carries_the_bodys_prefix_and_the_heldout_figures(gain_run):
    body, tuned, _ = gain_run
    assert tuned.head.prefix is not None and tuned.head.prefix.checksum() == body.prefix.checksum()
    assert len(tuned.heldout) == len(tuned.correct) == round(CONFIG.holdout * 60)
    assert tuned.seconds >= tuned.epochs[-1].seconds > 0


def test_a_run_is_repeatable_for_a_seed(tiny_llama, task, gain_run):
    _, again, _ = tune_gain(tiny_llama, task)
    _, first, _ = gain_run
    assert np.array_equal(np.asarray(first.head.weight), np.asarray(again.head.weight))
    assert [e.train_loss for e in first.epochs] == [e.train_loss for e in again.epochs]


def test_a_prefix_body_trains_the_prefix_leaves_and_never_the_model(tiny_llama, task):
    own, gold = rows_and_gold(tiny_llama, task, 24, seed=1)
    start = start_prefix(tiny_llama, own.prompt.prefix_ids, None)
    weights = {name: p.detach().clone() for name, p in tiny_llama.model.named_parameters()}
    body = PrefixBody(tiny_llama, start)
    assert body.tensors == [*body.keys, *body.values] and all(t.requires_grad for t in body.tensors)
    scorer = LabelScorer(tiny_llama.model, own.prompt, "first-token")
    tuned = tune_body(scorer, body, own.rows, gold, TuneConfig(epochs=1, batch_size=8))
    assert tuned.head.prefix.checksum() == body.carried().checksum() != start.checksum()
    assert all(torch.equal(p, weights[name]) for name, p in tiny_llama.model.named_parameters()), "a weight moved"
