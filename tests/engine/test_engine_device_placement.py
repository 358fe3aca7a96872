"""Every tensor the scoring path makes is made on the model's device (or on the CPU on purpose), never on
torch's *default* device.

This is how a CPU-only suite checks device placement. With ``torch.device("meta")`` as the default, a
tensor made without a device lands on ``meta``: it holds no data, so it either meets a CPU tensor and
raises, or carries no numbers to the end (``Cannot copy out of meta tensor``). Code that names its
device is unaffected and must give exactly the scores of a plain run. On an accelerator the same slip
would put an index or mask on the CPU beside GPU weights; a user who calls ``torch.set_default_device``
would meet it on any machine. Mutation testing found many such slips uncaught (``device=`` dropped).
"""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache.kv import PrefixKV
from prefixcache.scheduler.classify import Classifier, RunConfig, records_from_texts

# unequal lengths (packed rows), and equal ones at batch 1 and in the full re-encode
TEXTS = ["refund please", "my card was charged twice for one order", "hi", "ok", "the app crashes on login"]


def _scores(loaded, task, method, label_pass, mode, batch):
    classifier = Classifier(loaded, task, method=method, label_pass=label_pass)
    predictions = classifier.classify_all(records_from_texts(TEXTS), RunConfig(mode, batch))
    assert all(p.error is None for p in predictions), [p.error for p in predictions]
    return [p.scores.logprobs for p in predictions]


@pytest.mark.parametrize(
    ("method", "label_pass"), [("first-token", "trie"), ("full", "trie"), ("full", "per-label")]
)
@pytest.mark.parametrize(("mode", "batch"), [("batched", 4), ("batched", 1), ("cached", 1), ("full", 2)])
def test_scores_are_the_same_with_meta_as_torchs_default_device(tiny, task, method, label_pass, mode, batch):
    expected = _scores(tiny, task, method, label_pass, mode, batch)
    with torch.device("meta"):
        got = _scores(tiny, task, method, label_pass, mode, batch)
    assert got == expected


def test_a_prefix_is_built_and_extended_on_the_models_device(tiny):
    ids = tiny.tokenizer.encode("you route tickets to a team")
    whole = PrefixKV.build(tiny.model, ids)
    with torch.device("meta"):
        built = PrefixKV.build(tiny.model, ids[:3]).extend(tiny.model, ids[3:])
    assert {t.device.type for t in (*built.keys, *built.values)} == {"cpu"}
    for a, b in zip((*built.keys, *built.values), (*whole.keys, *whole.values)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
