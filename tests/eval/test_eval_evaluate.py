"""Evaluation: metrics arithmetic, calibration math, example selection and pools, leak refusal, the eval CLI.

Model-backed tests use the tiny in-process Qwen2 of conftest.py (its labels mean
nothing; the tests check arithmetic and plumbing, not quality).
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from prefixcache.eval.calibration import Prior, calibrate, calibrate_logprobs, content_free_prior, mean_distribution
from prefixcache.cli.app import app
from prefixcache.errors import InputError, TaskError
from prefixcache.eval.evaluate import evaluate, labelled_records, parse_steps, plan_eval, run_eval
from prefixcache.eval.metrics import compute_metrics, confusion_matrix, metrics_from_confusion
from prefixcache.scheduler.classify import Classifier, Record, RunConfig
from prefixcache.engine.scoring import LabelScores
from prefixcache.task.selection import candidate_order, first_examples, normalize_text, overlapping_rows, resolve_examples
from prefixcache.task.definition import parse_task

from tests.support import paths
from tests.support.models import save_tiny_model
from tests.support.tasks import LABELS, POOL_YAML, TASK_YAML, TEXTS

REPORT_KEYS = {"records", "accuracy", "macro_f1", "per_label", "confusion"}



def gold_for(texts):
    return [LABELS[i % 3] for i in range(len(texts))]


# --- metrics -------------------------------------------------------------------------------------------------


def test_metrics_on_a_known_confusion_matrix():
    confusion = {
        "a": {"a": 5, "b": 1, "c": 0, "d": 0},
        "b": {"a": 2, "b": 3, "c": 1, "d": 0},
        "c": {"a": 0, "b": 0, "c": 0, "d": 0},  # never gold, predicted once
        "d": {"a": 0, "b": 0, "c": 0, "d": 0},  # never gold, never predicted: left out of macro-F1
    }
    m = metrics_from_confusion(confusion)
    assert m.records == 12
    assert m.accuracy == pytest.approx(8 / 12)
    a, b, c, d = (m.per_label[k] for k in "abcd")
    assert (a.precision, a.recall, a.f1, a.support, a.predicted) == pytest.approx((5 / 7, 5 / 6, 10 / 13, 6, 7))
    assert (b.precision, b.recall, b.f1, b.support, b.predicted) == pytest.approx((3 / 4, 1 / 2, 0.6, 6, 4))
    assert (c.precision, c.recall, c.f1) == (0.0, 0.0, 0.0), "zero-division cases must be 0, not NaN"
    assert (d.precision, d.recall, d.f1, d.support, d.predicted) == (0.0, 0.0, 0.0, 0, 0)
    assert m.macro_f1 == pytest.approx((10 / 13 + 0.6 + 0.0) / 3), "macro-F1 averages labels seen in gold or predictions"


def test_confusion_from_sequences_matches_hand_count():
    gold = ["a", "a", "b", "b", "b", "c"]
    pred = ["a", "b", "b", "b", "a", "c"]
    confusion = confusion_matrix(gold, pred, ["a", "b", "c"])
    assert confusion == {"a": {"a": 1, "b": 1, "c": 0}, "b": {"a": 1, "b": 2, "c": 0}, "c": {"a": 0, "b": 0, "c": 1}}
    m = compute_metrics(gold, pred, ["a", "b", "c"])
    assert m.accuracy == pytest.approx(4 / 6)
    assert m.per_label["c"].f1 == 1.0
    assert set(m.to_json()) == REPORT_KEYS


def test_perfect_and_empty_edge_cases():
    perfect = compute_metrics(["x", "y"], ["x", "y"], ["x", "y"])
    assert perfect.accuracy == perfect.macro_f1 == 1.0
    empty = compute_metrics([], [], ["x", "y"])
    assert (empty.records, empty.accuracy, empty.macro_f1) == (0, 0.0, 0.0)


def test_confusion_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="2 gold labels but 1 predictions"):
        confusion_matrix(["a", "b"], ["a"], ["a", "b"])
    with pytest.raises(ValueError, match="'z'"):
        confusion_matrix(["a"], ["z"], ["a", "b"])


# --- calibration math ----------------------------------------------------------------------------------------


def logs(*ps):
    return tuple(math.log(p) for p in ps)


def test_calibration_divides_out_the_prior_and_renormalizes():
    out = calibrate_logprobs(logs(0.5, 0.3, 0.2), logs(0.5, 0.25, 0.25))
    ratios = [0.5 / 0.5, 0.3 / 0.25, 0.2 / 0.25]
    assert [math.exp(x) for x in out] == pytest.approx([r / sum(ratios) for r in ratios])
    assert sum(math.exp(x) for x in out) == pytest.approx(1.0)


def test_calibrating_by_itself_gives_uniform_and_uniform_prior_changes_nothing():
    p = logs(0.6, 0.3, 0.1)
    assert [math.exp(x) for x in calibrate_logprobs(p, p)] == pytest.approx([1 / 3] * 3)
    assert calibrate_logprobs(p, logs(1 / 3, 1 / 3, 1 / 3)) == pytest.approx(p)


def test_calibration_can_flip_the_label():
    scores = LabelScores(("x", "y"), logs(0.6, 0.4))
    prior = Prior(("N/A",), ("x", "y"), logs(0.8, 0.2))
    assert scores.label == "x" and calibrate(scores, prior).label == "y"


def test_mean_distribution_averages_probabilities_not_logprobs():
    assert [math.exp(x) for x in mean_distribution([logs(0.2, 0.8), logs(0.6, 0.4)])] == pytest.approx([0.4, 0.6])


def test_calibration_refuses_bad_priors():
    with pytest.raises(ValueError, match="probability 0"):
        calibrate_logprobs(logs(0.5, 0.5), (0.0, -math.inf))
    with pytest.raises(ValueError, match="3 labels"):
        calibrate_logprobs(logs(0.5, 0.5), logs(0.2, 0.3, 0.5))
    with pytest.raises(ValueError, match="over"):
        calibrate(LabelScores(("x", "y"), logs(0.5, 0.5)), Prior(("",), ("y", "x"), logs(0.5, 0.5)))


# --- selection and task pools --------------------------------------------------------------------------------


def test_normalize_text_ignores_case_punctuation_and_spacing():
    assert normalize_text("  Hello,   WORLD!! ") == normalize_text("hello world") == "hello world"
    assert normalize_text("Ｆｕｌｌ　width") == "full width"


def test_candidate_order_is_fixed_first_then_pool_round_robin():
    task = parse_task(POOL_YAML, "pool.yaml")
    order = candidate_order(task, seed=0)
    assert order[:3] == task.examples, "the fixed examples come first, in file order"
    assert [e.label for e in order] == LABELS * 4, "labels alternate round-robin"
    assert sorted(e.text for e in order[3:]) == sorted(e.text for e in task.example_pool)
    assert candidate_order(task, seed=0) == order, "the same seed gives the same order"
    assert any(candidate_order(task, seed=s) != order for s in range(1, 6)), "the seed shuffles the pool"


def test_first_examples_are_nested_and_bounded():
    task = parse_task(POOL_YAML, "pool.yaml")
    assert first_examples(task, 3).examples == task.examples, "n = len(examples) reproduces the task's prompt"
    small, big = first_examples(task, 5, seed=2), first_examples(task, 11, seed=2)
    assert big.examples[:5] == small.examples, "a bigger sweep step shows a superset of a smaller one"
    assert not big.example_pool and big.select is None
    assert first_examples(task, 0).examples == []
    with pytest.raises(TaskError, match="has 12 distinct examples"):
        first_examples(task, 13)


def test_select_resolves_to_balanced_examples():
    task = parse_task(POOL_YAML + "select:\n  per_label: 2\n  seed: 4\n", "pool.yaml")
    resolved = resolve_examples(task)
    assert len(resolved.examples) == 9
    assert {label: sum(e.label == label for e in resolved.examples) for label in LABELS} == dict.fromkeys(LABELS, 3)
    assert all(e in resolved.examples for e in task.examples), "the fixed examples are always kept"
    assert resolved.select is None and resolved.example_pool == []
    assert resolve_examples(resolved) is resolved, "resolving twice changes nothing"
    plain = parse_task(POOL_YAML, "pool.yaml")
    assert resolve_examples(plain) is plain, "a pool without select does not change the prompt"


def test_pool_duplicates_of_fixed_examples_are_skipped():
    yaml = POOL_YAML + "  - text: i was CHARGED twice this month!\n    label: billing\n"
    order = candidate_order(parse_task(yaml, "pool.yaml"))
    assert len(order) == 12, "a pool entry repeating a fixed example (normalized) is not a new candidate"


@pytest.mark.parametrize(
    "extra, field, words",
    [
        ("", "example_pool.1.label", ["'shipping' is not one of the labels"]),
        ("select:\n  per_label: 4\n", "select.per_label", ["asks for 4", "billing 3"]),
        ("select:\n  per_label: -1\n", "select.per_label", ["greater than or equal to 0"]),
        ("select:\n  per_label: 1\n  size: 2\n", "select.size", ["unknown key (allowed: per_label, seed)"]),
    ],
)
def test_invalid_pool_or_select_names_file_line_and_field(extra, field, words):
    text = POOL_YAML.replace("    label: billing\n  - text: My card", "    label: shipping\n  - text: My card") if not extra else POOL_YAML
    with pytest.raises(TaskError) as info:
        parse_task(text + extra, "bad.yaml")
    message = str(info.value)
    assert "bad.yaml:" in message and f"field '{field}'" in message, message
    for word in words:
        assert word in message, message


def test_select_without_pool_is_refused():
    with pytest.raises(TaskError) as info:
        parse_task(TASK_YAML + "select:\n  per_label: 1\n", "nopool.yaml")
    assert "nopool.yaml:15: field 'select'" in str(info.value) and "needs an example_pool" in str(info.value)


# --- gold labels and leak refusal ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def task():
    return parse_task(TASK_YAML, "tiny.yaml")


def records_of(texts, labels, ids=None):
    ids = ids if ids is not None else range(len(texts))
    return [Record(i, {"text": t, "gold": g}) for i, t, g in zip(ids, texts, labels)]


def test_labelled_records_name_rows_with_bad_labels(task):
    records = records_of(["a", "b", "c"], ["billing", "refunds", "refunds"], ids=["T0", "T1", "T2"])
    with pytest.raises(InputError) as info:
        labelled_records(records, "gold", task)
    assert "'refunds' in row 1 (id 'T1'), row 2 (id 'T2')" in str(info.value)
    with pytest.raises(InputError, match=r"row 0 \(id 'T0'\), row 1 .*: no gold label in field 'label'"):
        labelled_records(records, "label", task)
    with pytest.raises(InputError, match="no records"):
        labelled_records([], "gold", task)


def test_overlap_with_examples_is_refused_and_names_the_rows(task):
    texts = ["refund please", "  I was charged TWICE this month!", "crash", "the app crashes on start"]
    with pytest.raises(InputError) as info:
        plan_eval(task, records_of(texts, gold_for(texts)), "gold")
    message = str(info.value)
    assert "2 evaluation row(s)" in message
    assert "row 1 '  I was charged TWICE this month!'" in message and "row 3 'the app crashes on start'" in message
    assert "row 0" not in message and "row 2" not in message


def test_sweep_refuses_only_examples_it_would_show():
    task = parse_task(POOL_YAML, "pool.yaml")
    seventh = candidate_order(task, seed=0)[6]  # shown from step 7 on
    texts = ["hello there", seventh.text]
    records = records_of(texts, gold_for(texts))
    plan = plan_eval(task, records, "gold", sweep=[0, 3, 6], seed=0)
    assert [len(t.examples) for t in plan.tasks] == [0, 3, 6] and plan.sweep
    with pytest.raises(InputError, match="row 1"):
        plan_eval(task, records, "gold", sweep=[0, 3, 7], seed=0)


def test_overlapping_rows_checks_every_template_field():
    task = parse_task(TASK_YAML.replace('"Ticket: {text}"', '"{subject}: {text}"'), "two.yaml")
    rows = [(0, {"subject": "The app crashes on start", "text": "x"}), (1, {"subject": "y", "text": "z"})]
    assert overlapping_rows(rows, task.examples, task.fields) == [(0, "The app crashes on start")]


def test_parse_steps():
    assert parse_steps("0, 3,6,12") == [0, 3, 6, 12]
    with pytest.raises(InputError, match="'-1'"):
        parse_steps("0,-1")


# --- with the tiny model -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_qwen2):
    return tiny_qwen2


def test_content_free_prior_is_the_mean_of_content_free_predictions(tiny, task):
    classifier = Classifier(tiny, task)
    prior = content_free_prior(classifier, ("N/A", "", "[MASK]"))
    assert sum(prior.probabilities.values()) == pytest.approx(1.0)
    full = classifier.classify_all(records_of(["N/A", "", "[MASK]"], ["billing"] * 3), RunConfig("full", 1))
    expected = [sum(p.scores.probabilities[label] for p in full) / 3 for label in LABELS]
    assert list(prior.probabilities.values()) == pytest.approx(expected, abs=1e-5), "cached prior = full re-encoding's"
    with pytest.raises(InputError, match="at least one content-free input"):
        content_free_prior(classifier, ())


def full_prior(classifier, texts):
    """The content-free prior by full re-encoding: log of the mean label distribution of ``texts``."""
    records = [Record(i, {f: t for f in classifier.task.fields}) for i, t in enumerate(texts)]
    return mean_distribution([p.scores.logprobs for p in classifier.classify_all(records, RunConfig("full", 1))])


def assert_close_logprobs(got, want, where, tol=1e-4):
    drift = max(abs(a - b) for a, b in zip(got, want))
    assert len(got) == len(want) and drift <= tol, f"{where}: log-probs {drift:.2e} from full re-encoding's"


def test_evaluate_matches_full_reencoding_and_calibrates_every_record(tiny, task, monkeypatch):
    texts = TEXTS[:-1]  # without the empty text: eval rows must have a label and a text
    data = labelled_records(records_of(texts, gold_for(texts)), "gold", task)
    classifier = Classifier(tiny, task)
    runs = []  # every classify_all call evaluate makes, to read the scores behind its metrics
    real = classifier.classify_all

    def recording(records, *args, **kwargs):
        runs.append(real(records, *args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(classifier, "classify_all", recording)
    result = evaluate(classifier, data, batch_size=3, content_free=("N/A", ""))
    monkeypatch.undo()
    full = classifier.classify_all(data.records, RunConfig("full", 1))
    assert result.metrics == compute_metrics(data.gold, [p.label for p in full], LABELS), "batched eval = full re-encoding"
    whole = [run for run in runs if [p.id for p in run] == [r.id for r in data.records]]
    assert whole, "evaluate never classified all its records in one call"
    for got, want in zip(whole[-1], full):
        assert_close_logprobs(got.scores.logprobs, want.scores.logprobs, f"evaluated record {want.id}")
    assert result.prior.labels == tuple(LABELS)
    assert_close_logprobs(result.prior.logprobs, full_prior(classifier, ("N/A", "")), "the content-free prior")
    by_hand = [calibrate(p.scores, result.prior).label for p in full]
    assert result.calibrated == compute_metrics(data.gold, by_hand, LABELS)
    document = result.to_json()
    assert REPORT_KEYS <= set(document) and REPORT_KEYS <= set(document["calibrated"])
    assert document["calibrated"]["content_free"] == ["N/A", ""]
    assert result.examples == 3 and result.prefix_tokens == len(classifier.prompt.prefix_ids)
    assert result.ms_per_item > 0


def test_a_record_that_cannot_be_classified_stops_the_report(tiny, task):
    texts = ["refund please", "crash " * 600]  # the second overflows the tiny model's 512-token context
    data = labelled_records(records_of(texts, ["billing", "technical"], ids=["ok", "huge"]), "gold", task)
    with pytest.raises(InputError, match=r"1 record\(s\) could not be classified: .*'huge'"):
        evaluate(Classifier(tiny, task), data, batch_size=2)


def test_run_eval_sweep_grows_the_prefix(tiny):
    task = parse_task(POOL_YAML, "pool.yaml")
    texts = TEXTS[:4]
    results = run_eval(tiny, plan_eval(task, records_of(texts, gold_for(texts)), "gold", sweep=[6, 0, 3]), batch_size=2)
    assert [r.examples for r in results] == [0, 3, 6], "steps run in ascending order"
    tokens = [r.prefix_tokens for r in results]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert all(r.metrics.records == 4 for r in results)


# --- the CLI -------------------------------------------------------------------------------------------------

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny):
    return save_tiny_model(tmp_path_factory, loaded=tiny)


@pytest.fixture
def files(tmp_path):
    task_path = tmp_path / "task.yaml"
    task_path.write_text(POOL_YAML)
    data_path = tmp_path / "labelled.jsonl"
    texts = TEXTS[:-1]
    rows = [{"ticket": f"T{i}", "body": t, "gold": g} for i, (t, g) in enumerate(zip(texts, gold_for(texts)))]
    data_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(task_path), str(data_path), len(rows)


def invoke(model_dir, task_path, data_path, *extra):
    args = ["eval", data_path, "--task", task_path, "--model", model_dir, "--dtype", "float32",
            "--label-field", "gold", "--text-field", "body", "--id-field", "ticket", "--batch-size", "4", *extra]
    return runner.invoke(app, args, catch_exceptions=False)


def json_line(output):
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


def test_cli_eval_json_has_the_report_keys(model_dir, files):
    task_path, data_path, n = files
    result = invoke(model_dir, task_path, data_path, "--json")
    assert result.exit_code == 0, result.output
    report = json_line(result.stdout)
    assert REPORT_KEYS <= set(report) and "calibrated" not in report
    assert report["records"] == n
    assert sum(sum(row.values()) for row in report["confusion"].values()) == n
    assert set(report["per_label"]) == set(LABELS)
    assert set(report["per_label"]["billing"]) == {"precision", "recall", "f1", "support", "predicted"}
    correct = sum(report["confusion"][label][label] for label in LABELS)
    assert report["accuracy"] == pytest.approx(correct / n)


def test_cli_eval_calibrate_table_and_plot(model_dir, files, tmp_path):
    task_path, data_path, _ = files
    png = tmp_path / "confusion.png"
    result = invoke(model_dir, task_path, data_path, "--calibrate", "--plot", str(png))
    assert result.exit_code == 0, result.output
    for words in ("accuracy", "macro-F1", "calibrated", "content-free prior", "rows gold, columns predicted"):
        assert words in result.output, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_eval_calibrate_json_with_custom_content_free(model_dir, files, tiny):
    task_path, data_path, _ = files
    result = invoke(model_dir, task_path, data_path, "--json", "--content-free", "N/A", "--content-free", "")
    assert result.exit_code == 0, result.output
    calibrated = json_line(result.stdout)["calibrated"]
    assert REPORT_KEYS <= set(calibrated) and calibrated["content_free"] == ["N/A", ""]
    assert sum(calibrated["prior"].values()) == pytest.approx(1.0)
    want = full_prior(Classifier(tiny, parse_task(POOL_YAML, "pool.yaml")), ("N/A", ""))  # model_dir holds tiny
    got = [math.log(calibrated["prior"][label]) for label in LABELS]
    assert_close_logprobs(got, want, "the CLI's content-free prior")


def test_cli_eval_sweep_json_and_plot(model_dir, files, tmp_path):
    task_path, data_path, n = files
    png = tmp_path / "sweep.png"
    result = invoke(model_dir, task_path, data_path, "--sweep-examples", "0,3,6", "--calibrate", "--json", "--plot", str(png))
    assert result.exit_code == 0, result.output
    document = json_line(result.stdout)
    assert document["records"] == n
    steps = document["steps"]
    assert [s["examples"] for s in steps] == [0, 3, 6]
    for step in steps:
        assert REPORT_KEYS <= set(step) and "calibrated" in step and step["ms_per_item"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_eval_refuses_overlap_and_names_rows(model_dir, files, tmp_path):
    task_path, _, _ = files
    leaky = tmp_path / "leaky.jsonl"
    leaky.write_text(
        json.dumps({"ticket": "A1", "body": "refund me", "gold": "billing"}) + "\n"
        + json.dumps({"ticket": "A2", "body": "The app crashes on start.", "gold": "technical"}) + "\n"
    )
    result = invoke(model_dir, task_path, str(leaky))
    assert result.exit_code == 2
    assert "row 1 (id 'A2') 'The app crashes on start.'" in result.output and "A1" not in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "extra, words",
    [
        (("--sweep-examples", "0,x"), "whole numbers"),
        (("--sweep-examples", "0,40"), "fewer than the 40 asked for"),
        (("--label-field", "nope"), "no gold label in field 'nope'"),
    ],
)
def test_cli_eval_usage_errors_exit_2(model_dir, files, extra, words):
    task_path, data_path, _ = files
    result = invoke(model_dir, task_path, data_path, *extra)
    assert result.exit_code == 2, result.output
    assert words in result.output, result.output


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    from prefixcache.eval import report as eval_report
    from prefixcache.errors import PrefixCacheError

    monkeypatch.setattr(eval_report.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PrefixCacheError, match=r"pip install 'prefixcache\[plot\]'"):
        eval_report.check_plotting()


# --- the pooled task files behind docs/accuracy.md ----------------------------------------------------------


@pytest.mark.parametrize(
    "task_file, data_file, label_count",
    [("support-tickets-pool.yaml", "support_tickets.jsonl", 20), ("natcs-intents-pool.yaml", "natcs/utterances.csv", 12)],
)
def test_docs_pool_tasks_keep_the_bundled_prompt_and_never_leak(task_file, data_file, label_count):
    from prefixcache.io.records import bundled_dataset, read_records
    from prefixcache.task.definition import load_task

    pooled = load_task(paths.DOCS / "tasks" / task_file)
    bundled = load_task(task_file.removesuffix("-pool.yaml"))
    assert first_examples(pooled, len(bundled.examples)).examples == bundled.examples
    order = candidate_order(pooled)
    assert len(order) == label_count * len(pooled.labels)
    plan = plan_eval(pooled, read_records(bundled_dataset(data_file)), "label", sweep=[len(order)])
    assert plan.data.records, "no evaluation row is a pool example (plan_eval would have refused)"
