"""The compiled MLP and norms (prefixcache.compiled): the same labels and scores as eager, by call size.

Compiling takes ~10 s on the tiny model, so one module-scoped model is compiled once.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from prefixcache.compiled import BySize, compile_layers
from prefixcache.runner import Classifier, Record, RunConfig

from conftest import LABELS, TEXTS, tiny_loaded


def test_by_size_picks_the_form_by_tokens_in_the_call():
    calls = []
    pick = BySize(lambda x: calls.append("eager") or x, lambda x: calls.append("compiled") or x, min_tokens=16)
    pick(torch.zeros(1, 15, 4))  # 15 tokens
    pick(torch.zeros(2, 8, 4))  # 16 tokens over two rows
    pick(torch.zeros(40, 4))  # 40 tokens, no batch dimension
    assert calls == ["eager", "compiled", "compiled"]


@pytest.fixture(scope="module")
def eager_and_compiled(task):
    eager = Classifier(tiny_loaded("llama"), task)
    compiled_model = tiny_loaded("llama")  # same seed: the same weights
    changed = compile_layers(compiled_model.model, min_tokens=16)
    return eager, Classifier(compiled_model, task), changed


def test_every_layers_mlp_and_norms_get_a_compiled_form_once(eager_and_compiled):
    _, compiled, changed = eager_and_compiled
    layers = compiled.loaded.model.config.num_hidden_layers
    assert changed == 3 * layers
    assert compile_layers(compiled.loaded.model) == 0, "idempotent"
    assert all(isinstance(layer.mlp.forward, BySize) for layer in compiled.loaded.model.base_model.layers)


@pytest.mark.parametrize("mode, batch", [("batched", 8), ("cached", 1), ("full", 1)])
def test_compiled_layers_score_like_eager(eager_and_compiled, mode, batch):
    """Batched passes (>= 16 tokens) and the prefix build run compiled, single short rows eager; in float32
    every label is the same and every log-prob within rounding of the eager model's."""
    eager, compiled, _ = eager_and_compiled
    records = [Record(i, {"text": t}) for i, t in enumerate(TEXTS * 2)]
    expected = eager.classify_all(records, RunConfig(mode, batch))
    got = compiled.classify_all(records, RunConfig(mode, batch))
    assert [p.scores.label for p in got] == [p.scores.label for p in expected]
    assert counters["stats"]["calls_captured"] > 0, "the compiled form must really have run"
    for a, b in zip(got, expected):
        assert a.scores.labels == tuple(LABELS)
        assert max(abs(x - y) for x, y in zip(a.scores.logprobs, b.scores.logprobs)) < 1e-4
