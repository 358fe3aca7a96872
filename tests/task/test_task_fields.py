"""Field kinds of extraction tasks: declarations, defaults, load-time errors naming field and line, schemas."""

import json

import pytest
from hypothesis import given, strategies as st

from prefixcache.errors import TaskError
from prefixcache.task.answer import answer_schema
from prefixcache.task.definition import load_any_task, parse_task
from prefixcache.task.fields import DEFAULT_KIND, FieldDecl, example_value_problem, value_schema

BASE = """\
name: t
kind: extract
instruction: Extract.
fields:
  order_id: {kind: copy, description: "The order id."}
  mood:
    kind: choice
    values: [happy, sad]
    description: "The mood."
  note: "Anything else."
examples:
  - text: "Order A-1 is late, I am sad."
    fields: {order_id: "A-1", mood: "sad", note: null}
"""


def parse(text):
    return parse_task(text, source="t.yaml", kinds=("extract",))


def test_kinds_and_the_default_kind():
    task = parse(BASE)
    assert [task.kind_of(n) for n in task.fields] == ["copy", "choice", DEFAULT_KIND]
    assert task.fields["mood"].values == ("happy", "sad")
    assert task.names_of_kind("copy") == ["order_id"]


def test_bundled_ticket_fields_declares_copy_and_choice():
    task = load_any_task("ticket-fields")
    assert task.kind_of("order_id") == "copy" and task.kind_of("sentiment") == "choice"
    assert set(task.fields["sentiment"].values) == {"positive", "neutral", "negative"}
    schema = answer_schema(task)
    assert schema["properties"]["sentiment"] == {"enum": ["positive", "neutral", "negative"]}
    assert schema["properties"]["order_id"] == {"type": ["string", "null"]}


@pytest.mark.parametrize("bad, line, field, words", [
    (BASE.replace("kind: copy", "kind: span"), 5, "fields.order_id.kind", "copy"),
    (BASE.replace("    values: [happy, sad]\n", ""), 6, "fields.mood", "at least two values"),
    (BASE.replace("[happy, sad]", "[happy, happy]"), 6, "fields.mood", "listed twice"),
    (BASE.replace("{kind: copy,", "{kind: copy, values: [a, b],"), 5, "fields.order_id", "belongs to a choice"),
    (BASE.replace('order_id: "A-1"', 'order_id: "B-2"'), 13, "examples.0.fields.order_id", "not in the example's text"),
    (BASE.replace('mood: "sad"', 'mood: "angry"'), 13, "examples.0.fields.mood", "not one of the values"),
    (BASE.replace('kind: copy, description: "The order id."', 'kind: copy'), 5, "fields.order_id.description", "required"),
])
def test_bad_declarations_name_field_and_line(bad, line, field, words):
    with pytest.raises(TaskError) as caught:
        parse(bad)
    message = str(caught.value)
    assert f"t.yaml:{line}" in message and f"'{field}" in message and words in message, message


def test_number_and_date_schemas():
    assert value_schema(FieldDecl(kind="number", description="n")) == {"type": ["number", "null"]}
    date = value_schema(FieldDecl(kind="date", description="d"))
    assert {"type": "null"} in date["anyOf"]
    decl = FieldDecl(kind="date", description="d")
    assert example_value_problem(decl, "2024-02-03", "") is None
    assert "YYYY-MM-DD" in example_value_problem(decl, "3 Feb", "")
    assert "not a number" in example_value_problem(FieldDecl(kind="number", description="n"), "7", "")


@given(st.text(min_size=1, max_size=30), st.integers(0, 29), st.integers(0, 29))
def test_a_copy_example_must_be_in_its_text(text, i, j):
    decl = FieldDecl(kind="copy", description="c")
    span = text[min(i, j):max(i, j)]
    assert example_value_problem(decl, span, text) is None
    assert example_value_problem(decl, text + "\x00", text) is not None


def test_the_schema_compiles():
    from prefixcache.engine.constraint import json_constraint
    json_constraint(answer_schema(parse(BASE.replace("note: \"Anything else.\"", "note: {kind: date, description: d}"))))
    json.dumps(answer_schema(parse(BASE)))
