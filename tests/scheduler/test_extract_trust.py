"""Extraction a team can trust, end to end on a tiny random model: fit --field writes a choice field's head,
extract --head uses it (the same value as the head over the fitting pass's features), copy fields copy or stay
null, --min-confidence nulls and flags, --review holds the flagged records, and eval scores every field."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.engine.head_file import load_head
from prefixcache.eval.extract_eval import Scored, coverage_curve, field_report, normalize, threshold_for
from prefixcache.scheduler.field_features import collect_field_features
from prefixcache.task.definition import parse_task
from prefixcache.types import Record

from tests.support.models import save_tiny_model, tiny_loaded

TASK = """\
name: trust
kind: extract
instruction: Extract.
fields:
  ref: {kind: copy, description: "the reference"}
  mood: {kind: choice, values: [good, bad], description: "the mood"}
examples:
  - text: "ref Q-1 is broken"
    fields: {ref: "Q-1", mood: bad}
input_template: "T: {text}"
max_new_tokens: 48
"""
ROWS = [("ref A-1 crashed again", "A-1", "bad"), ("thanks, all good", None, "good"), ("B-22 refund please", "B-22", "bad"),
        ("love it", None, "good"), ("order C-3 is late", "C-3", "bad"), ("great app", None, "good"),
        ("D-4 broke", "D-4", "bad"), ("nice work", None, "good"), ("error E-5", "E-5", "bad"), ("super", None, "good")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trust")
    task = folder / "trust.yaml"
    task.write_text(TASK)
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "text": t, "ref": r, "mood": m}) + "\n" for i, (t, r, m) in enumerate(ROWS)))
    loaded = tiny_loaded("qwen2")
    return folder, str(task), str(data), save_tiny_model(tmp_path_factory, "qwen2", loaded), loaded


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    return result


def test_fit_field_extract_head_flags_and_eval(setup):
    folder, task, data, model, loaded = setup
    head_path = folder / "mood.safetensors"
    common = ("--task", task, "--model", model, "--dtype", "float32", "--id-field", "id")
    fitted = cli("fit", data, "--field", "mood", "--out", head_path, "--folds", "2", *common)
    assert fitted.exit_code == 0, fitted.output
    head = load_head(head_path)
    assert set(head.labels) == {"good", "bad"} and head.manifest["field"] == "mood"

    out, review = folder / "out.jsonl", folder / "review.jsonl"
    ran = cli("extract", data, "--head", f"mood={head_path}", "--min-confidence", "ref=0.5", "--review", review,
              "--out", out, "--batch-size", "4", *common)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(ROWS), ran.output
    spec = parse_task(TASK, kinds=("extract",))
    features = collect_field_features(loaded, spec, "mood", [Record(f"r{i}", {"text": t}) for i, (t, _, _) in enumerate(ROWS)])
    expected = head.predict(features.features)
    for line, (text, _, _), mood in zip(lines, ROWS, expected):
        fields, confidence = line["fields"], line["confidence"]
        assert fields["mood"] == mood, "the head over the prefill's state must equal the head over the fitting pass's"
        assert fields["ref"] is None or fields["ref"] in text
        low = confidence["ref"] is not None and confidence["ref"] < 0.5
        assert ("ref" in line["flagged"]) == (low or confidence["ref"] is None)
        assert not line["flagged"] or fields["ref"] is None
    flagged = [json.loads(line)["id"] for line in review.read_text().splitlines()]
    assert flagged == [line["id"] for line in lines if line["flagged"]]

    scored = cli("eval", data, "--field-head", f"mood={head_path}", "--target-accuracy", "0.5", "--json", *common)
    assert scored.exit_code == 0, scored.output
    document = json.loads(scored.stdout.strip().splitlines()[-1])
    assert document["fields"]["ref"]["invented"] == 0 and document["rows"] == len(ROWS)
    assert 0.0 <= document["fields"]["mood"]["accuracy"] <= 1.0 and document["fields"]["mood"]["macro_f1"] is not None


def test_a_head_for_a_field_that_is_neither_choice_nor_copy_is_refused(setup):
    folder, task, data, model, _ = setup
    result = cli("fit", data, "--field", "nope", "--out", folder / "x.safetensors", "--task", task, "--model", model,
                 "--id-field", "id")
    assert result.exit_code != 0 and "not a choice or copy field" in result.output


def test_a_presence_head_nulls_a_copy_field_it_calls_absent(setup):
    """fit --field on a copy field fits absent/present; extract --head then leaves the field null where the head
    says absent (with the head's probability as confidence), and keeps the copied span elsewhere."""
    folder, task, data, model, loaded = setup
    head_path = folder / "ref.safetensors"
    common = ("--task", task, "--model", model, "--dtype", "float32", "--id-field", "id")
    assert cli("fit", data, "--field", "ref", "--out", head_path, "--folds", "2", *common).exit_code == 0
    head = load_head(head_path)
    assert head.labels == ("absent", "present")
    out = folder / "ref.jsonl"
    cli("extract", data, "--head", f"ref={head_path}", "--out", out, *common)
    spec = parse_task(TASK, kinds=("extract",))
    features = collect_field_features(loaded, spec, "ref", [Record(f"r{i}", {"text": t}) for i, (t, _, _) in enumerate(ROWS)])
    for line, said in zip((json.loads(x) for x in out.read_text().splitlines()), head.predict(features.features)):
        if said == "absent":
            assert line["fields"]["ref"] is None and line["confidence"]["ref"] >= 0.5


def test_eval_metrics():
    spec = parse_task(TASK, kinds=("extract",))
    assert normalize(" #A-1. ") == "a-1" and normalize("") is None and normalize(None) is None
    rows = [Scored(1, "ref A-1 x", {"ref": "A-1", "mood": "bad"}, {"ref": "a-1", "mood": "bad"}, {"ref": 0.9, "mood": 0.6}),
            Scored(2, "nothing", {"ref": None, "mood": "good"}, {"ref": "INV-9", "mood": "bad"}, {"ref": 0.4, "mood": 0.9}),
            Scored(3, "ref B-2", {"ref": "B-2", "mood": "good"}, {"ref": None, "mood": "good"}, {"ref": 0.8, "mood": 0.7})]
    ref = field_report(spec, "ref", rows)
    assert (ref.exact, ref.invented, ref.missed, ref.spurious) == (pytest.approx(1 / 3), 2, 1, 1)
    assert ref.invented_rate == pytest.approx(1.0)  # "a-1" matches A-1 after normalizing, but is not in the text as written
    mood = field_report(spec, "mood", rows)
    assert mood.accuracy == pytest.approx(2 / 3)
    curve = coverage_curve([0.9, 0.4, 0.8], [True, False, False])
    assert threshold_for(curve, 1.0).threshold == 0.9 and threshold_for(curve, 1.0).coverage == pytest.approx(1 / 3)
    assert threshold_for(coverage_curve([None], [False]), 0.5) is None


def test_cached_equals_full_under_copy_and_choice_fields(setup):
    """verify (invariant 1) with the new kinds: full re-encoding and batched decoding give the same tokens, fields
    and confidences in float32, the copy constraint and a choice head included."""
    from prefixcache.eval.verify_extract import verify_extract
    from prefixcache.scheduler.extract import Extractor
    from prefixcache.scheduler.field_policy import FieldPolicy
    from prefixcache.types import RunConfig

    folder, _, _, _, loaded = setup
    spec = parse_task(TASK, kinds=("extract",))
    head_path = folder / "mood.safetensors"
    heads = {"mood": load_head(head_path)} if head_path.exists() else {}
    extractor = Extractor(loaded, spec, policy=FieldPolicy(spec, heads))
    records = [Record(f"r{i}", {"text": t}) for i, (t, _, _) in enumerate(ROWS)]
    agreement, _, _ = verify_extract(extractor, records, RunConfig("batched", 4))
    assert agreement.identical == len(records), agreement.differing_ids
    full = extractor.extract_all(records, RunConfig("full", 1))
    batched = extractor.extract_all(records, RunConfig("batched", 4))
    for a, b in zip(full, batched):
        assert a.fields == b.fields
        assert all(abs((a.confidence[k] or 0) - (b.confidence[k] or 0)) < 1e-4 for k in a.confidence)


def test_the_engine_loop_gives_what_static_batches_give_under_copy_and_choice_fields(setup):
    """Each record's sequence carries its own copy constraint, records its tokens' log-probs and keeps its
    prompt's last state (what a choice head with feature ``last`` reads), so rows refilled as others finish
    give the fields and confidences of static batches."""
    from prefixcache.bench.extract_lanes import static_twin
    from prefixcache.scheduler.extract import Extractor
    from prefixcache.scheduler.field_policy import FieldPolicy
    from prefixcache.types import RunConfig

    folder, _, _, _, loaded = setup
    spec = parse_task(TASK, kinds=("extract",))
    head_path = folder / "mood.safetensors"
    heads = {"mood": load_head(head_path)} if head_path.exists() else {}
    extractor = Extractor(loaded, spec, policy=FieldPolicy(spec, heads))
    records = [Record(f"r{i}", {"text": t}) for i, (t, _, _) in enumerate(ROWS)]
    through_loop = extractor.extract_all(records, RunConfig("batched", 3))
    static = static_twin(extractor).extract_all(records, RunConfig("batched", 3))
    assert extractor.continuous and extractor.copied == ("ref",)
    for record, a, b in zip(records, through_loop, static):
        assert (a.raw, a.fields, a.flagged) == (b.raw, b.fields, b.flagged), record.id
        assert a.confidence.keys() == b.confidence.keys()
        assert all(abs((a.confidence[k] or 0) - (b.confidence[k] or 0)) < 1e-4 for k in a.confidence), record.id
        if a.fields["ref"] is not None:
            assert a.fields["ref"] in record.fields["text"], "a copied value is a span of its record"


def test_bench_measures_the_copy_constraint_beside_the_schema_alone(setup):
    from prefixcache.bench.extract_lanes import SCHEMA_ONLY, STATIC, bench_extract
    from prefixcache.scheduler.extract import Extractor

    _, _, _, _, loaded = setup
    extractor = Extractor(loaded, parse_task(TASK, kinds=("extract",)))
    records = [Record(f"r{i}", {"text": t}) for i, (t, _, _) in enumerate(ROWS[:3])]
    lanes = bench_extract(extractor, records, 3, log=lambda _: None)
    assert [lane.mode for lane in lanes] == ["full", "cached", "batched", "cached-stepwise", SCHEMA_ONLY, STATIC]
    assert lanes[3].identical == 1.0, "a step for every token gives what fast-forward gives"
    assert lanes[4].constrained and lanes[4].parse_errors == 0 and extractor.copied == ("ref",)
    assert lanes[5].identical == 1.0, "static batches give what the engine loop gives"


def test_a_choice_field_with_no_value_is_scored_wrong_not_a_crash():
    spec = parse_task(TASK, kinds=("extract",))
    rows = [Scored(1, "ref A-1", {"ref": "A-1", "mood": "bad"}, {"ref": "A-1", "mood": "bad"}, {}),
            Scored(2, "ref B-2", {"ref": "B-2", "mood": "good"}, {"ref": "B-2", "mood": None}, {})]  # an answer not parsed
    mood = field_report(spec, "mood", rows)
    assert mood.accuracy == pytest.approx(1 / 2) and mood.wrong == [{"id": 2, "gold": "good", "predicted": None}]
