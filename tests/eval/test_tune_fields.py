"""Prefix tuning for an extraction task on tiny random models: the training loss falls and the held-out answers'
teacher-forced loss beats the untuned prompt's, the head file round-trips bit for bit, a tuned prefix for another
model, prompt or field set is refused, extraction after it one record per pass equals batched, and the CLI path
(`fit --task T --tune prefix`, `extract --head FILE`, `eval --head FILE`) takes it, beside a copy field's presence
head (`eval --head FILE --field-head order_id=FILE`), which reads the state after the tuned prefix."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.cli.evaluate_extract import use_tuned
from prefixcache.engine.head_file import load_head, save_head
from prefixcache.errors import HeadMismatchError, InputError
from prefixcache.eval.tune_config import TuneConfig
from prefixcache.eval.tune_fields import answer_tokens, end_of_answer, fields_manifest, gold_values, tune_fields
from prefixcache.scheduler.extract import Extractor
from prefixcache.scheduler.feature_pass import bound_own_rows, tuned_prefix
from prefixcache.task.definition import parse_task
from prefixcache.types import Mode, Record, RunConfig
from tests.support.models import save_tiny_model

FIELDS_YAML = """\
name: tiny-orders
kind: extract
instruction: Extract the fields from the ticket.
fields:
  order_id: {kind: copy, description: "the order number as written, else null"}
  sentiment: {kind: choice, values: [positive, negative], description: the mood}
  note: what else the ticket says
examples:
  - text: order A1 broke
    fields: {order_id: A1, sentiment: negative, note: null}
input_template: "Ticket: {text}"
max_new_tokens: 24
"""
MOOD = {"positive": ["great", "thanks"], "negative": ["broke", "late"]}


def tickets(count: int, seed: int) -> list[Record]:
    """Tickets whose order id (or none) and mood word decide the gold fields; no ``note`` column."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        mood = ("positive", "negative")[i % 2]
        order = f"B{int(rng.integers(10, 99))}" if i % 3 else None
        words = ([f"order {order}"] if order else ["hello"]) + [str(rng.choice(MOOD[mood]))]
        records.append(Record(f"t{i}", {"text": " ".join(words), "order_id": order, "sentiment": mood}))
    return records


def extract_task(text: str):
    return parse_task(text, "orders.yaml", kinds=("extract",))


@pytest.fixture(scope="module")
def fields_task():
    return extract_task(FIELDS_YAML)


def tune(loaded, task, records, config=TuneConfig(epochs=12, lr=1e-2, batch_size=8, patience=12)):
    extractor = Extractor(loaded, task)
    own = bound_own_rows(extractor, records, task.input_fields)
    end = end_of_answer(loaded.tokenizer, extractor.generation.eos_ids)
    answers = [answer_tokens(loaded.tokenizer, task, v, end) for v in gold_values(task, records)]
    tuned = tune_fields(loaded, own.prompt.prefix_ids, own.rows, answers, config)
    tuned.head.manifest.update(fields_manifest(tuned, loaded, own, config, task))
    return tuned


@pytest.fixture(scope="module")
def tuned_fields(tiny_llama, fields_task):
    return tune(tiny_llama, fields_task, tickets(40, seed=0))


def test_gold_values_are_the_columns_with_null_where_none_and_fallback_where_no_column(fields_task):
    records = [Record("a", {"text": "x", "order_id": "B1", "sentiment": "positive"}),
               Record("b", {"text": "y", "order_id": "", "sentiment": None})]
    values = gold_values(fields_task, records, [{"note": "kept"}, {}])
    assert values == [{"order_id": "B1", "sentiment": "positive", "note": "kept"},
                      {"order_id": None, "sentiment": None, "note": None}]


def test_training_loss_falls_and_held_out_answers_beat_the_untuned_prompt(tuned_fields):
    epochs = tuned_fields.epochs
    assert epochs[-1].train_loss < epochs[0].train_loss, [e.train_loss for e in epochs]
    best = tuned_fields.best
    assert best.heldout_loss < tuned_fields.start_loss, (best.heldout_loss, tuned_fields.start_loss)
    assert best.heldout_accuracy >= tuned_fields.start_accuracy
    head = tuned_fields.head
    assert head.tuned and head.labels == () and head.manifest["fields"] == ["order_id", "sentiment", "note"]


def test_the_head_file_round_trips_bit_for_bit(tuned_fields, tmp_path):
    path = save_head(tuned_fields.head, tmp_path / "fields.safetensors")
    again = load_head(path)
    assert again.prefix.checksum() == tuned_fields.head.prefix.checksum() and again.digest() == tuned_fields.head.digest()
    assert save_head(again, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()


def test_a_tuned_prefix_for_another_model_prompt_or_field_set_is_refused(tuned_fields, tiny_llama, tiny_qwen2, fields_task,
                                                                        tmp_path):
    path = save_head(tuned_fields.head, tmp_path / "fields.safetensors")
    with pytest.raises(HeadMismatchError, match="model"):
        use_tuned(Extractor(tiny_qwen2, fields_task), path)
    other = extract_task(FIELDS_YAML.replace("Extract the fields from the ticket.", "Read the ticket."))
    with pytest.raises(HeadMismatchError, match="prompt"):
        use_tuned(Extractor(tiny_llama, other), path)
    fewer = extract_task(FIELDS_YAML.replace("  note: what else the ticket says\n", "").replace(", note: null", ""))
    with pytest.raises(HeadMismatchError, match="fields"):
        use_tuned(Extractor(tiny_llama, fewer), path)


def test_a_field_head_given_bare_is_refused_naming_the_form(tuned_fields, tiny_llama, fields_task, tmp_path):
    from dataclasses import replace

    plain = replace(tuned_fields.head, prefix=None)
    path = save_head(plain, tmp_path / "plain.safetensors")
    with pytest.raises(InputError, match="not an extraction task's tuned prefix"):
        use_tuned(Extractor(tiny_llama, fields_task), path)


@pytest.mark.parametrize("batch", [3, 8])
def test_extraction_after_the_tuned_prefix_one_record_per_pass_equals_batched(tuned_fields, tiny_llama, fields_task, batch):
    records = [Record(r.id, {"text": r.fields["text"]}) for r in tickets(9, seed=5)]
    extractor = Extractor(tiny_llama, fields_task)
    extractor.tuned = tuned_prefix(tuned_fields.head)
    alone = extractor.extract_all(records, RunConfig(Mode.CACHED, 1))
    together = extractor.extract_all(records, RunConfig(Mode.BATCHED, batch))
    assert [(e.raw, e.token_ids, e.error) for e in alone] == [(e.raw, e.token_ids, e.error) for e in together]
    plain = Extractor(tiny_llama, fields_task).extract_all(records, RunConfig(Mode.BATCHED, batch))
    assert [e.token_ids for e in plain] != [e.token_ids for e in together], "the tuned prefix changed nothing"


def test_the_cli_fits_extracts_and_evaluates_with_the_tuned_prefix(tmp_path_factory, tmp_path):
    model_dir = save_tiny_model(tmp_path_factory, "llama")
    task_file = tmp_path / "orders.yaml"
    task_file.write_text(FIELDS_YAML)
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps({"id": r.id, **r.fields}) + "\n" for r in tickets(12, 1)))
    # scored on order_id alone: a random model's unfinished answers have no sentiment, which a choice field's
    # confusion matrix does not take
    held.write_text("".join(json.dumps({"id": r.id, "text": r.fields["text"], "order_id": r.fields["order_id"]}) + "\n"
                            for r in tickets(6, 2)))
    head = tmp_path / "tuned.safetensors"
    common = ["--task", str(task_file), "--model", str(model_dir), "--dtype", "float32", "--id-field", "id"]
    runner = CliRunner()
    fitted = runner.invoke(app, ["fit", str(train), *common, "--tune", "prefix", "--epochs", "1", "--json",
                                 "--out", str(head)], catch_exceptions=False)
    assert fitted.exit_code == 0, fitted.output
    assert load_head(head).manifest["fields"] == ["order_id", "sentiment", "note"]
    extracted = runner.invoke(app, ["extract", str(held), *common, "--head", str(head)], catch_exceptions=False)
    assert extracted.exit_code in (0, 1), extracted.output
    assert len([line for line in extracted.stdout.splitlines() if line.startswith("{")]) == 6
    scored = runner.invoke(app, ["eval", str(held), *common, "--head", str(head), "--json"], catch_exceptions=False)
    assert scored.exit_code == 0, scored.output
    assert json.loads(scored.stdout.splitlines()[-1])["tuned"]["prefix_tokens"] == load_head(head).prefix.length
    presence = tmp_path / "order_id.safetensors"
    fitted = runner.invoke(app, ["fit", str(train), *common, "--field", "order_id", "--folds", "2", "--out", str(presence)],
                           catch_exceptions=False)
    assert fitted.exit_code == 0, fitted.output
    both = runner.invoke(app, ["eval", str(held), *common, "--head", str(head), "--field-head", f"order_id={presence}",
                               "--json"], catch_exceptions=False)
    assert both.exit_code == 0, both.output
    document = json.loads(both.stdout.splitlines()[-1])
    assert document["tuned"] is not None and "order_id" in document["heads"], "a tuned prefix and a field head together"
    other = tmp_path / "other.yaml"
    other.write_text(FIELDS_YAML.replace("Extract the fields from the ticket.", "Read the ticket."))
    refused = runner.invoke(app, ["extract", str(held), "--task", str(other), *common[2:], "--head", str(head)])
    assert refused.exit_code == 2 and "another prompt" in refused.output


def test_a_presence_head_beside_the_tuned_prefix_reads_the_state_after_it(tuned_fields, tiny_llama, fields_task):
    """extract --head TUNED --head order_id=FILE: the presence head is applied to the state the rows compute after
    the tuned prefix (not the prompt's), and only nulls: order_id is null where it says absent, and is the tuned
    prefix's own copied value elsewhere."""
    from prefixcache.eval.fit_head import fit_head
    from prefixcache.scheduler.field_features import collect_field_features
    from prefixcache.scheduler.field_policy import FieldPolicy

    tuned = tuned_prefix(tuned_fields.head)
    train = tickets(24, seed=3)
    features = collect_field_features(tiny_llama, fields_task, "order_id", train, tuned=tuned)
    gold = {r.id: ("absent", "present")[r.fields["order_id"] is not None] for r in train}
    head = fit_head(features, gold, folds=2, seed=0).head
    records = [Record(r.id, {"text": r.fields["text"]}) for r in tickets(12, seed=6)]
    after = collect_field_features(tiny_llama, fields_task, "order_id", records, tuned=tuned)
    before = collect_field_features(tiny_llama, fields_task, "order_id", records)
    assert not np.allclose(after.features, before.features), "the tuned prefix left the rows' states unchanged"
    extractor = Extractor(tiny_llama, extract_task(FIELDS_YAML.replace("max_new_tokens: 24", "max_new_tokens: 160")))
    extractor.tuned = tuned
    own = extractor.extract_all(records, RunConfig(Mode.BATCHED, 4))
    extractor.policy = FieldPolicy(fields_task, {"order_id": head})
    judged = extractor.extract_all(records, RunConfig(Mode.BATCHED, 4))
    said = head.predict(after.features)
    assert "absent" in said, "the head never said absent: the test would prove nothing"
    nulled = [p.fields["order_id"] for p, v in zip(own, said) if v == "absent" and p.fields and p.fields["order_id"]]
    assert nulled, "no copied value was nulled: the test would prove nothing"
    for plain, result, verdict in zip(own, judged, said):
        if result.fields is None:
            continue
        wanted = None if verdict == "absent" else plain.fields["order_id"] or None
        assert result.fields["order_id"] == wanted, (plain.fields, result.fields, verdict)
