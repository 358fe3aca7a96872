"""Copy fields (engine/copy_constraint.py): on random texts and a tiny random model, whose output is garbage, every
value decoded into a copy field is a span of its row's source text, or null; without the copy constraint the same
decoding invents values."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from prefixcache.engine.constraint import json_constraint
from prefixcache.engine.copy_constraint import CopyConstraint, SourceSpans, token_table
from prefixcache.engine.generate import Decoding, GenerationConfig, generate_rows
from prefixcache.engine.json_cursor import JsonCursor, value_tokens
from prefixcache.engine.rows import empty_prefix
from prefixcache.engine.sampling import Sampling

from tests.support.models import tiny_loaded

SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": ["string", "null"]}, "note": {"type": ["string", "null"]},
                   "ref": {"type": ["string", "null"]}},
    "required": ["code", "note", "ref"],
    "additionalProperties": False,
}
COPIED = ("code", "ref")
WORDS = st.sampled_from(["Order", "A-10442", "inv", "#77-B", "refund", "ÉTÉ", "ok", "12", "the", "  ", "x"])


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded("llama", seed=3)


def decode(loaded, sources, seed, copy=True, max_new=40):
    tokenizer = loaded.tokenizer
    config = GenerationConfig(max_new, (), frozenset({tokenizer.eos_token_id}))
    schema = json_constraint(SCHEMA)
    constraint = CopyConstraint(schema, COPIED, tuple(sources)) if copy else schema
    rows = [tokenizer(f"Text: {s}\nAnswer:", add_special_tokens=False)["input_ids"] for s in sources]
    prefix = empty_prefix(loaded.model)
    sampling = Sampling(temperature=1.5, seed=seed)
    generations, _ = generate_rows(loaded.model, tokenizer, prefix, rows, Decoding(config, sampling, constraint))
    return [json.loads(g.text) for g in generations]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(WORDS, min_size=1, max_size=8).map(" ".join), min_size=1, max_size=3), st.integers(0, 10**6))
def test_every_copied_value_is_a_span_or_null(loaded, sources, seed):
    for source, answer in zip(sources, decode(loaded, sources, seed)):
        for name in COPIED:
            value = answer[name]
            assert value is None or value in source, f"{name}={value!r} is not in {source!r}"
            assert value is None or not value[:1].isspace(), f"{name}={value!r} begins with whitespace"


def test_without_the_copy_constraint_values_are_invented(loaded):
    """The check above can fail: the same decoding under the schema alone writes values not in the text."""
    sources = ["Order A-10442 is late"] * 4
    invented = [a[n] for seed in range(6) for a in decode(loaded, sources, seed, copy=False) for n in COPIED
                if a[n] is not None and a[n] not in sources[0]]
    assert invented, "the schema alone wrote only spans: this model cannot show what the copy constraint prevents"


def test_position_table_reaches_every_split(loaded):
    """Every token whose bytes match the source at an offset is listed there, whatever the record's own split."""
    table = token_table(loaded.tokenizer, frozenset({loaded.tokenizer.eos_token_id}))
    spans = SourceSpans("Order A-10442, thanks", table)
    for offset, ids in enumerate(spans.at):
        for token in ids:
            assert spans.source.startswith(table.token_bytes[token], offset)
    single = [t for t in range(len(table.token_bytes)) if table.token_bytes[t] == b"A"]
    assert single and single[0] in spans.at[6]
    assert spans.ends(b"44") == [12]


def test_value_tokens_map_fields_to_their_tokens():
    tokens = [b'{"', b'code', b'": ', b'"A', b'-1', b'", "', b'note', b'": ', b'null', b', "ref": "', b'x', b'"}']
    assert value_tokens(tokens, ["code", "note", "ref"]) == {"code": [3, 4, 5], "note": [8], "ref": [9, 10, 11]}
    cursor = JsonCursor()
    cursor.feed(b'{"code": "A-')
    assert cursor.value_string_of == "code" and bytes(cursor.text) == b"A-"
