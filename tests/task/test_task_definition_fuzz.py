"""Task-file fuzzing: whatever text parse_task is given, it returns a Task or raises TaskError naming the source.

Four generators: character edits of a valid task (with YAML's syntax characters), line edits (drop,
repeat, swap, replace), random structures dumped as YAML under the task's own keys, and plain garbage.
Then the named cases of issue 7: each error names its field.
"""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefixcache.errors import TaskError
from prefixcache.task.definition import Task, parse_task

from tests.support.tasks import TASK_YAML

SOURCE = "fuzzed-task.yaml"
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SYNTAX = st.sampled_from(list(":-?[]{},#&*!|>'\"%@`\n\t ") + ["  ", "\n  ", "- ", ": ", "---", "...", "~", "null", "0", "é", "\x00"])
KEYS = list(Task.model_fields) + ["text", "label", "per_label", "seed", "colour", ""]


def _parse_or_task_error(text: str) -> None:
    """The property: a Task, or a TaskError whose message names the source. Any other exception fails."""
    try:
        parse_task(text, SOURCE)
    except TaskError as exc:
        assert SOURCE in str(exc), f"the error does not name the file: {exc}"


@st.composite
def char_edits(draw) -> str:
    text = TASK_YAML
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["insert", "delete", "replace"]))
        piece = draw(SYNTAX | st.text(max_size=3))
        if action == "insert":
            text = text[:at] + piece + text[at:]
        elif action == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 8)) :]
        else:
            text = text[:at] + piece + text[at + len(piece) :]
    return text


@st.composite
def line_edits(draw) -> str:
    lines = TASK_YAML.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["drop", "repeat", "swap", "replace"]))
        if action == "drop" and len(lines) > 1:
            del lines[i]
        elif action == "repeat":
            lines.insert(i, lines[i])
        elif action == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        else:
            lines[i] = draw(st.text(st.characters(codec="utf-8"), max_size=30))
    return "\n".join(lines) + "\n"


scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def structures(draw) -> str:
    """A mapping over the task's own keys (and a few others) with random values, dumped as YAML."""
    document = draw(st.dictionaries(st.sampled_from(KEYS), values, max_size=8))
    return yaml.safe_dump(document, allow_unicode=True, sort_keys=False)


@FUZZ
@given(text=char_edits() | line_edits() | structures() | st.text(max_size=200))
@example(text="")
@example(text="- just\n- a list\n")
@example(text=TASK_YAML.replace("labels:", "labels: !!binary AAAA\nx:"))
def test_parse_task_only_ever_raises_task_error(text):
    _parse_or_task_error(text)


@pytest.mark.parametrize(
    "text",
    [
        "{[1, 2]: x}\n",  # a key that is a list: YAML allows it, a dict cannot hold it
        "name: x\nlabels: {[a]: b, c: d}\n",
        "? - a\n: b\n",
        "name: x\nkind: []\n",  # a kind that is not a string
        "name: x\nkind: {a: 1}\n",
        "labels: " + "[" * 1000 + "]" * 1000 + "\n",  # nesting deeper than the YAML composer's recursion
    ],
    ids=["list-key", "list-label", "complex-key", "list-kind", "map-kind", "deep-nesting"],
)
def test_found_by_fuzzing(text):
    """Inputs the fuzzer found raising TypeError or RecursionError out of parse_task (see docs/reliability.md)."""
    _parse_or_task_error(text)


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda y: y.replace("name: tiny-tickets", "name: tiny-tickets\n\tlabels: x"), ["invalid YAML"]),
        (lambda y: y + "examples_pool: []\n", ["field 'examples_pool'", "unknown key"]),
        (lambda y: y.replace("  billing: invoices", "  '   ': invoices"), ["field 'labels'", "must not be empty"]),
        (lambda y: y.replace("  billing: invoices", "  ' billing': invoices"), ["field 'labels'", "whitespace"]),
        (lambda y: y.replace("  account: login", "  technical: again\n  account: login"), ["duplicate key 'technical'"]),
        (lambda y: y.replace("    label: technical", "    label: Technical"), ["field 'examples.1.label'", "'Technical'"]),
        (lambda y: y.replace("  - text: I was charged twice this month", "  - text: ''"), ["field 'examples.0.text'"]),
        (lambda y: y.replace("name: tiny-tickets", "name: tiny tickets!"), ["field 'name'"]),
        (lambda y: y.replace('"Ticket: {text}"', '"Ticket: {text"'), ["field 'input_template'"]),
    ],
)
def test_named_cases_name_their_field(mutate, words):
    with pytest.raises(TaskError) as info:
        parse_task(mutate(TASK_YAML), SOURCE)
    message = str(info.value)
    assert SOURCE in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("text", ["name: x\nlabels: " + "[" * 5000 + "]" * 5000 + "\n",
                                  "name: x\nlabels:\n" + "".join("  " * i + "a:\n" for i in range(1, 3000))],
                         ids=["flow", "block"])
def test_deep_nesting_is_refused_by_libyaml_with_its_line_without_the_slow_reread(text, monkeypatch):
    """libyaml refuses a document nested past its limit in milliseconds; reading it again with the pure-Python
    loader (as other refusals are, for their exact wording) took 2.4 s of GIL-held recursion for 5,000 levels."""
    from prefixcache.task import yaml_source

    if yaml_source.FAST_LOADER is None:
        pytest.skip("PyYAML without libyaml: the pure-Python loader is the only one")

    def no_reread(*args, **kwargs):
        raise AssertionError("the pure-Python loader read a document libyaml had refused for its depth")

    monkeypatch.setattr(yaml_source.UniqueKeyLoader, "__init__", no_reread)
    with pytest.raises(TaskError, match=r"upload:x:\d+: invalid YAML: exceeded maximum nesting depth"):
        parse_task(text, "upload:x")
