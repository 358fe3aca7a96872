"""llama.cpp as a generation peer in ``prefixcache bench --task <extraction task>``.

The same ``.gguf``, threads and prompt tokens as the extraction lanes, one record at a time (B = 1), with
llama.cpp's own prefix reuse: the prefix is evaluated once, and before each record the KV cache is cut back to
it (a record that crosses the prefix boundary is evaluated whole, then the prefix is rebuilt). Decoding is
greedy (the argmax of llama.cpp's logits), and a row ends exactly as our decoder's rows do (the same
:class:`~prefixcache.engine.generate.RowOutput`): an end-of-sequence token, a stop string, or ``max_new_tokens``.

It decodes *freely*: llama.cpp's grammars are another constraint engine, so the fair comparison of its text is
with the bench's ``batched-unconstrained`` lane. Its weights are Q4_1 blocks and its activations are quantized
for the dot products, so its text may differ from ours where greedy decoding meets a near tie.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from ..engine.generate import Generation, GenerationConfig, RowOutput
from ..scheduler.extract import Extraction, ExtractStats, Extractor
from ..types import Record
from .peers import last_logits, open_llama, record_evaluated

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
        prompt, tokenizer = self._extractor.prompt, self._extractor.loaded.tokenizer
        stats, outputs = ExtractStats(), []
        texts = [prompt.suffix_text(r.fields, r.id) for r in records]
        for record, encoded in zip(records, prompt.encode(tokenizer, texts)):
            started = time.perf_counter()
            with record_evaluated(self._llm, self._prefix, encoded) as rows:
                generation, first_token_s = _greedy(self._llm, tokenizer, self._extractor.generation)
            stats.first_token_s.append(first_token_s - started)
            stats.prefill_tokens += len(rows)
            stats.tokens_generated += len(generation.token_ids)
            output = self._extractor.extraction_of(record.id, generation, encoded.suffix_ids is None)
            stats.parse_errors += output.error is not None
            outputs.append(output)
        return outputs, stats


def _greedy(llm, tokenizer, config: GenerationConfig) -> tuple[Generation, float]:
    """Decode greedily after the evaluated prompt, a row ending as :func:`~prefixcache.engine.generate.generate_rows`'
    rows do (:class:`~prefixcache.engine.generate.RowOutput`): the generation and the perf_counter of its first token."""
    row = RowOutput(tokenizer)
    first_token_s = 0.0
    while True:
        token = int(np.argmax(last_logits(llm)))
        first_token_s = first_token_s or time.perf_counter()
        if row.add(token, None, tokenizer, config, None, 0, None):
            return row.generation, first_token_s
        llm.eval([token])
