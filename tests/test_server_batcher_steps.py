"""Step scheduling: short passes run between the decoding steps of a long pass (engine/steps.py, the
batcher's ``_interleave``), on a fake decoding runner (no model, no HTTP).

A decoding runner's pass calls ``step_boundary()`` between steps, as ``generate_rows`` does. While it
runs, a classification that arrives must be answered before the decoding pass ends (not after it), the
decoding pass must still get all of its results, and a failing short pass must fail only its own request.
The waits are seconds against steps of tens of milliseconds, so a slow machine cannot flip the outcome.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from prefixcache.engine.steps import between_steps, step_boundary
from prefixcache.server.batcher import MicroBatcher
from prefixcache.server.prometheus import Metrics
from prefixcache.server.settings import ServerSettings

STEPS = 40
STEP_S = 0.05


class DecodingRunner:
    """A pass of ``STEPS`` steps with a step boundary after each; records which thread ran it."""

    kind = "extract"
    decodes = True

    def __init__(self):
        self.task = SimpleNamespace(name="decoding")
        self.started = threading.Event()
        self.threads: set[int] = set()
        self.ended_at = 0.0

    def run(self, batch):
        self.threads.add(threading.get_ident())
        self.started.set()
        for _ in range(STEPS):
            time.sleep(STEP_S)
            step_boundary()
        self.ended_at = time.perf_counter()
        return [f"decoded {item.record}" for item in batch]


class ShortRunner:
    """One quick pass; fails on a payload of "boom". Records when and where each pass ran."""

    kind = "classify"

    def __init__(self):
        self.task = SimpleNamespace(name="short")
        self.threads: set[int] = set()
        self.ran_at: list[float] = []

    def run(self, batch):
        self.threads.add(threading.get_ident())
        self.ran_at.append(time.perf_counter())
        if any(item.record == "boom" for item in batch):
            raise RuntimeError("boom")
        step_boundary()  # no hook inside an interleaved pass: this must not recurse
        return [f"scored {item.record}" for item in batch]


def item(payload):
    return SimpleNamespace(record=payload, full=False)


def scenario(short_payloads):
    decoding, short = DecodingRunner(), ShortRunner()

    async def main():
        with ThreadPoolExecutor(1) as model_thread:
            batcher = MicroBatcher(model_thread, ServerSettings(max_batch=8, max_wait_ms=5, arrival_gap_ms=1), Metrics())
            batcher.start()
            try:
                async def submit(runner, payload):
                    with batcher.admit(1):
                        return await batcher.submit(runner, [item(payload)])

                long_request = asyncio.ensure_future(submit(decoding, "ticket"))
                await asyncio.get_running_loop().run_in_executor(None, decoding.started.wait, 10)
                shorts = await asyncio.gather(*(submit(short, p) for p in short_payloads), return_exceptions=True)
                answered_at = time.perf_counter()
                return await long_request, shorts, answered_at
            finally:
                await batcher.stop()

    long_result, shorts, answered_at = asyncio.run(main())
    return decoding, short, long_result, shorts, answered_at


def test_a_short_request_is_answered_between_decoding_steps_not_after_the_pass():
    decoding, short, long_result, shorts, answered_at = scenario(["a", "b"])
    assert long_result == ["decoded ticket"], "the decoding pass still gets its result"
    assert [r for s in shorts for r in s] == ["scored a", "scored b"]
    assert answered_at < decoding.ended_at, "the short requests waited for the whole decoding pass"
    assert short.threads == decoding.threads, "short passes run on the model thread, the one that touches the model"


def test_a_failing_short_pass_fails_only_its_own_request():
    decoding, _, long_result, shorts, _ = scenario(["boom"])
    assert long_result == ["decoded ticket"]
    assert isinstance(shorts[0], RuntimeError) and str(shorts[0]) == "boom"


def test_the_hook_is_cleared_while_it_runs_and_gone_after_the_block():
    calls = []

    def hook():
        calls.append("outer")
        step_boundary()  # a pass run by the hook cannot yield again

    with between_steps(hook):
        step_boundary()
        step_boundary()
    step_boundary()
    assert calls == ["outer", "outer"]


@pytest.mark.parametrize("decodes", [False, True])
def test_generation_gives_the_same_tokens_whatever_runs_between_its_steps(tiny_llama, decodes):
    from prefixcache.engine.generate import GenerationConfig, generate_rows
    from prefixcache.cache.kv import PrefixKV
    from prefixcache.run.classify import Classifier, records_from_texts
    from prefixcache.spec.task import parse_task
    from conftest import TASK_YAML, TEXTS

    tok = tiny_llama.tokenizer
    prefix = PrefixKV.build(tiny_llama.model, tok("a shared prefix for every row")["input_ids"])
    rows = [tok(t or "x")["input_ids"] for t in TEXTS[:3]]
    config = GenerationConfig(12)
    alone, _ = generate_rows(tiny_llama.model, tok, prefix, rows, config)
    classifier = Classifier(tiny_llama, parse_task(TASK_YAML))
    between = []

    def classify_between_steps():
        between.append(classifier.classify_all(records_from_texts(TEXTS[:2])))

    with between_steps(classify_between_steps if decodes else (lambda: None)):
        interleaved, _ = generate_rows(tiny_llama.model, tok, prefix, rows, config)
    assert interleaved == alone
    assert not decodes or len(between) >= 5, "the hook ran at the step boundaries"
