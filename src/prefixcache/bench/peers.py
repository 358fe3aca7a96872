"""Peers: other engines run side by side in ``prefixcache bench``.

Only llama.cpp for now (``pip install 'prefixcache[bench]'``): the same
``.gguf``, the same threads, the same prompt tokens, and its own prefix reuse
(the KV cache is evaluated once for the prefix and truncated back to it before
each record, which is how llama.cpp reuses a shared prompt prefix).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from .lanes import Lane
from ..model.llama_cpp import llama_cpp_problem
from ..model.load import EMBEDDED, embedded_gguf
from ..scheduler.classify import Classifier
from ..task.prompt import Encoded
from ..types import LabelScores, Prediction, Record, RunStats


def open_llama(model_spec: str, threads: int, log: Callable[[str], None]):
    """A ``llama_cpp.Llama`` on ``model_spec``'s ``.gguf`` (4,096-token context, ``threads`` threads), or None
    with a one-line reason logged: llama-cpp-python not installed, no ``.gguf``, or a build that crashes here."""
    try:
        import llama_cpp
    except ImportError:
        log("llama.cpp: skipped (not installed; pip install 'prefixcache[bench]')")
        return None
    if model_spec in EMBEDDED:
        gguf = embedded_gguf(model_spec)
    elif model_spec.endswith(".gguf"):
        gguf = Path(model_spec)
    else:
        log("llama.cpp: skipped (it needs a .gguf model)")
        return None
    problem = llama_cpp_problem(str(gguf), threads)  # the backend's probe decode, in a child process
    if problem:
        log(f"llama.cpp: skipped ({problem})")
        return None
    return llama_cpp.Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512,
                           verbose=False)


def last_logits(llm) -> np.ndarray:
    """The logits after the last evaluated token: a copy, shape [V]."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()


@contextmanager
def record_evaluated(llm, prefix: list[int], encoded: Encoded) -> Iterator[list[int]]:
    """Evaluate one record in ``llm`` after the stored ``prefix`` (llama.cpp's prompt reuse: the KV cache is cut
    back to the prefix first) and yield the tokens evaluated. A record that crosses the prefix boundary is
    evaluated whole, like the record loop's fallback, and the prefix is rebuilt when the block ends."""
    crosses = encoded.suffix_ids is None
    if crosses:
        llm.reset()
        rows = list(encoded.full_ids)
    else:
        llm.n_tokens = len(prefix)  # eval() drops everything after the prefix
        rows = list(encoded.suffix_ids)
    llm.eval(rows)
    try:
        yield rows
    finally:
        if crosses:
            llm.reset()
            llm.eval(prefix)


def llama_cpp_lane(model_spec: str, classifier: Classifier, threads: int, log: Callable[[str], None]) -> Lane | None:
    """A lane scoring first-token labels with llama-cpp-python, or None (with a one-line reason)."""
    llm = open_llama(model_spec, threads, log)
    if llm is None:
        return None
    prompt = classifier.prompt
    first = prompt.first_token_ids()
    labels = tuple(prompt.label_ids)
    prefix = list(prompt.prefix_ids)

    def warm() -> None:
        llm.reset()
        llm.eval(prefix)  # the shared prefix, once, like our prefix build

    def run(records: list[Record]) -> tuple[list[Prediction], RunStats]:
        stats = RunStats()
        texts = [prompt.suffix_text(r.fields, r.id) for r in records]
        predictions = []
        for record, encoded in zip(records, prompt.encode(classifier.loaded.tokenizer, texts)):
            with record_evaluated(llm, prefix, encoded) as rows:
                logits = torch.from_numpy(last_logits(llm)).double()  # [V], last token
            logprobs = torch.log_softmax(logits[first], dim=-1)
            predictions.append(Prediction(record.id, LabelScores(labels, tuple(float(x) for x in logprobs))))
            stats.tokens_computed += len(rows)
        return predictions, stats

    return Lane("llama.cpp", "gguf", 1, run, warm=warm)
