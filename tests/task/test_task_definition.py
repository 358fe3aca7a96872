"""Task files: valid ones load; invalid ones name the file, the line and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache.errors import TaskError
from prefixcache.task.definition import bundled_task_names, load_task, parse_task

from tests.support.tasks import TASK_YAML


def test_valid_task_loads():
    task = parse_task(TASK_YAML, "ok.yaml")
    assert task.label_names == ["billing", "technical", "account"]
    assert task.fields == ["text"]


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (lambda y: y + "colour: blue\n", "colour", ["unknown key", "instruction"]),
        (lambda y: y.replace("name: tiny-tickets\n", ""), "name", ["Field required"]),
        (lambda y: y.replace("    label: account", "    label: shipping"), "examples", ["shipping", "not one of the labels"]),
        (lambda y: y.replace("  account: login, password and profile\n", ""), "examples", ["account"]),
        (lambda y: y.replace('"Ticket: {text}"', '"Ticket: no field"'), "input_template", ["at least one record field"]),
        (lambda y: y.replace("  billing: invoices", "  '': invoices"), "labels", ["must not be empty"]),
        (lambda y: y.replace("    label: billing", "    label: billing\n    weight: 2"), "examples.0.weight", ["unknown key"]),
    ],
)
def test_invalid_task_names_file_line_and_field(mutate, field, words):
    with pytest.raises(TaskError) as info:
        parse_task(mutate(TASK_YAML), "bad.yaml")
    message = str(info.value)
    assert "bad.yaml:" in message, message
    assert f"'{field}" in message, message
    for word in words:
        assert word in message, message


def test_duplicate_label_is_rejected_with_line():
    text = TASK_YAML.replace("  account: login", "  billing: again\n  account: login")
    with pytest.raises(TaskError) as info:
        parse_task(text, "dup.yaml")
    assert "dup.yaml:6" in str(info.value) and "duplicate key 'billing'" in str(info.value)


def test_invalid_yaml_names_the_line():
    with pytest.raises(TaskError, match=r"broken.yaml:4: invalid YAML: .*at line 3"):
        parse_task("name: x\ninstruction: y\nlabels: [a, b\n", "broken.yaml")


def test_error_line_points_at_the_offending_key():
    text = TASK_YAML.replace("input_template", "input_tempalte")
    with pytest.raises(TaskError) as info:
        parse_task(text, "typo.yaml")
    assert "typo.yaml:14: field 'input_tempalte'" in str(info.value)


def test_bundled_tasks_load_and_are_well_formed():
    names = bundled_task_names()
    assert "support-tickets" in names and len(names) >= 2
    tickets = load_task("support-tickets")
    assert set(tickets.labels) == {"billing", "technical", "account"}
    assert len(tickets.examples) >= 12
    for name in names:
        assert load_task(name).name == name


def test_unknown_task_name_lists_the_bundled_ones():
    with pytest.raises(TaskError, match="support-tickets"):
        load_task("no-such-task")


def test_missing_task_file():
    with pytest.raises(TaskError, match="no such task file"):
        load_task("/nonexistent/task.yaml")


def test_a_task_file_with_thousands_of_problems_names_the_first_twenty_and_counts_the_rest():
    """Issue 19, item 1: each problem is located by a walk of the file's nodes, so naming them all cost the
    square of the entries (3,000 bad labels: 2.25 s); the error names the first 20 with their lines."""
    body = "name: many\ninstruction: x\nlabels:\n" + "".join(f"  label{i}: [{i}, {i}]\n" for i in range(3000))
    with pytest.raises(TaskError) as refused:
        parse_task(body, "many.yaml")
    lines = str(refused.value).splitlines()
    assert len(lines) == 1 + 20 + 1 and lines[-1].strip() == "... and 2980 more problems"
    assert lines[1].strip().startswith("many.yaml:4: field 'labels.label0'") and "many.yaml:23:" in lines[20]


@pytest.mark.parametrize("template", ["Ticket: {text:x>200000}", "{text:>5}", "{text!r}", "{text!s:^9}"])
def test_a_template_with_a_format_spec_or_conversion_is_refused_naming_the_field(template):
    """Issue 19, item 6: a spec pads every record to any width (``{text:x>200000}`` made a 2-character item a
    50,048-token prompt), and ``{text:>5}`` reached the server as a 500."""
    body = f"name: t\ninstruction: x\nlabels: {{a: first, b: second}}\ninput_template: {json.dumps(template)}\n"
    with pytest.raises(TaskError, match=r"t.yaml:4: field 'input_template'.*format spec or conversion; write it as \{text\}"):
        parse_task(body, "t.yaml")


def test_a_chat_template_that_does_not_parse_is_refused_naming_the_field():
    text = TASK_YAML + 'chat_template: "{% for m in messages %}{{ m.content }}"\n'
    with pytest.raises(TaskError, match=r"t.yaml:\d+: field 'chat_template': not a valid chat template: .*line 1"):
        parse_task(text, "t.yaml")


def test_every_task_file_under_docs_loads():
    files = sorted((Path(__file__).resolve().parents[2] / "docs" / "tasks").glob("*.yaml"))
    assert len(files) >= 9
    for path in files:
        assert load_task(path).name == path.stem


def test_the_gemma_task_gives_a_tokenizer_without_a_template_gemmas_turns():
    from prefixcache.task.prompt import build_prompt
    from tests.support.models import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = None
    task = load_task(Path(__file__).resolve().parents[2] / "docs" / "tasks" / "support-tickets-gemma.yaml")
    prompt = build_prompt(task, tokenizer)
    assert "<start_of_turn>user\nClassify" in prompt.prefix_text
    assert prompt.prefix_text.count("<start_of_turn>model\n") == 12  # one answer per few-shot example
    assert prompt.tail_text.endswith("<end_of_turn>\n<start_of_turn>model\n")
