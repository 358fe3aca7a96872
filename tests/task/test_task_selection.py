"""Example selection reaches the prompt: task -> resolved examples -> rendered prompt, the same on every path.

A task with an ``example_pool`` and ``select`` must render exactly the examples
:func:`prefixcache.task.selection.resolve_examples` picks, the same every time (the
prefix tokens key the prefix cache), whether the prompt is built for classify
(``Classifier``, which verify, bench, serve and ray also use) or for eval; and
the eval leak check must test those resolved examples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prefixcache.errors import InputError
from prefixcache.eval.evaluate import check_no_overlap, evaluate, labelled_records, plan_eval
from prefixcache.task.prompt import build_prompt, render_messages
from prefixcache.scheduler.classify import Classifier, Record
from prefixcache.task.selection import resolve_examples
from prefixcache.task.definition import parse_task

from tests.support.tasks import LABELS, POOL_YAML, TASK_YAML


SELECT_YAML = POOL_YAML + "select:\n  per_label: 1\n  seed: 3\n"


@pytest.fixture(scope="module")
def selected():
    return parse_task(SELECT_YAML, "select.yaml")


def _shots(messages):
    """(user text, assistant label) per few-shot turn: everything between the system turn and the record."""
    turns = messages[1:-1]
    return [(u["content"], a["content"]) for u, a in zip(turns[::2], turns[1::2])]


def _records(texts, ids=None):
    ids = ids if ids is not None else range(len(texts))
    return [Record(i, {"text": t, "gold": LABELS[n % 3]}) for n, (i, t) in enumerate(zip(ids, texts))]


def test_prompt_renders_exactly_the_selected_examples(selected, tokenizer):
    resolved = resolve_examples(selected)
    picked = [e for e in resolved.examples if e not in selected.examples]
    left_out = [e for e in selected.example_pool if e not in resolved.examples]
    assert len(picked) == 3 and len(left_out) == 6, "one pool example per label is selected, six are not"

    messages = render_messages(selected)
    assert _shots(messages) == [(f"Ticket: {e.text}", e.label) for e in resolved.examples]
    everything = "\n".join(m["content"] for m in messages)
    assert all(e.text not in everything for e in left_out), "unselected pool examples never reach the prompt"

    prompt = build_prompt(selected, tokenizer)
    assert all(f"Ticket: {e.text}" in prompt.prefix_text for e in resolved.examples)
    assert all(e.text not in prompt.prefix_text for e in left_out)
    assert prompt.task.examples == resolved.examples, "the Prompt keeps the task whose examples it shows"
    assert prompt.task.select is None and prompt.task.example_pool == []

    again = build_prompt(parse_task(SELECT_YAML, "select.yaml"), tokenizer)
    assert render_messages(selected) == messages, "a second render is identical"
    assert (again.prefix_text, again.prefix_ids) == (prompt.prefix_text, prompt.prefix_ids), "same file, same prefix"
    assert build_prompt(resolved, tokenizer).prefix_ids == prompt.prefix_ids, "resolving first changes nothing"


def test_a_pool_without_select_shows_only_the_fixed_examples(tokenizer):
    plain = parse_task(POOL_YAML, "pool.yaml")
    assert _shots(render_messages(plain)) == [(f"Ticket: {e.text}", e.label) for e in plain.examples]
    fixed_only = parse_task(TASK_YAML, "tiny.yaml")
    assert build_prompt(plain, tokenizer).prefix_ids == build_prompt(fixed_only, tokenizer).prefix_ids


def test_selection_is_the_same_in_a_fresh_process(selected):
    """No hash-seeded ordering: another interpreter (other PYTHONHASHSEED) renders the same messages."""
    code = (
        "import json, sys\n"
        "from prefixcache.task.prompt import render_messages\n"
        "from prefixcache.task.definition import parse_task\n"
        "print(json.dumps(render_messages(parse_task(sys.stdin.read(), 'select.yaml'))))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], input=SELECT_YAML, capture_output=True, text=True, env=env, timeout=120, check=True
    )
    assert json.loads(out.stdout) == render_messages(selected)


def test_classify_and_eval_paths_show_the_same_examples(selected, tiny_llama):
    resolved = resolve_examples(selected)
    classifier = Classifier(tiny_llama, selected)  # what classify, verify, bench, serve and ray build
    plan = plan_eval(selected, _records(["hello there", "refund please"]), "gold")
    assert classifier.prompt.task.examples == plan.tasks[0].examples == resolved.examples
    assert Classifier(tiny_llama, plan.tasks[0]).prompt.prefix_ids == classifier.prompt.prefix_ids

    result = evaluate(classifier, plan.data, batch_size=2)
    assert result.examples == len(resolved.examples) == 6, "eval reports the examples the prompt shows"
    assert result.prefix_tokens == len(classifier.prompt.prefix_ids)


def test_leak_check_tests_the_resolved_examples_and_names_the_rows(selected):
    resolved = resolve_examples(selected)
    picked = [e for e in resolved.examples if e not in selected.examples]
    left_out = [e for e in selected.example_pool if e not in resolved.examples]
    texts = ["hello there", picked[0].text.upper() + "!", left_out[0].text, "I was charged twice this month", picked[2].text]
    records = _records(texts, ids=["r0", "r1", "r2", "r3", "r4"])

    with pytest.raises(InputError) as info:
        plan_eval(selected, records, "gold")
    message = str(info.value)
    assert "3 evaluation row(s)" in message and "'tiny-tickets'" in message, message
    assert f"row 1 (id 'r1') {texts[1]!r}" in message, message
    assert f"row 3 (id 'r3') {texts[3]!r}" in message, message
    assert f"row 4 (id 'r4') {texts[4]!r}" in message, message
    assert "row 0" not in message and "row 2" not in message, "an unselected pool example is not in the prompt"

    data = labelled_records(records, "gold", selected)
    with pytest.raises(InputError, match=r"row 1 \(id 'r1'\)"):
        check_no_overlap(data, selected)  # given the unresolved task, it still checks what the prompt shows
    clean = _records(["hello there", left_out[0].text, left_out[-1].text])
    assert plan_eval(selected, clean, "gold").tasks[0].examples == resolved.examples
