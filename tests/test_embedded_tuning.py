"""Prefix tuning end to end on the embedded SmolLM2-135M, through the CLI: `fit --tune prefix` writes a head file
that `eval --head` scores better than the untuned prompt on rows it never saw, that `verify --head` holds to the
batched path's labels and to the stored prefix, and that is refused, with exit 2 and the difference named, for
another task."""

from __future__ import annotations

import csv
import json
import random

import pytest
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.io.records import bundled_dataset

pytestmark = [pytest.mark.embedded, pytest.mark.slow]
PER_LABEL_FIT, PER_LABEL_SCORED = 12, 20


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """The bundled NatCS utterances, 12 rows per intent to fit on and 20 other rows per intent to score."""
    with open(bundled_dataset("natcs/utterances.csv"), newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    random.Random(0).shuffle(rows)
    fit, scored, taken = [], [], {}
    for row in rows:
        count = taken.get(row["label"], 0)
        taken[row["label"]] = count + 1
        if count < PER_LABEL_FIT:
            fit.append(row)
        elif count < PER_LABEL_FIT + PER_LABEL_SCORED:
            scored.append(row)
    folder = tmp_path_factory.mktemp("tuning")
    paths = {}
    for name, part in (("fit", fit), ("scored", scored)):
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"id": r["id"], "text": r["text"], "label": r["label"]}) + "\n" for r in part))
    paths["head"] = folder / "tuned.safetensors"
    return paths


def run(*args: str):
    result = CliRunner().invoke(app, list(args))
    return result


@pytest.fixture(scope="module")
def tuned(split):
    result = run("fit", str(split["fit"]), "--task", "natcs-intents", "--label-field", "label", "--tune", "prefix",
                 "--epochs", "2", "--out", str(split["head"]), "--dtype", "float32", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_tuned_prefix_beats_the_untuned_prompt_on_rows_it_never_saw(split, tuned):
    common = [str(split["scored"]), "--task", "natcs-intents", "--label-field", "label", "--json", "--dtype", "float32"]
    prompt = run("eval", *common)
    with_tuned = run("eval", *common, "--head", str(split["head"]))
    assert prompt.exit_code == 0 and with_tuned.exit_code == 0, prompt.output + with_tuned.output
    before = json.loads(prompt.stdout.strip().splitlines()[-1])["accuracy"]
    after = json.loads(with_tuned.stdout.strip().splitlines()[-1])["accuracy"]
    assert after >= before + 0.10, f"tuned prefix {after:.1%} vs untuned prompt {before:.1%} on {5 * PER_LABEL_SCORED} rows"
    assert tuned["tuned"]["prefix_tokens"] == tuned["tuned"]["prompt_tokens"]


def test_verify_holds_a_tuned_prefix_to_one_record_per_pass_and_to_the_stored_prefix(split, tuned, tmp_path):
    result = run("verify", str(split["scored"]), "--task", "natcs-intents", "--head", str(split["head"]), "--json",
                 "--cache-dir", str(tmp_path / "prefixes"))
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout.strip().splitlines()[-1])
    assert document["reference"] == "cached" and document["stored_prefix_equal"] is True
    assert document["agree"] == document["records"] == 5 * PER_LABEL_SCORED


def test_a_tuned_prefix_for_another_task_is_refused_with_exit_2(split, tuned):
    result = run("classify", str(split["scored"]), "--task", "support-tickets", "--head", str(split["head"]))
    assert result.exit_code == 2, result.output
    assert "prompt" in result.output and "labels" in result.output
