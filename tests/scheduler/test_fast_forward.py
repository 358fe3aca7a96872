"""Fast-forward (scheduler/engine_loop.py, engine/constraint.py ``next_forced``): the tokens a row's grammar forces
are appended without a step of their own and fed with its next step.

Masked decoding would pick those very tokens (each is the only one its grammar allows), so a row's answer is the
one it gets a token a step, while it takes fewer steps. Guarded here on a tiny random model in float32: rows of
several schemas (copy fields bound to each row's text among them), greedy, mixed with seeded sampling rows under
random step budgets, give their token-a-step answers, and the forced tokens are what the grammar alone decides. (A
seeded sampling row draws only for the tokens it picks, so its stream of draws, and its answer, differ from a
token-a-step run's; that it does not depend on its neighbours is the engine loop's property test.)
"""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from prefixcache.cache.kv import PrefixKV
from prefixcache.engine.constraint import json_constraint
from prefixcache.engine.copy_constraint import CopyConstraint
from prefixcache.engine.generate import GenerationConfig, eos_ids_of
from prefixcache.engine.sampling import Sampling
from prefixcache.scheduler.engine_loop import EngineLoop, LoopConfig
from prefixcache.scheduler.sequence import Generate, Sequence, Status

from tests.support.models import tiny_loaded

LOADED = tiny_loaded("llama")
EOS = eos_ids_of(LOADED.model, LOADED.tokenizer)
PREFIX = PrefixKV.build(LOADED.model, list(range(5, 25)))
TICKET = {"type": "object", "properties": {"order_id": {"type": ["string", "null"]},
                                           "sentiment": {"enum": ["positive", "neutral", "negative"]}},
          "required": ["order_id", "sentiment"], "additionalProperties": False}
SCHEMAS = [
    json_constraint(TICKET),
    json_constraint({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "boolean"}},
                     "required": ["a", "b"]}),
    json_constraint({"enum": ["alpha beta gamma", "alpha beta delta"]}),
]


def _run(seqs: list[Sequence], fast_forward: bool, step_tokens: int = 64, max_seqs: int = 8) -> EngineLoop:
    loop = EngineLoop(LOADED.model, LOADED.tokenizer, LoopConfig(step_tokens, max_seqs, 2**20, fast_forward))
    loop.run_until_done(seqs)
    return loop


row = st.tuples(
    st.integers(0, len(SCHEMAS)),  # which schema (the last: the ticket schema with order_id copied)
    st.lists(st.integers(30, 300), min_size=1, max_size=10),  # its own tokens
    st.integers(4, 40),  # max_new_tokens
    st.booleans(),  # seeded sampling instead of greedy
)


@settings(max_examples=20, deadline=None)
@given(rows=st.lists(row, min_size=1, max_size=5), step_tokens=st.integers(2, 40), max_seqs=st.integers(1, 4))
def test_fast_forward_gives_the_token_a_step_answer_in_fewer_steps(rows, step_tokens, max_seqs):
    def make(spec) -> Sequence:
        which, ids, budget, sampled = spec
        source = LOADED.tokenizer.decode(ids)
        constraint = SCHEMAS[which] if which < len(SCHEMAS) else CopyConstraint(SCHEMAS[0], ("order_id",), (source,))
        sampling = Sampling(temperature=0.8, seed=3) if sampled else Sampling()
        return Sequence(PREFIX, ids, Generate(GenerationConfig(budget, (), EOS), sampling, constraint))

    stepwise, forwarded = [make(r) for r in rows], [make(r) for r in rows]
    slow = _run(stepwise, False, step_tokens, max_seqs)
    fast = _run(forwarded, True, step_tokens, max_seqs)
    for i, (a, b) in enumerate(zip(stepwise, forwarded)):
        assert a.status == b.status == Status.FINISHED, f"row {i}: {a.status} a step, {b.status} fast-forwarded"
        if rows[i][3]:
            continue  # sampled: see the module docstring
        assert (a.result.token_ids, a.result.text, a.result.finish) == (b.result.token_ids, b.result.text,
                                                                         b.result.finish), f"row {i} ({rows[i]})"
    assert slow.stats.tokens_forced == 0, "a loop without fast-forward forces nothing"
    if not any(r[3] for r in rows):
        assert fast.stats.tokens_generated == slow.stats.tokens_generated
        assert fast.stats.steps <= slow.stats.steps
    assert (fast.store is None or fast.store.free == fast.store.slots), "every slot is given back"


def test_the_forced_tokens_are_the_keys_separators_enum_tails_and_the_end():
    """On the ticket schema, a greedy row's steps pick only what the grammar leaves open: most of the answer is
    forced (its keys, separators, the rest of the sentiment once begun, the closing brace)."""
    seq = Sequence(PREFIX, [40, 41, 42], Generate(GenerationConfig(60, (), EOS), constraint=SCHEMAS[0]))
    loop = _run([seq], True)
    answer = json.loads(seq.result.text)
    assert set(answer) == {"order_id", "sentiment"} and answer["sentiment"] in TICKET["properties"]["sentiment"]["enum"]
    picked = loop.stats.tokens_generated - loop.stats.tokens_forced
    assert loop.stats.tokens_forced >= 5, f"only {loop.stats.tokens_forced} of {loop.stats.tokens_generated} forced"
    assert loop.stats.steps == picked, "one step per token the model picked (the prompt fits one step)"
    assert seq.result.finish == "stop"


def test_a_row_that_records_top_logprobs_takes_a_step_for_every_token():
    """A row's top log-probs list every step's alternatives, so such rows are never fast-forwarded; a row recording
    only its chosen tokens' log-probs gets 0.0 (probability 1) for each forced one, as its masked step would."""
    config = GenerationConfig(40, (), EOS)
    listed = Sequence(PREFIX, [40, 41], Generate(config, Sampling(top_logprobs=2), SCHEMAS[1]))
    chosen = Sequence(PREFIX, [40, 41], Generate(config, Sampling(top_logprobs=0), SCHEMAS[1]))
    loop = _run([listed], True)
    assert loop.stats.tokens_forced == 0
    forwarded = _run([chosen], True)
    assert forwarded.stats.tokens_forced > 0
    assert listed.result.token_ids == chosen.result.token_ids
    for a, b in zip(listed.result.logprobs, chosen.result.logprobs):
        assert a.token_id == b.token_id
        assert abs(a.logprob - b.logprob) < 1e-5 or (b.logprob == 0.0 and a.logprob > -1e-6), (a, b)
