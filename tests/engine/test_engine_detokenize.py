"""engine/detokenize.py and the decoding loop's use of it: text built token by token equals decoding the
whole sequence, stop strings are seen on the token that completes them, and a row's output is decoded
whole once (when it finishes), not after every token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from prefixcache.engine.detokenize import IncrementalText
from prefixcache.engine.generate import Decoding, GenerationConfig, generate_rows
from prefixcache.scheduler.extract import Extractor

from tests.support.models import make_tokenizer
from tests.support.tasks import TEXTS

TOKENIZER = make_tokenizer()
SAMPLES = ["Why was my card billed $49.99 on March 3rd?", "ça coûte 12 € — 日本語 😀", '{"a": [1, 2]}\n\n  x']


class _SlowOnly:
    """A tokenizer with ``decode`` only (no fast backend): the fallback path."""

    def __init__(self, inner):
        self.inner = inner

    def decode(self, ids, skip_special_tokens=False):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def _ids_of(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("make", [lambda t: t, _SlowOnly], ids=["stream", "fallback"])
@pytest.mark.parametrize("text", SAMPLES)
def test_text_grows_to_the_whole_decode_and_never_rewrites(make, text):
    ids = _ids_of(text) + [TOKENIZER.eos_token_id] + _ids_of(" more")
    incremental, seen = IncrementalText(make(TOKENIZER)), ""
    for k, token in enumerate(ids, start=1):
        piece = incremental.add(token)
        assert incremental.text == seen + piece, "text only grows by the returned piece"
        seen = incremental.text
        whole = TOKENIZER.decode(ids[:k], skip_special_tokens=True)
        assert whole.startswith(seen) and len(whole.rstrip("\ufffd")) == len(seen), (k, whole, seen)
    assert seen == text + " more", "the special token in the middle is skipped"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(TOKENIZER) - 1), min_size=1, max_size=40))
def test_any_token_sequence_decodes_like_the_whole(ids):
    incremental = IncrementalText(TOKENIZER)
    for token in ids:
        incremental.add(token)
    whole = TOKENIZER.decode(ids, skip_special_tokens=True)
    assert incremental.text in (whole, whole.rstrip("\ufffd"))


def test_a_stop_string_is_seen_on_the_token_that_completes_it_even_across_pieces():
    incremental = IncrementalText(TOKENIZER)
    hits = []
    for token in _ids_of("Why was my card billed"):
        hits.append(incremental.ends_with_any(("card bil", "zzz"), incremental.add(token)))
    first = hits.index(True)
    partial = TOKENIZER.decode(_ids_of("Why was my card billed")[: first + 1])
    assert "card bil" in partial and "card bil" not in TOKENIZER.decode(_ids_of("Why was my card billed")[:first])
    assert not incremental.ends_with_any(("card",), ""), "no new text: nothing new can match"


class _CountingTokenizer:
    """Wraps the tiny tokenizer and counts whole-sequence decodes."""

    def __init__(self, inner):
        self.inner, self.decodes = inner, 0

    def decode(self, ids, **kwargs):
        self.decodes += 1
        return self.inner.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_each_row_is_decoded_whole_once_not_once_per_token(tiny_llama, extract_task_yaml):
    extractor = Extractor(tiny_llama, extract_task_yaml)
    rows = [extractor.prompt.encode(tiny_llama.tokenizer, [extractor.prompt.suffix_text({"text": t})])[0].suffix_ids for t in TEXTS[:3]]
    counting = _CountingTokenizer(tiny_llama.tokenizer)
    config = GenerationConfig(24, ("never-seen-stop",))
    out, _ = generate_rows(tiny_llama.model, counting, extractor.prefix, rows, Decoding(config))
    plain, _ = generate_rows(tiny_llama.model, tiny_llama.tokenizer, extractor.prefix, rows, Decoding(config))
    assert out == plain
    assert sum(len(g.token_ids) for g in out) > 3 * 5, "rows must run several steps for the count to mean anything"
    assert counting.decodes == len(rows), "one whole decode per row, at its end"


@pytest.fixture(scope="module")
def extract_task_yaml():
    from prefixcache.task.definition import parse_task
    from tests.support.tasks import EXTRACT_YAML

    return parse_task(EXTRACT_YAML, "tiny-fields.yaml", kinds=("extract",))
