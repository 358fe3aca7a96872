"""The llama.cpp generation lane (bench/peer_extract.py), run on a stand-in for ``llama_cpp.Llama``.

llama-cpp-python is not installed in CI (it is the optional ``bench`` extra), so :class:`FakeLlama` gives
the lane the slice of its interface it uses (``reset``, ``eval``, ``n_tokens``, the last token's logits,
``model_path``) over a tiny random model: every ``eval`` runs the model over everything evaluated so far.
The lane's prefix reuse, boundary fallback, greedy loop and stop rules must then give, token for token, the
output of our own free decoding in full mode, and count its work truthfully. With llama-cpp-python absent,
the bench must say why the lane is skipped and run the others.
"""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from prefixcache.bench.extract_lanes import STATIC, UNCONSTRAINED, bench_extract
from prefixcache.bench.peer_extract import LLAMA_CPP, LlamaCppGenerator, llama_cpp_generate
from prefixcache.scheduler.extract import Extractor
from prefixcache.task.definition import parse_task
from prefixcache.types import Record, RunConfig

from tests.support.tasks import EXTRACT_YAML, TEXTS

# "Ticket: pass" + "word..." re-tokenizes as " password" for the tiny BPE (see test_task_prompt.py), so these
# records cross the prefix boundary and must be evaluated whole.
CROSSING = ["word reset mail never arrives", "words"]


class FakeLlama:
    """``llama_cpp.Llama``'s evaluation interface over a Hugging Face model, recomputed from scratch on every eval."""

    def __init__(self, loaded, model_path: str):
        self._model = loaded.model
        self.model_path = model_path
        self._ctx = self  # the lane reads logits through llm._ctx.get_logits(), as llama-cpp-python exposes them
        self.tokens: list[int] = []
        self.evaluated = 0  # tokens passed to eval(): what the lane made llama.cpp compute
        self._buffer = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @n_tokens.setter
    def n_tokens(self, value: int) -> None:
        self.tokens = self.tokens[:value]

    def n_vocab(self) -> int:
        return self._model.get_output_embeddings().out_features

    def reset(self) -> None:
        self.tokens = []

    def eval(self, ids) -> None:
        self.tokens += list(ids)
        self.evaluated += len(ids)
        with torch.no_grad():
            logits = self._model(input_ids=torch.tensor([self.tokens])).logits[0, -1].float()  # [V]
        self._buffer = (ctypes.c_float * len(logits))(*logits.tolist())

    def get_logits(self):
        return ctypes.cast(self._buffer, ctypes.POINTER(ctypes.c_float))


def _extractor(loaded, template: str = "Ticket: {text}") -> Extractor:
    yaml = EXTRACT_YAML.replace('input_template: "Ticket: {text}"', f'input_template: "{template}"')
    return Extractor(loaded, parse_task(yaml, "tiny-fields.yaml", kinds=("extract",)), constrained=False)


def _records(texts) -> list[Record]:
    return [Record(f"r{i}", {"text": text}) for i, text in enumerate(texts)]


@pytest.mark.slow
def test_the_lane_generates_what_our_free_full_decoding_generates(tiny_llama, tmp_path):
    extractor = _extractor(tiny_llama)
    records = _records(TEXTS)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x" * 1234)
    llm = FakeLlama(tiny_llama, str(gguf))
    generator = LlamaCppGenerator(llm, extractor)
    prefix = len(extractor.prompt.prefix_ids)
    assert generator.weight_bytes == 1234 and llm.evaluated == prefix  # the prefix, once, at construction
    outputs, stats = generator(records)
    reference = extractor.extract_all(records, RunConfig("full", 1))
    assert [o.id for o in outputs] == [r.id for r in records]
    for mine, theirs in zip(outputs, reference):
        assert mine.token_ids == theirs.token_ids, f"{mine.id}: {mine.token_ids} != {theirs.token_ids}"
        assert (mine.raw, mine.finish, mine.fields, mine.error) == (theirs.raw, theirs.finish, theirs.fields, theirs.error)
    suffixes = [e.suffix_ids for e in extractor.prompt.encode(tiny_llama.tokenizer,
                                                                [extractor.prompt.suffix_text(r.fields) for r in records])]
    assert all(s is not None for s in suffixes) and not any(o.boundary_fallback for o in outputs)
    # the prefix was reused: each record computed only its own tokens, then one step per token but the last
    assert stats.prefill_tokens == sum(len(s) for s in suffixes)
    assert stats.tokens_generated == sum(len(o.token_ids) for o in outputs)
    assert llm.evaluated == prefix + stats.prefill_tokens + stats.tokens_generated - len(records)
    assert len(stats.first_token_s) == len(records) and all(s > 0 for s in stats.first_token_s)
    assert stats.parse_errors == sum(o.error is not None for o in outputs)


@pytest.mark.slow
def test_a_record_crossing_the_boundary_is_evaluated_whole_and_the_prefix_comes_back(tiny_llama, tmp_path):
    extractor = _extractor(tiny_llama, "Ticket: pass{text}")
    texts = [CROSSING[0], " reset mail never arrives", CROSSING[1], "1234 failed twice"]
    records = _records(texts)
    encoded = extractor.prompt.encode(tiny_llama.tokenizer, [extractor.prompt.suffix_text(r.fields) for r in records])
    assert [e.suffix_ids is None for e in encoded] == [True, False, True, False]
    (tmp_path / "m.gguf").write_bytes(b"")
    outputs, stats = LlamaCppGenerator(FakeLlama(tiny_llama, str(tmp_path / "m.gguf")), extractor)(records)
    assert [o.boundary_fallback for o in outputs] == [True, False, True, False]
    reference = extractor.extract_all(records, RunConfig("full", 1))
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert stats.prefill_tokens == sum(len(e.full_ids if e.suffix_ids is None else e.suffix_ids) for e in encoded)


@pytest.mark.slow
def test_the_bench_adds_the_lane_and_compares_it_with_free_decoding(tiny_llama, tmp_path):
    extractor = _extractor(tiny_llama)
    task = extractor.task
    (tmp_path / "m.gguf").write_bytes(b"")
    peer = LlamaCppGenerator(FakeLlama(tiny_llama, str(tmp_path / "m.gguf")), extractor)
    lanes = bench_extract(Extractor(tiny_llama, task), _records(TEXTS[:4]), 4, log=lambda _: None,
                          free=Extractor(tiny_llama, task, constrained=False), peer=peer)
    assert [lane.mode for lane in lanes] == ["full", "cached", "batched", "cached-stepwise", UNCONSTRAINED, STATIC,
                                                LLAMA_CPP]
    lane = lanes[-1]
    assert (lane.batch_size, lane.records, lane.constrained) == (1, 4, False)
    assert lane.identical == 1.0  # the same greedy text as our own free decoding
    assert lane.tokens_generated > 0 and lane.tokens_per_s > 0


def test_without_llama_cpp_python_the_lane_is_skipped_with_its_reason(tiny_llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    said = []
    assert llama_cpp_generate("smollm2-135m", _extractor(tiny_llama), 1, said.append) is None
    assert said == ["llama.cpp: skipped (not installed; pip install 'prefixcache[bench]')"]


@pytest.mark.parametrize("spec", ["some-org/some-model", "/models/folder"])
def test_a_model_that_is_not_a_gguf_is_skipped_with_its_reason(tiny_llama, monkeypatch, spec):
    monkeypatch.setitem(sys.modules, "llama_cpp", object())
    said = []
    assert llama_cpp_generate(spec, _extractor(tiny_llama), 1, said.append) is None
    assert said == ["llama.cpp: skipped (it needs a .gguf model)"]
