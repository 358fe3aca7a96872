"""Extraction tasks: generation from the cached prefix equals a plain greedy loop over the whole prompt.

Tiny random models produce gibberish, so these tests check decoding and bookkeeping,
not the quality of the fields: outputs must be identical token for token, stop rules
must hold, parse failures must land on their records, and nothing may be lost. The plain
loop is free decoding, so those tests run extractors with ``constrained=False``; decoding
under the answer schema (the default) is tested in test_engine_constraint.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from prefixcache.bench.extract_lanes import run_extract_bench
from prefixcache.bench.options import BenchOptions
from prefixcache.bench.roofline import weight_bytes
from prefixcache.cli.app import app
from prefixcache.errors import TaskError
from prefixcache.eval.verify_extract import compare_extractions, verify_extract
from prefixcache.scheduler.extract import Extractor
from prefixcache.task.answer import parse_fields
from prefixcache.engine.generate import Decoding, GenerationConfig, generate_rows
from prefixcache.cache.pool import PrefixPool
from prefixcache.scheduler.classify import Classifier, Record, RunConfig, records_from_texts
from prefixcache.task.definition import ExtractTask, bundled_task_names, load_any_task, load_task, parse_task

from tests.support.models import save_tiny_model, tiny_loaded
from tests.support.tasks import EXTRACT_YAML, TEXTS


MAX_NEW = 10


@pytest.fixture(scope="module")
def extract_task() -> ExtractTask:
    return parse_task(EXTRACT_YAML, "tiny-fields.yaml", kinds=("extract",))


_FREE: dict[tuple, list[int]] = {}


def plain_greedy(loaded, prompt_ids, max_new: int, eos: frozenset[int]) -> list[int]:
    """The reference: ``model(...)`` over the whole sequence at every step, no cache at all.

    Greedy decoding that stops at ``eos`` is the free-running sequence cut after its first
    ``eos`` token, so each (model, prompt) is run once, without stops, and memoized.
    """
    key = (loaded.identity, tuple(prompt_ids), max_new)
    if key not in _FREE:
        out: list[int] = []
        with torch.no_grad():
            for _ in range(max_new):
                logits = loaded.model(input_ids=torch.tensor([list(prompt_ids) + out])).logits[0, -1]
                out.append(int(logits.argmax()))
        _FREE[key] = out
    free = _FREE[key]
    ends = [i for i, token in enumerate(free) if token in eos]
    return free[: ends[0] + 1] if ends else list(free)


def full_ids(extractor: Extractor, text: str) -> tuple[int, ...]:
    suffix = extractor.prompt.suffix_text({"text": text})
    return extractor.prompt.encode(extractor.loaded.tokenizer, [suffix])[0].full_ids


@pytest.mark.parametrize("mode, batch", [("cached", 1), ("batched", 2), ("batched", 7)])
def test_cached_generation_equals_uncached_plain_loop(tiny, extract_task, mode, batch):
    extractor = Extractor(tiny, extract_task, constrained=False)
    records = records_from_texts(TEXTS)
    got = extractor.extract_all(records, RunConfig(mode, batch))
    eos = extractor.generation.eos_ids
    for record, extraction in zip(records, got):
        want = plain_greedy(tiny, full_ids(extractor, record.fields["text"]), MAX_NEW, eos)
        assert list(extraction.token_ids) == want, f"record {record.id}: {mode} b={batch} generated {extraction.token_ids}, plain loop {want}"
        body = want[:-1] if want and want[-1] in eos else want
        assert extraction.raw == tiny.tokenizer.decode(body, skip_special_tokens=True)


def test_rows_that_finish_early_leave_the_others_exact(tiny_llama, extract_task):
    """Rows end at different steps (some on an early 'eos'); the survivors' positions and masks stay right."""
    extractor = Extractor(tiny_llama, extract_task)
    prompts = [full_ids(extractor, t) for t in TEXTS]
    free = [plain_greedy(tiny_llama, p, MAX_NEW, frozenset()) for p in prompts]
    stoppers = frozenset({free[0][2], free[3][1]})  # two rows end early, at different steps
    config = GenerationConfig(MAX_NEW, (), stoppers)
    rows = [extractor.prompt.encode(tiny_llama.tokenizer, [extractor.prompt.suffix_text({"text": t})])[0].suffix_ids for t in TEXTS]
    generations, timing = generate_rows(tiny_llama.model, tiny_llama.tokenizer, extractor.prefix, rows, Decoding(config))
    lengths = {len(g.token_ids) for g in generations}
    assert len(lengths) > 1, "the test must make rows finish at different steps"
    for i, (prompt, generation) in enumerate(zip(prompts, generations)):
        want = plain_greedy(tiny_llama, prompt, MAX_NEW, stoppers)
        assert list(generation.token_ids) == want, f"row {i} diverged after other rows finished"
        assert generation.finish == ("eos" if want[-1] in stoppers else "length")
    assert timing.tokens == sum(len(g.token_ids) for g in generations) and timing.first_token_s <= timing.seconds


def test_stop_strings_cut_the_text(tiny_llama, extract_task):
    extractor = Extractor(tiny_llama, extract_task)
    rows = [extractor.prompt.encode(tiny_llama.tokenizer, [extractor.prompt.suffix_text({"text": t})])[0].suffix_ids for t in TEXTS[:4]]
    free, _ = generate_rows(tiny_llama.model, tiny_llama.tokenizer, extractor.prefix, rows,
                            Decoding(GenerationConfig(MAX_NEW)))
    stop = free[1].text[3:5]
    assert stop, "the free-running text should be long enough to pick a stop string from"
    cut, _ = generate_rows(tiny_llama.model, tiny_llama.tokenizer, extractor.prefix, rows,
                           Decoding(GenerationConfig(MAX_NEW, (stop,))))
    assert cut[1].finish == "stop" and cut[1].text == free[1].text[: free[1].text.find(stop)]
    for a, b in zip(free, cut):
        assert stop not in b.text and a.token_ids[: len(b.token_ids)] == b.token_ids


def test_generation_never_mutates_the_prefix(tiny_llama, extract_task):
    extractor = Extractor(tiny_llama, extract_task)
    before = extractor.prefix.checksum()
    extractor.extract_all(records_from_texts(TEXTS), RunConfig("batched", 3))
    assert extractor.prefix.checksum() == before


# --- parsing and records --------------------------------------------------------------------


def test_parse_fields():
    declared = ["order_id", "sentiment"]
    ok = parse_fields('{"order_id": "A-1", "sentiment": "negative", "extra": 1} trailing', declared)
    assert ok.fields == {"order_id": "A-1", "sentiment": "negative"} and ok.error is None
    partial = parse_fields('{"order_id": null}', declared)
    assert partial.fields == {"order_id": None} and "sentiment" in partial.error
    assert "not valid JSON" in parse_fields('{"order_id": A-1}', declared).error
    assert "no JSON object" in parse_fields("I cannot help with that", declared).error
    assert parse_fields('prefix {"order_id": 1, "sentiment": "x"}', declared).fields == {"order_id": 1, "sentiment": "x"}


def test_every_record_gets_a_result_and_errors_name_the_record(tiny_llama, extract_task):
    extractor = Extractor(tiny_llama, extract_task)
    records = [Record("ok", {"text": "refund"}), Record("missing", {"body": "x"}), Record("list", {"text": ["a"]})]
    results = extractor.extract_all(records, RunConfig("batched", 8))
    assert [r.id for r in results] == ["ok", "missing", "list"]
    assert results[0].raw is not None and (results[0].fields is not None or "JSON" in results[0].error)
    assert results[1].raw is None and "'missing'" in results[1].error and "'text'" in results[1].error
    assert set(results[0].to_json()) == {"id", "fields", "raw", "error", "confidence", "flagged"}


@pytest.mark.parametrize("mode", ["full", "cached", "batched"])
def test_a_record_past_the_context_is_an_error_naming_it_and_the_others_run(tiny_llama, extract_task, mode):
    """Before, a record far past the context went into the pass and asked for tens of GB (the bad-input corpus's
    'huge' row took the whole job down); now it is refused before it runs, like the server's 422."""
    extractor = Extractor(tiny_llama, extract_task)
    long_text = " ".join(["refund my card"] * 400)  # well past the tiny model's 512 positions
    records = [Record("a", {"text": "refund"}), Record("huge", {"text": long_text}), Record("b", {"text": "crash"})]
    results = extractor.extract_all(records, RunConfig(mode, 8))
    assert [r.id for r in results] == ["a", "huge", "b"]
    assert results[1].raw is None and "'huge'" in results[1].error and "max_new_tokens" in results[1].error
    assert "512-token context" in results[1].error
    assert results[0].raw is not None and results[2].raw is not None


def test_verify_extract_and_pool_sharing(tiny_llama, extract_task, task):
    pool = PrefixPool()
    extractor = Extractor(tiny_llama, extract_task, pool=pool)
    agreement, _, _ = verify_extract(extractor, records_from_texts(TEXTS), RunConfig("batched", 4))
    assert agreement.ok, f"cached generation differs from uncached on {agreement.differing_ids}"
    Classifier(tiny_llama, task, pool=pool).prefix
    assert pool.stats().entries == 2, "classification and extraction prefixes live in one pool"
    again = Extractor(tiny_llama, extract_task, pool=pool)
    again.extract_all(records_from_texts(TEXTS[:2]), RunConfig("batched", 2))
    assert again.last_lookup.source == "memory"


def test_compare_extractions_spots_a_difference(tiny_llama, extract_task):
    extractor = Extractor(tiny_llama, extract_task)
    a = extractor.extract_all(records_from_texts(TEXTS[:3]), RunConfig("batched", 3))
    b = list(a)
    b[1] = type(a[1])(a[1].id, a[1].fields, (a[1].raw or "") + "x", a[1].error, a[1].token_ids + (1,))
    assert compare_extractions(a, b).differing_ids == [1]


# --- task files -----------------------------------------------------------------------------


def test_bundled_extract_task_and_kinds():
    spec = load_any_task("ticket-fields")
    assert isinstance(spec, ExtractTask) and list(spec.fields) == ["order_id", "product", "sentiment"]
    assert "ticket-fields" in bundled_task_names(("extract",)) and "ticket-fields" not in bundled_task_names()
    with pytest.raises(TaskError, match="prefixcache extract"):
        load_task("ticket-fields")
    assert load_any_task("support-tickets").kind == "classify"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda y: y.replace("{product: app, sentiment: negative}", "{product: app}"), "example 1 lacks ['sentiment']"),
        (lambda y: y.replace("{product: app, sentiment: negative}", "{product: app, sentiment: x, colour: red}"), "undeclared ['colour']"),
        (lambda y: y + "labels: {a: b}\n", "unknown key (allowed: name, kind, instruction, fields"),
        (lambda y: y.replace("max_new_tokens: 10", "max_new_tokens: 0"), "max_new_tokens"),
        (lambda y: y.replace("fields:\n  product", "fields: {}\nx:\n  product"), "fields"),
    ],
)
def test_extract_task_errors_name_the_field(edit, message):
    with pytest.raises(TaskError, match="bad.yaml") as info:
        parse_task(edit(EXTRACT_YAML), "bad.yaml", kinds=("extract",))
    assert message in str(info.value)


# --- CLI and bench --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, "qwen2")


@pytest.fixture
def files(tmp_path):
    task_file = tmp_path / "fields.yaml"
    task_file.write_text(EXTRACT_YAML)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"ticket": f"T{i}", "body": t}) + "\n" for i, t in enumerate(TEXTS[:5])))
    return str(task_file), str(data)


def test_cli_extract_writes_one_line_per_record(model_dir, files, tmp_path):
    task_file, data = files
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(
        app,
        ["extract", data, "--task", task_file, "--model", model_dir, "--dtype", "float32", "--text-field", "body",
         "--id-field", "ticket", "--batch-size", "3", "--out", str(out), "--cache-dir", str(tmp_path / "kv")],
        catch_exceptions=False,
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"T{i}" for i in range(5)]
    assert all(set(r) == {"id", "fields", "raw", "error", "confidence", "flagged"} for r in rows)
    assert result.exit_code == (1 if any(r["error"] for r in rows) else 0), result.output
    assert "tokens/s" in result.stderr and "prefix pool:" in result.stderr


def test_cli_extract_gives_a_bad_row_an_error_line_and_goes_on(model_dir, files, tmp_path):
    """A row that is not UTF-8 or not JSON is an error line naming its line and field; the others are extracted
    (before, the first bad row stopped the whole job with exit 2)."""
    task_file, _ = files
    data = tmp_path / "mixed.jsonl"
    good = [json.dumps({"ticket": f"T{i}", "body": t}).encode() for i, t in enumerate(TEXTS[:3])]
    data.write_bytes(b"\n".join([good[0], b'{"ticket": "bad", "body": "caf\xe9"}', good[1], b"{not json", good[2]]) + b"\n")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(
        app,
        ["extract", str(data), "--task", task_file, "--model", model_dir, "--dtype", "float32", "--text-field", "body",
         "--id-field", "ticket", "--out", str(out)],
        catch_exceptions=False,
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert result.exit_code == 1, result.output
    assert len(rows) == 5 and [r["id"] for r in rows if r["id"] is not None][:1] == ["T0"]
    assert "mixed.jsonl:2:" in rows[1]["error"] and "'body'" in rows[1]["error"] and "UTF-8" in rows[1]["error"]
    assert "mixed.jsonl:4:" in rows[3]["error"] and "JSON" in rows[3]["error"]
    assert [r["id"] for r in (rows[0], rows[2], rows[4])] == ["T0", "T1", "T2"]
    assert all(r["raw"] is not None for r in (rows[0], rows[2], rows[4])), "the good rows were extracted"


def test_cli_verify_covers_extract_tasks(model_dir, files):
    task_file, data = files
    result = CliRunner().invoke(
        app, ["verify", data, "--task", task_file, "--model", model_dir, "--dtype", "float32", "--text-field", "body", "--json"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    report = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert report["records"] == report["identical"] == 5 and report["differing_ids"] == []


def test_cli_classify_refuses_an_extract_task(model_dir, files):
    task_file, data = files
    result = CliRunner().invoke(app, ["classify", data, "--task", task_file, "--model", model_dir, "--text-field", "body"])
    assert result.exit_code == 2 and "prefixcache extract" in result.output


@pytest.mark.slow
def test_bench_extract_reports_ttft_and_tokens_per_s(model_dir, files, tmp_path):
    task_file, _ = files
    roomy = tmp_path / "roomy.yaml"  # room for the tiny tokenizer's shortest constrained answer
    roomy.write_text(EXTRACT_YAML.replace("max_new_tokens: 10", "max_new_tokens: 40"))
    options = BenchOptions(task=str(roomy), items=4, model=model_dir, dtype="float32", threads=None, batch_size=4, llama_cpp=False)
    lines: list[str] = []
    report, document = run_extract_bench(options, log=lines.append)
    assert [r.mode for r in report.results] == ["full", "cached", "batched", "cached-stepwise", "batched-unconstrained",
                                                "batched-static"]
    assert all(r.label_agreement == 1.0 for r in report.results[:4]), "cached outputs must equal uncached outputs"
    assert report.results[5].label_agreement == 1.0, "static batches give what the engine loop gives"
    lanes = {lane["mode"]: lane for lane in document["extract"]}
    for name in ("full", "cached", "batched", "cached-stepwise", "batched-static"):
        lane = lanes[name]
        assert lane["ttft_ms_mean"] > 0 and lane["tokens_per_s"] > 0 and lane["identical"] == 1.0 and lane["constrained"]
        assert lane["parse_errors"] == 0, f"{name}: a constrained output failed to parse"
    assert not lanes["batched-unconstrained"]["constrained"] and lanes["batched-unconstrained"]["parse_errors"] > 0
    assert document["constrained_over_unconstrained"] > 0
    assert any("time to first token" in line for line in lines)
    assert {"model", "items", "prefix_tokens", "threads"} <= set(document)
    assert document["memory_read_gb_s"] > 0
    assert document["weight_bytes"] == weight_bytes(tiny_loaded("qwen2").model)  # float32, the tied head once
    assert document["decode_floor_tokens_per_s"] == pytest.approx(
        document["memory_read_gb_s"] * 1e9 / document["weight_bytes"]
    )
    for lane in document["extract"]:
        assert lane["pct_of_floor"] == pytest.approx(100 * lane["tokens_per_s"] / document["decode_floor_tokens_per_s"])
        assert lane["pct_of_floor"] > 0 or lane["tokens_per_s"] == 0
    assert any("decoding floor" in line for line in lines)
