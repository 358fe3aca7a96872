"""Schema-constrained decoding (engine/constraint.py) on tiny random models, whose output is garbage: exactly when a
constraint matters.

The oracles are independent of the engine's masking code: plain Hugging Face forward passes over the whole sequence
with llguidance's own matcher choosing the allowed tokens, ``jsonschema`` for validity, and ``json.loads``.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from prefixcache.engine.constraint import ANY_OBJECT, json_constraint
from prefixcache.engine.generate import Decoding, GenerationConfig, generate_rows
from prefixcache.engine.rows import empty_prefix
from prefixcache.engine.sampling import Sampling
from prefixcache.errors import ConstraintError
from prefixcache.model.load import LoadedModel, build_random_model
from prefixcache.scheduler.classify import RunConfig, records_from_texts
from prefixcache.scheduler.extract import Extractor
from prefixcache.task.answer import answer_schema
from prefixcache.task.definition import ExtractTask, parse_task

from tests.support.models import make_tokenizer, tiny_config
from tests.support.tasks import EXTRACT_YAML, TEXTS

ROOMY = 48  # tokens: room for the tiny tokenizer's shortest answer (33 tokens: it spells most keys letter by letter)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["billing", "technical"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def extract_task() -> ExtractTask:
    return parse_task(EXTRACT_YAML, "tiny-fields.yaml", kinds=("extract",))


def suffix_rows(extractor: Extractor, texts) -> list[tuple[int, ...]]:
    prompt = extractor.prompt
    return [e.suffix_ids for e in prompt.encode(extractor.loaded.tokenizer, [prompt.suffix_text({"text": t}) for t in texts])]


def full_ids(extractor: Extractor, text: str) -> list[int]:
    prompt = extractor.prompt
    return list(prompt.encode(extractor.loaded.tokenizer, [prompt.suffix_text({"text": text})])[0].full_ids)


@torch.inference_mode()
def oracle(loaded: LoadedModel, prompt_ids: list[int], schema: dict, max_new: int, eos: frozenset[int]) -> list[int]:
    """Greedy decoding under ``schema`` with llguidance's matcher and whole-sequence forward passes: no cache,
    no engine code (and no closing within the budget: compare only rows that completed on their own)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(loaded.tokenizer, eos_token=sorted(eos)), grammar)
    out: list[int] = []
    while len(out) < max_new and not matcher.is_stopped():
        logits = loaded.model(torch.tensor([prompt_ids + out])).logits[0, -1]
        bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)  # [vocab]: 0 = not allowed
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[: len(bias)] = bias[: len(logits)] > 0
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        assert matcher.consume_token(token)
        out.append(token)
        if token in eos:
            break
    return out


# --- extraction under the task's answer schema ------------------------------------------------------------------


@pytest.mark.parametrize("mode, batch", [("cached", 1), ("batched", 2), ("batched", 7)])
def test_every_constrained_extraction_parses_and_cached_equals_full(tiny, extract_task, mode, batch):
    extractor = Extractor(tiny, extract_task, max_new_tokens=ROOMY)
    records = records_from_texts(TEXTS)
    full = extractor.extract_all(records, RunConfig("full", 1))
    got = extractor.extract_all(records, RunConfig(mode, batch))
    schema = answer_schema(extract_task)
    for record, want, extraction in zip(records, full, got):
        assert extraction.error is None, f"record {record.id}: {extraction.error}"
        value = json.loads(extraction.raw)
        jsonschema.validate(value, schema)
        assert list(value) == list(extract_task.fields), f"record {record.id}: keys {list(value)} (declared order expected)"
        assert extraction.token_ids == want.token_ids, f"record {record.id}: {mode} b={batch} differs from full re-encoding"


def test_rows_that_complete_alone_equal_the_plain_constrained_loop(tiny_llama, extract_task):
    """Free rows equal llguidance's own greedy loop token for token; rows the budget closed still parse."""
    extractor = Extractor(tiny_llama, extract_task, max_new_tokens=ROOMY)
    records = records_from_texts(TEXTS)
    got = extractor.extract_all(records, RunConfig("batched", 4))
    eos = extractor.generation.eos_ids
    completed = [e for e in got if e.finish != "length"]
    assert completed, "no row completed its answer on its own: the test compares nothing"
    for record, extraction in zip(records, got):
        if extraction.finish != "length":
            want = oracle(tiny_llama, full_ids(extractor, record.fields["text"]), answer_schema(extract_task), ROOMY, eos)
            assert list(extraction.token_ids) == want, f"record {record.id}"


def test_a_budget_below_the_shortest_answer_is_reported_not_hidden(tiny_llama, extract_task):
    extractor = Extractor(tiny_llama, extract_task)  # max_new_tokens 10: the shortest answer takes 33
    for extraction in extractor.extract_all(records_from_texts(TEXTS[:3]), RunConfig("batched", 3)):
        assert extraction.error is not None and "max_new_tokens=10" in extraction.error


def test_unconstrained_extraction_is_the_free_decoding(tiny_llama, extract_task):
    free = Extractor(tiny_llama, extract_task, max_new_tokens=ROOMY, constrained=False)
    assert free.constraint is None
    rows = suffix_rows(free, TEXTS)
    plain, _ = generate_rows(tiny_llama.model, tiny_llama.tokenizer, free.prefix, rows, Decoding(free.generation))
    got = free.extract_all(records_from_texts(TEXTS), RunConfig("batched", 9))
    assert [e.token_ids for e in got] == [g.token_ids for g in plain]
    assert any(e.error for e in got), "a random model's free output should fail to parse somewhere"


# --- the engine: schemas, sampling, vocabularies ---------------------------------------------------------------


def test_any_schema_is_followed_greedy_or_sampled(tiny_llama, extract_task):
    extractor = Extractor(tiny_llama, extract_task, constrained=False)
    rows = suffix_rows(extractor, TEXTS)
    config = GenerationConfig(64, (), extractor.generation.eos_ids)
    for schema in (PERSON, ANY_OBJECT):
        for sampling in (Sampling(), Sampling(temperature=1.0, seed=3, top_logprobs=2)):
            out, _ = generate_rows(tiny_llama.model, tiny_llama.tokenizer, extractor.prefix, rows,
                                   Decoding(config, sampling, json_constraint(schema)))
            for i, generation in enumerate(out):
                jsonschema.validate(json.loads(generation.text), schema)
                assert generation.finish in ("stop", "eos", "length"), (i, generation)
                if sampling.top_logprobs is not None:
                    assert all(lp.logprob > float("-inf") for lp in generation.logprobs), "a masked token was picked"


def test_a_model_head_wider_than_the_tokenizer_never_picks_past_it(extract_task):
    tokenizer = make_tokenizer()
    model = build_random_model(tiny_config("llama", len(tokenizer) + 24), dtype=torch.float32, seed=1)
    with torch.no_grad():  # make the padding rows of the head the most likely tokens
        model.get_output_embeddings().weight[len(tokenizer):] *= 50
    loaded = LoadedModel(model, tokenizer, "tiny-wide", "tiny-wide-seed1", torch.float32, torch.device("cpu"))
    extractor = Extractor(loaded, extract_task, max_new_tokens=ROOMY)
    got = extractor.extract_all(records_from_texts(TEXTS[:4]), RunConfig("batched", 4))
    for extraction in got:
        assert max(extraction.token_ids) < len(tokenizer) and extraction.error is None, extraction


@pytest.mark.parametrize("schema, says", [
    ({"type": "strin"}, "Invalid type"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "nope"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "unsatisfiable"),
    ([1, 2], "object or boolean"),
    ({"type": "number", "minimum": float("nan")}, "JSON"),
])
def test_a_bad_schema_is_a_constraint_error_saying_why(schema, says):
    with pytest.raises(ConstraintError, match=says):
        json_constraint(schema)


def test_compiled_schemas_are_cached_and_keyed_by_their_text():
    assert json_constraint(PERSON) is json_constraint(json.loads(json.dumps(PERSON)))
    assert json_constraint(PERSON) != json_constraint(ANY_OBJECT)
    assert json_constraint(PERSON) != json_constraint(PERSON, close_within_budget=False)


def test_prefix_is_never_mutated_under_a_constraint(tiny_llama, extract_task):
    extractor = Extractor(tiny_llama, extract_task, max_new_tokens=ROOMY)
    before = extractor.prefix.checksum()
    extractor.extract_all(records_from_texts(TEXTS), RunConfig("batched", 3))
    assert extractor.prefix.checksum() == before
    empty = empty_prefix(tiny_llama.model)
    out, _ = generate_rows(tiny_llama.model, tiny_llama.tokenizer, empty, [full_ids(extractor, TEXTS[0])],
                           Decoding(extractor.generation, constraint=extractor.constraint))
    assert out[0].token_ids == extractor.extract_all(records_from_texts(TEXTS[:1]), RunConfig("cached", 1))[0].token_ids
