"""llama.cpp as a generation peer in ``prefixcache bench --task <extraction task>``.

The same ``.gguf``, threads and prompt tokens as the extraction lanes, one record at a time (B = 1), with
llama.cpp's own prefix reuse: the prefix is evaluated once, and before each record the KV cache is cut back to
it (a record that crosses the prefix boundary is evaluated whole, then the prefix is rebuilt). Decoding is
greedy (the argmax of llama.cpp's logits), and a row ends exactly as in
:func:`~prefixcache.engine.generate.finish_of`: an end-of-sequence token, a stop string, or ``max_new_tokens``.

It decodes *freely*: llama.cpp's grammars are another constraint engine, so the fair comparison of its text is
with the bench's ``batched-unconstrained`` lane. Its weights are Q4_1 blocks and its activations are quantized
for the dot products, so its text may differ from ours where greedy decoding meets a near tie.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from ..engine.generate import Generation, GenerationConfig, finish_of
from ..run.extract import Extraction, ExtractStats, Extractor
from ..types import Record
from .peers import last_logits, open_llama

LLAMA_CPP = "llama.cpp"


def llama_cpp_generate(model_spec: str, extractor: Extractor, threads: int, log: Callable[[str], None]) -> LlamaCppGenerator | None:
    """A :class:`LlamaCppGenerator` for ``extractor``'s task, or None when llama.cpp cannot run here (the reason
    is logged)."""
    llm = open_llama(model_spec, threads, log)
    return None if llm is None else LlamaCppGenerator(llm, extractor)


class LlamaCppGenerator:
    """Extraction by llama-cpp-python: ``generator(records)`` -> (outputs in input order, the lane's stats).

    ``weight_bytes`` is the size of the ``.gguf`` it reads (its B=1 decoding floor's denominator).
    """

    def __init__(self, llm, extractor: Extractor):
        self._llm, self._extractor = llm, extractor
        self._prefix = list(extractor.prompt.prefix_ids)
        self.weight_bytes = os.path.getsize(llm.model_path)
        llm.reset()
        llm.eval(self._prefix)  # the shared prefix, once, like our prefix build

    def __call__(self, records: list[Record]) -> tuple[list[Extraction], ExtractStats]:
        llm, prompt, tokenizer = self._llm, self._extractor.prompt, self._extractor.loaded.tokenizer
        stats, outputs = ExtractStats(), []
        texts = [prompt.suffix_text(r.fields, r.id) for r in records]
        for record, encoded in zip(records, prompt.encode(tokenizer, texts)):
            started = time.perf_counter()
            crosses = encoded.suffix_ids is None
            if crosses:
                llm.reset()
                rows = list(encoded.full_ids)
            else:
                llm.n_tokens = len(self._prefix)  # reuse the prefix; eval() drops everything after it
                rows = list(encoded.suffix_ids)
            llm.eval(rows)
            token_ids, text, finish, first_token_s = _greedy(llm, tokenizer, self._extractor.generation)
            stats.first_token_s.append(first_token_s - started)
            stats.prefill_tokens += len(rows)
            stats.tokens_generated += len(token_ids)
            output = self._extractor.extraction_of(record.id, Generation(tuple(token_ids), text, finish), crosses)
            stats.parse_errors += output.error is not None
            outputs.append(output)
            if crosses:
                llm.reset()
                llm.eval(self._prefix)
        return outputs, stats


def _greedy(llm, tokenizer, config: GenerationConfig) -> tuple[list[int], str, str, float]:
    """Decode greedily after the evaluated prompt: (token ids, text, finish, perf_counter of the first token)."""
    token_ids: list[int] = []
    first_token_s = 0.0
    while True:
        token_ids.append(int(np.argmax(last_logits(llm))))
        first_token_s = first_token_s or time.perf_counter()
        text, finish = finish_of(tokenizer, token_ids, config)
        if finish is not None:
            return token_ids, text, finish, first_token_s
        llm.eval([token_ids[-1]])
