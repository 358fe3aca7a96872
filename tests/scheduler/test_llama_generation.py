"""The llama.cpp generation backend's bookkeeping (scheduler/llama_generation.py), on a stand-in context.

:class:`CellsModel` stands in for :class:`~prefixcache.model.llama_cpp.LlamaCpp`: its cells are each sequence's
tokens by position, a copied sequence shares its source's tokens, and its logits are the tiny torch model's over a
sequence's whole tokens. So the engine loop over :class:`LlamaGeneration` must generate exactly what torch's
backend generates for each row alone: a row reads its prefix's holder, then its own tokens at the next positions.
The native library is not needed here (tests/model/test_llama_cpp.py runs the real one).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from prefixcache.cache.kv import PrefixKV
from prefixcache.cache.slots import Feed
from prefixcache.engine.generate import Decoding, GenerationConfig, eos_ids_of, generate_rows
from prefixcache.errors import BackendError, SequenceTooLongError
from prefixcache.model.llama_cpp import ContextShape
from prefixcache.scheduler.backend_choice import choose
from prefixcache.scheduler.engine_loop import EngineLoop, LoopConfig
from prefixcache.scheduler.llama_generation import LlamaGeneration
from prefixcache.scheduler.sequence import Generate, Sequence, Status

from tests.support.models import tiny_loaded

LOADED = tiny_loaded("llama")
PREFIXES = [PrefixKV.build(LOADED.model, list(range(5, 25))), PrefixKV.build(LOADED.model, list(range(40, 47)))]
CONFIG = GenerationConfig(6, (), eos_ids_of(LOADED.model, LOADED.tokenizer))


class CellsModel:
    """A stand-in llama.cpp context: per sequence its tokens by position; logits from the tiny torch model."""

    def __init__(self, shape: ContextShape):
        self.shape, self.vocab = shape, LOADED.model.get_output_embeddings().weight.shape[0]
        self.cells: dict[int, list[int]] = {}
        self.batches: list[int] = []  # tokens per decode call
        self.decoded: dict[int, int] = {}  # sequence id -> tokens decoded into it

    def decode(self, tokens, positions, seq_ids, outputs):
        assert 0 < len(tokens) <= self.shape.batch, "a batch within the context's batch size"
        self.batches.append(len(tokens))
        wanted = []
        for i, (token, pos, seq) in enumerate(zip(tokens, positions, seq_ids)):
            cells = self.cells.setdefault(seq, [])
            assert pos == len(cells), f"sequence {seq} fed position {pos} after {len(cells)} tokens"
            cells.append(token)
            self.decoded[seq] = self.decoded.get(seq, 0) + 1
            if i in outputs:
                wanted.append(list(cells))
        with torch.inference_mode():
            return torch.stack([LOADED.model(torch.tensor([ids])).logits[0, -1] for ids in wanted]).numpy() \
                if wanted else torch.zeros(0, self.vocab).numpy()

    def copy_sequence(self, source, target):
        assert not self.cells.get(target), "a row is copied into only when it is empty"
        self.cells[target] = list(self.cells[source])

    def drop_sequence(self, seq):
        self.cells.pop(seq, None)


def _backend(cells=4096, rows=4, holders=2, batch=64) -> LlamaGeneration:
    return LlamaGeneration(CellsModel(ContextShape(cells, rows + holders, batch, 1)), rows)


def _alone(prefix: PrefixKV, ids: list[int]):
    return generate_rows(LOADED.model, LOADED.tokenizer, prefix, [ids], Decoding(CONFIG))[0][0]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 1), st.lists(st.integers(3, 120), min_size=1, max_size=9)),
                min_size=1, max_size=7), st.integers(1, 24))
def test_rows_on_the_backend_generate_what_each_generates_alone(rows, step_tokens):
    backend = _backend(batch=16)
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(step_tokens, 3), generation=backend)
    seqs = [Sequence(PREFIXES[p], ids, Generate(CONFIG)) for p, ids in rows]
    loop.run_until_done(seqs)
    for seq, (p, ids) in zip(seqs, rows):
        assert seq.status == Status.FINISHED, seq.error
        want = _alone(PREFIXES[p], ids)
        assert (seq.result.token_ids, seq.result.text) == (want.token_ids, want.text)
    assert not backend.reserved and set(backend.llama.cells) <= set(backend.holders.values()), "rows all given back"


def test_a_prefix_is_decoded_once_into_its_holder_and_shared_by_its_rows():
    backend = _backend()
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(64, 4), generation=backend)
    seqs = [Sequence(PREFIXES[0], [7 + i, 9], Generate(CONFIG)) for i in range(6)]
    loop.run_until_done(seqs)
    loop.run_until_done(more := [Sequence(PREFIXES[0], [8], Generate(CONFIG))])  # a later run, same prefix
    holder = backend.holders[PREFIXES[0].token_ids, None]  # no prefill: a holder is found by its tokens
    assert backend.llama.decoded[holder] == PREFIXES[0].length, "the prefix's tokens were decoded once, into it"
    own = sum(len(s.ids) + len(s.generated) - 1 for s in seqs + more)  # each row feeds all but its last token
    assert backend.tokens_decoded == PREFIXES[0].length + own, "rows decode only their own tokens"


def test_an_unread_holder_is_dropped_when_a_new_prefix_needs_its_cells():
    backend = _backend(cells=PREFIXES[0].length + 8, rows=1, holders=2)
    first = Sequence(PREFIXES[0], [7], Generate(GenerationConfig(2, (), ())))
    assert backend.take(first) == 0
    backend.give(0)
    second = Sequence(PREFIXES[1], [8, 9], Generate(GenerationConfig(4, (), ())))
    assert backend.take(second) == 0
    assert list(backend.holders) == [(PREFIXES[1].token_ids, None)], "the first prefix's holder made room"
    assert backend.cells_used == PREFIXES[1].length + second.own_tokens


def test_a_row_waits_while_the_cells_are_taken_and_one_that_can_never_fit_fails_alone():
    backend = _backend(cells=PREFIXES[1].length + 16, rows=2)
    long = GenerationConfig(12, (), ())
    assert backend.take(Sequence(PREFIXES[1], [5], Generate(long))) == 0
    assert backend.take(Sequence(PREFIXES[1], [6], Generate(long))) is None, "no cells left: it waits"
    with pytest.raises(SequenceTooLongError, match="do not fit llama.cpp's 23-cell context"):
        backend.take(Sequence(PREFIXES[1], [6] * 10, Generate(long)))
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(64, 2), generation=_backend(cells=40, rows=2))
    too_long, fine = (Sequence(PREFIXES[0], ids, Generate(long)) for ids in ([5] * 15, [5]))
    loop.run_until_done([too_long, fine])
    assert too_long.status == Status.FAILED and isinstance(too_long.failure, SequenceTooLongError)
    assert fine.status == Status.FINISHED, "the one that fits runs"


def test_a_cancelled_row_gives_its_cells_back():
    backend = _backend()
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(64, 4), generation=backend)
    seq = Sequence(PREFIXES[0], [5, 6], Generate(GenerationConfig(50, (), ())))
    loop.add(seq)
    loop.step()
    assert backend.reserved and seq.slot in backend.llama.cells
    seq.cancel()
    loop.step()
    assert seq.status == Status.CANCELLED and not backend.reserved and 0 not in backend.llama.cells


def test_a_step_longer_than_the_context_batch_is_decoded_in_batches():
    backend = _backend(batch=8)
    backend.take(Sequence(PREFIXES[1], list(range(3, 23)), Generate(CONFIG)))
    logits = backend.feed(PREFIXES[1], [Feed(0, 0, tuple(range(3, 23)))])
    assert max(backend.llama.batches) <= 8 and len(logits) == 1 and logits[0].shape == (backend.llama.vocab,)


def test_feeding_a_row_not_taken_is_refused():
    with pytest.raises(ValueError, match="row 1 is not taken"):
        _backend().feed(PREFIXES[0], [Feed(1, 0, (5,))])


def test_the_choice_names_why():
    assert choose(LOADED, "torch").name == "torch"
    assert choose(LOADED, "auto").name == "torch" and ".gguf" in choose(LOADED, "auto").why
    with pytest.raises(BackendError, match="cannot run this: llama.cpp reads a .gguf model"):
        choose(LOADED, "llama.cpp")
    with pytest.raises(BackendError, match="backend must be one of auto, torch, llama.cpp"):
        choose(LOADED, "ggml")
    assert choose(LOADED, "auto", needs_torch="fitted field heads read the prompt state").why == "fitted field heads read the prompt state"


def test_auto_follows_the_measured_rule(monkeypatch):
    import prefixcache.scheduler.backend_choice as backend_choice

    probed = []
    monkeypatch.setattr(backend_choice, "_llama_problem", lambda loaded: probed.append(loaded) or None)
    monkeypatch.setattr(backend_choice, "cpu_has_fast_bf16", lambda: True)
    bf16 = dataclasses.replace(LOADED, dtype=torch.bfloat16)
    assert choose(bf16, "auto", rows=1).name == "llama.cpp", "one row at a time: llama.cpp"
    assert choose(bf16, "auto", rows=32).name == "torch", "bfloat16 batches: torch"
    assert len(probed) == 1, "no probe decode where torch wins anyway"
    assert choose(LOADED, "auto", rows=32).name == "llama.cpp", "float32 weights: llama.cpp at any batch"
    monkeypatch.setattr(backend_choice, "cpu_has_fast_bf16", lambda: False)
    assert choose(bf16, "auto", rows=32).name == "llama.cpp", "no native bfloat16: llama.cpp"
    assert choose(bf16, "llama.cpp", rows=32).name == "llama.cpp"
