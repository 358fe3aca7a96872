"""The demo end to end on a tiny model: 600 bundled tickets, a float32 side-by-side table, a results folder."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from tests.support.models import make_tokenizer, save_tiny_model, tiny_config, tiny_loaded
from prefixcache.cli.app import app
from prefixcache.io.records import bundled_dataset, read_rows, to_records
from prefixcache.cli.demo import float32_twin
from prefixcache.model.load import LoadedModel, build_random_model
from prefixcache.scheduler.classify import Classifier, RunConfig
from prefixcache.task.definition import load_task


def long_context_llama() -> LoadedModel:
    """conftest's tiny Llama with room for the bundled task: its prompt takes ~1,550 of the tiny BPE's tokens,
    past the 512 positions of conftest's models, where every record would be an error line and there is
    nothing to compare."""
    tokenizer = make_tokenizer()
    config = tiny_config("llama", len(tokenizer))
    config.max_position_embeddings = 4096
    model = build_random_model(config, dtype=torch.float32, seed=0)
    return LoadedModel(model, tokenizer, "tiny-llama-4k", "tiny-llama-4k-seed0", torch.float32, torch.device("cpu"))


@pytest.mark.slow
def test_demo_classifies_the_bundled_tickets_and_proves_agreement(tmp_path_factory, tmp_path):
    loaded = long_context_llama()
    folder = save_tiny_model(tmp_path_factory, loaded=loaded)
    result = CliRunner().invoke(
        app, ["demo", "--model", folder, "--dtype", "float32", "--subset", "6", "--batch-size", "16", "--out-dir", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert "accuracy on 600 bundled tickets" in result.output
    assert "labels equal to full re-encoding: 6/6 in every mode" in result.output
    (results,) = tmp_path.glob("demo-*")
    lines = (results / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 600 and {"id", "label", "confidence", "scores", "margin"} <= set(json.loads(lines[0]))
    errors = [row["error"] for row in map(json.loads, lines) if row.get("error") is not None]
    assert not errors, f"{len(errors)} tickets were not classified, e.g. {errors[:1]}"
    summary = json.loads((results / "summary.json").read_text())
    assert [t["mode"] for t in summary["timing"]] == ["full", "cached", "batched"]
    for t in summary["timing"]:
        assert t["dtype"] == "float32" and t["label_agreement"] == 1.0, t
        assert t["tokens_computed"] > 0, f"{t['mode']}: nothing was scored: {t}"
        assert t["max_abs_logprob_diff"] <= 1e-4, f"{t['mode']}: log-probs drift from full re-encoding: {t}"
        assert t["disagreements_outside_ties"] == 0, t
    # the written scores are full re-encoding's, computed here in-process from the same weights
    rows = list(read_rows(bundled_dataset()))[:6]
    reference = Classifier(loaded, load_task("support-tickets")).classify_all(to_records(rows, id_field="id"), RunConfig("full", 1))
    for line, want in zip(lines, reference):
        got = json.loads(line)
        assert got["id"] == want.id and got["label"] == want.label, f"{want.id}: the demo's label differs from full"
        for label, logprob in zip(want.scores.labels, want.scores.logprobs):
            drift = abs(math.log(got["scores"][label]) - logprob)
            assert drift <= 1e-4, f"{want.id}: the demo's log P({label}) is {drift:.2e} from full re-encoding's"


def test_float32_twin_copies_a_bfloat16_model_and_keeps_a_float32_one():
    task = load_task("support-tickets")
    fast = Classifier(tiny_loaded("qwen2", dtype=torch.bfloat16), task)
    twin = float32_twin(fast)
    assert twin is not fast and twin.loaded.dtype == torch.float32 and fast.loaded.dtype == torch.bfloat16
    assert next(twin.loaded.model.parameters()).dtype == torch.float32
    assert twin.prompt.prefix_ids == fast.prompt.prefix_ids and twin.method == fast.method
    exact = Classifier(tiny_loaded("qwen2"), task)
    assert float32_twin(exact) is exact


@pytest.mark.slow
def test_demo_pool_runs_five_tasks_through_a_budget_that_holds_three(tmp_path_factory, monkeypatch):
    """``demo --pool`` on the long-context tiny Llama: no pool ever holds more than the budget, the disk tier
    serves evicted prefixes back with the same labels, and int8 storage holds fewer bytes than float.

    The tiny BPE makes the bundled tickets-compact prompt a fifth of the others (no budget then holds every
    three and no four), so here the five tasks are variants of support-tickets of similar sizes (and shorter,
which keeps the test's prefix builds short)."""
    import re

    from prefixcache.cache.eviction import POLICIES
    from prefixcache.cli import demo_pool

    tickets = load_task("support-tickets")
    variants = [tickets.model_copy(update={"name": f"tickets-{k}", "examples": tickets.examples[:k]}) for k in (6, 5, 4, 3)]
    variants.append(tickets.model_copy(update={"name": "tickets-6-reversed", "examples": tickets.examples[5::-1]}))
    monkeypatch.setattr(demo_pool, "five_tasks", lambda: variants)
    folder = save_tiny_model(tmp_path_factory, loaded=long_context_llama())
    result = CliRunner().invoke(app, ["demo", "--pool", "--model", folder, "--dtype", "float32", "--subset", "6"])
    assert result.exit_code == 0, result.output
    text = result.output
    budget = int(re.search(r"budget \S+ \S+ \(([\d,]+) B\): any three fit, no four do", text).group(1).replace(",", ""))
    held = [int(n.replace(",", "")) for n in re.findall(r"bytes held \S+ \S+ \(([\d,]+) B,", text)]
    assert len(held) == len(POLICIES) + 2, f"each policy, LRU with the disk tier, and int8: {text}"
    assert all(0 < h <= budget for h in held), f"a pool held more than its budget {budget}: {held}"
    assert "disk loads  0" not in text.split("lru+disk")[1].split("\n")[0], "evicted prefixes must come back from disk"
    assert "labels from the disk-loaded prefix equal labels from a computed one: True (6 tickets, source disk)" in text
    saved = re.search(r"held \S+ \S+ where float would hold \S+ \S+: \S+ \S+ saved \((\d+)%\)", text)
    assert saved and int(saved.group(1)) > 0, text
    assert len(re.findall(r"\n  \S+\s+\d+ tokens ", text)) == 5, "the five prefixes are listed"


def test_the_pool_demos_budget_holds_any_three_prefixes_and_no_four():
    from prefixcache.cli.demo_pool import choose_budget

    budget = choose_budget([100, 90, 95, 85, 80])
    assert budget == 90 + 95 + 100, "the three largest fit"
    assert budget < 80 + 85 + 90 + 95, "the four smallest do not"
    assert choose_budget([10, 10, 10, 100, 100]) is None, "three large ones outweigh four small ones: no such budget"
