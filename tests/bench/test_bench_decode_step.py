"""The decode-step benchmark (bench/decode_step.py) decodes, through the engine loop's slot pass, exactly what the
engine's generate_rows decodes, on the lean decoder and on the transformers fallback, so its timings are of the
real step."""

from __future__ import annotations

import pytest

from prefixcache.bench.decode_step import profile_step, time_decode
from prefixcache.cache.kv import PrefixKV
from prefixcache.engine.generate import Decoding, GenerationConfig, generate_rows

from tests.support.models import tiny_loaded

ROWS = [[30, 31, 32], [33], [34, 35]]


@pytest.mark.parametrize("decoder", ["lean", "transformers"])
def test_the_timed_steps_decode_what_generate_rows_decodes(decoder):
    loaded = tiny_loaded("llama", decoder=decoder)
    prefix = PrefixKV.build(loaded.model, [5, 9, 12, 40, 7, 8])
    timing, tokens = time_decode(loaded.model, prefix, ROWS, steps=3)
    assert timing.batch == 3 and timing.steps == 3 and timing.seconds > 0 and timing.tokens_per_s > 0
    # the prefill's token, the warm-up step's and the 3 timed steps': 5 greedy tokens per row
    decoding = Decoding(GenerationConfig(max_new_tokens=5))
    generated, _ = generate_rows(loaded.model, loaded.tokenizer, prefix, ROWS, decoding)
    assert tokens == [list(g.token_ids) for g in generated]


def test_the_profile_splits_a_step_into_weight_matmuls_and_the_rest():
    loaded = tiny_loaded("qwen2")
    prefix = PrefixKV.build(loaded.model, [5, 9, 12, 40])
    profile = profile_step(loaded.model, prefix, ROWS[0], steps=2)
    assert 0 < profile.matmul_ms < profile.total_ms and 0 < profile.outside_share < 1
    assert "aten::mm" in profile.table or "aten::addmm" in profile.table
