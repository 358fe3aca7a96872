"""Every figure in the README and the docs' tables is rendered from a committed JSON under docs/bench/, and every
such JSON names the machine it was measured on (prefixcache.bench.tables, prefixcache.model.machine)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.bench import tables
from prefixcache.model.machine import command_line, cpu_flags, cpu_model, machine_caption, machine_info

ROOT = Path(__file__).resolve().parents[1]
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""


def test_every_table_in_the_readme_and_docs_is_what_its_json_renders():
    stale = tables.stale_blocks(ROOT)
    assert not stale, "\n".join(f"{b.path}: {b.spec}\n--- has\n{b.body}--- renders\n{b.expected}" for b in stale)


def test_the_readme_and_the_docs_hold_rendered_tables():
    readme = tables.blocks((ROOT / "README.md").read_text(), "README.md", ROOT)
    kinds = {b.spec.split()[0] for b in readme}
    assert {"lanes", "machines", "accuracy"} <= kinds, kinds
    assert tables.blocks((ROOT / "docs/benchmarks.md").read_text(), "docs/benchmarks.md", ROOT)


@pytest.fixture(scope="module")
def copy_root(tmp_path_factory) -> Path:
    """README.md, docs/*.md and docs/bench/ copied, for a check that edits them."""
    root = tmp_path_factory.mktemp("repo")
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copytree(ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("img"))
    return root


def readme_table_digits(text: str) -> list[int]:
    """Offsets of every digit inside the README's rendered table bodies."""
    return [m.start("body") + d.start() for m in tables.BLOCK.finditer(text) for d in re.finditer(r"\d", m["body"])]


@settings(max_examples=25, deadline=None)
@given(pick=st.integers(min_value=0, max_value=10**6), bump=st.integers(min_value=1, max_value=9))
def test_changing_one_digit_in_a_readme_table_fails_the_check(copy_root, pick, bump):
    readme = copy_root / "README.md"
    original = (ROOT / "README.md").read_text()
    digits = readme_table_digits(original)
    at = digits[pick % len(digits)]
    changed = original[:at] + str((int(original[at]) + bump) % 10) + original[at + 1:]
    readme.write_text(changed)
    try:
        stale = tables.stale_blocks(copy_root)
        assert [b.path for b in stale] == ["README.md"]
        assert tables.main(["--root", str(copy_root)]) == 1
        tables.main(["--write", "--root", str(copy_root)])  # `make tables` puts the JSON's figure back
        assert readme.read_text() == original
    finally:
        readme.write_text(original)


def test_a_figure_changed_in_its_json_makes_the_table_stale(copy_root):
    spec = tables.blocks((ROOT / "README.md").read_text(), "README.md", ROOT)[0].spec
    path = copy_root / spec.split()[1]
    original = path.read_text()
    doc = json.loads(original)
    key = "modes" if "modes" in doc else "timing"
    doc[key][0]["ms_per_item"] = doc[key][0]["ms_per_item"] * 2 + 1
    path.write_text(json.dumps(doc))
    try:
        assert "README.md" in [b.path for b in tables.stale_blocks(copy_root)]
    finally:
        path.write_text(original)


def test_every_bench_json_names_its_machine_and_its_command():
    found = sorted((ROOT / "docs/bench").rglob("*.json"))
    assert found
    for path in found:
        machine = json.loads(path.read_text()).get("machine")
        assert machine, f"{path} names no machine"
        for key in ("cpu", "cores", "dtype", "command"):
            assert machine.get(key), f"{path}: machine has no {key}"
        assert machine.get("gpu") or machine.get("flags"), f"{path}: neither a GPU nor CPU flags"


def test_cpuinfo_is_read_for_the_model_and_the_flags_that_decide_the_dtype():
    assert cpu_model(CPUINFO) == "AMD EPYC 9B14"
    assert cpu_flags(CPUINFO) == ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]
    assert cpu_model("") == "" and cpu_flags("") == []


def test_machine_info_describes_this_process():
    info = machine_info("float32", 3)
    assert info["dtype"] == "float32" and info["threads"] == 3 and info["cores"] >= 1
    assert info["cpu"] and isinstance(info["flags"], list) and "command" in info


def test_the_command_is_written_as_a_user_types_it():
    assert command_line(["/x/prefixcache/__main__.py", "bench", "--items", "12"]) == "prefixcache bench --items 12"
    assert command_line(["/venv/bin/prefixcache", "eval", "a b.jsonl"]) == "prefixcache eval 'a b.jsonl'"
    assert command_line(["/venv/bin/prefixcache", "loadtest", "--json", "x.json"]) == "prefixcache loadtest --json x.json"
    assert command_line(["studies/hostile_requests.py", "--dtype", "float32"]) == "python studies/hostile_requests.py --dtype float32"


def test_captions_name_the_gpu_or_the_cpu_kind():
    gpu = {"gpu": "NVIDIA H200", "cores": 16, "cpu": "host", "dtype": "bfloat16"}
    assert machine_caption(gpu).startswith("NVIDIA H200 (16-core host)")
    assert "AVX2 only" in machine_caption({"cpu": "AMD EPYC", "cores": 2, "flags": ["avx2"], "dtype": "float32"})
    amx = {"cpu": "Intel Xeon", "cores": 2, "flags": ["avx2", "avx512f", "amx_tile"], "dtype": "bfloat16", "note": "n"}
    assert machine_caption(amx) == "2-core Intel Xeon, AMX; run dtype bfloat16; n"


def test_an_unknown_kind_or_a_missing_json_is_refused():
    with pytest.raises(ValueError, match="unknown table kind"):
        tables.render("pie docs/bench/smollm2.json", ROOT)
    with pytest.raises(ValueError, match="names no JSON"):
        tables.render("modes", ROOT)
    with pytest.raises(OSError):
        tables.render("modes docs/bench/none.json", ROOT)


def test_the_demo_table_shows_each_timed_mode_and_the_heads_figures():
    lane = {"batch_size": 1, "ms_per_item": 300.0, "speedup_vs_full": 1.0, "label_agreement": 1.0, "records": 60}
    doc = {"machine": {"cpu": "AMD EPYC", "cores": 2, "flags": ["avx2"], "dtype": "float32"}, "model": "m",
           "prefix_tokens": 609, "dtype": "torch.bfloat16", "accuracy": 0.523, "records": 600,
           "timing": [{**lane, "mode": "full"}, {**lane, "mode": "batched", "batch_size": 32, "ms_per_item": 20.0,
                                                   "speedup_vs_full": 15.0, "label_agreement": 59 / 60}],
           "fitted_head": {"fitted_rows": 300, "scored_rows": 298, "prompt_accuracy": 0.5, "head_accuracy": 0.97}}
    table = tables.demo_table(doc)
    assert "| full | 1 | 300.0 | 1.0x | 60/60 |" in table and "| batched | 32 | 20.0 | 15.0x | 59/60 |" in table
    assert "bfloat16: 52.3%" in table and "prompt 50.0% -> head 97.0%" in table and "2-core AMD EPYC, AVX2 only" in table


def test_the_tuning_table_names_a_later_runs_rows_in_its_caption():
    figures = lambda acc, seconds: {"accuracy": acc, "ece": 0.05, "fit_seconds": seconds, "ms_per_record": 40.0}  # noqa: E731
    machine = {"cpu": "AMD EPYC", "cores": 2, "flags": ["avx2"], "dtype": "float32", "threads": 2, "command": "study tickets"}
    run = {"commit": "abc1234", "date": "2026-12-07",
           "machine": {**machine, "threads": 1, "load_average": [2.0, 2.5, 3.0], "command": "study tickets --only lora"}}
    doc = {"machine": machine, "model": "m", "data": "tickets", "fit_rows": 600, "scored_rows": 75, "prompt_tokens": 609,
           "results": {"prompt alone": figures(0.5, 0.0), "linear head": figures(0.96, 37.0),
                       "LoRA (record tokens)": figures(0.9, 600.0) | {"run": run},
                       "LoRA (record tokens) + head": figures(0.95, 660.0) | {"run": run}}}
    table = tables.tuning_table([doc])
    assert "| tickets (600 fitted -> 75 scored, 609-token prompt) | prompt alone | 50.0% | 5.0% | – | 40.0 |" in table
    assert "| LoRA (record tokens) | 90.0% | 5.0% | 10 min | 40.0 |" in table
    assert ("measured by a later run: tickets, LoRA (record tokens) and LoRA (record tokens) + head: commit abc1234, "
            "2026-12-07, 1 torch thread(s), load average 2.5 over the last 5 minutes when written, "
            "`study tickets --only lora`") in table
    assert table.count("commit abc1234") == 1 and "the commands: `study tickets`" in table


def test_the_tuning_table_shows_the_prompts_examples_and_the_accuracy_of_the_most_confident_rows():
    machine = {"cpu": "AMD EPYC", "cores": 2, "flags": ["avx2"], "dtype": "float32", "threads": 1, "command": "study b77"}
    row = {"accuracy": 0.8, "ece": 0.05, "fit_seconds": 60.0, "ms_per_record": 90.0, "accuracy_at_coverage": 0.95,
           "coverage": 0.651}
    doc = {"machine": machine, "model": "m", "data": "banking77", "fit_rows": 770, "scored_rows": 308,
           "prompt_tokens": 3000, "prompt_examples_per_label": 1, "commit": "abc1234", "date": "2026-12-07",
           "results": {"linear head": row}}
    table = tables.tuning_table([doc])
    assert ("| banking77 (770 fitted -> 308 scored, 3000-token prompt, 1 fitted row(s) per intent as its examples) "
            "| linear head | 80.0% | 5.0% | 1 min | 90.0 | 95.0% at 65% |") in table
    assert "the commands: `study b77` (commit abc1234, 2026-12-07)" in table
    floored = tables.tuning_table([{**doc, "results": {"linear head": row | {"ece_floor": 0.03, "ece_floor_p95": 0.041}}}])
    assert "| linear head | 80.0% | 5.0% (noise: up to 4.1%) | 1 min |" in floored
    assert "most confident" not in tables.tuning_table([{**doc, "results": {"linear head": {
        k: v for k, v in row.items() if k not in ("accuracy_at_coverage", "coverage")}}}])


def test_the_curves_table_shows_each_method_at_each_point_and_why_one_is_absent():
    figures = lambda acc, seconds: {"accuracy": acc, "ece": 0.05, "fit_seconds": seconds, "ms_per_record": 40.0}
    doc = {"machine": {"cpu": "AMD EPYC", "cores": 2, "flags": ["avx2"], "dtype": "float32", "threads": 1}, "model": "m",
           "data": "banking77", "task": "banking77-short", "labels": 77, "scored_rows": 308, "commit": "abc1234",
           "date": "2026-12-07", "epochs": 3, "runs": ["studies/tuning_curves.py banking77"],
           "prompt": figures(0.127, 0.0),
           "points": [{"per_label": 2, "fit_rows": 154, "results": {"linear head": figures(0.42, 30.0),
                                                                  "tuned prefix": figures(0.3, 200.0),
                                                                  "tuned prefix + head": figures(0.5, 260.0)}},
                      {"per_label": "all", "fit_rows": 9695, "results": {"linear head": figures(0.9, 900.0)},
                       "absent": {"tuned prefix": {"why": "not run: expected to take 3600 s", "extrapolated_seconds": 3600}}}]}
    table = tables.curves_table([doc])
    assert "| banking77: method | 2 / intent (154) | all rows (9,695) |" in table
    assert "| prompt alone | 12.7% (5.0%) | 12.7% (5.0%) |" in table
    assert "| linear head | 42.0% (5.0%, 30 s) | 90.0% (5.0%, 15 min) |" in table
    assert "| tuned prefix | 30.0% (5.0%, 3 min) | – |" in table
    assert "banking77, all: tuned prefix not run: expected to take 3600 s" in table and "1 torch thread(s)" in table
    assert "banking77, 2:" not in table and "banking77, all:" in table  # a point like the caption is not named again
    later = {**doc["points"][1], "threads": 2, "epochs": 2,
             "results": {"linear head": {"commit": "def5678", "threads": 1, **figures(0.9, 900.0)}}}
    renamed = tables.curves_table([{**doc, "points": [doc["points"][0], later]}])
    assert "banking77, all: 2 torch thread(s), at most 2 tuning epochs" in renamed
    assert "banking77, all: the linear head from an earlier run (commit def5678, 1 torch thread(s))" in renamed


def test_the_second_model_table_shows_each_model_on_the_same_rows_and_names_each_run():
    machine = {"cpu": "AMD EPYC", "cores": 2, "flags": ["avx2"], "dtype": "float32", "threads": 1, "command": "second b77"}
    row = lambda model, layers, acc: {  # noqa: E731
        "model": model, "layers": layers, "prompt_tokens": 1376, "seconds": 780.0, "commit": "abc1234",
        "date": "2026-12-07", "machine": {**machine, "command": "studies/second_model.py banking77"},
        "prompt alone": {"accuracy": 0.039, "ece": 0.6}, "linear head": {"accuracy": acc, "ece": 0.2, "ece_calibrated": 0.055}}
    doc = {"machine": machine, "data": {"banking77": {"fit_rows": 770, "scored_rows": 308, "scored_ids": "ab", "models": {
        "gguf:a.gguf@sha256:1": row("gguf:a.gguf@sha256:1", 30, 0.705),
        "gguf:b.gguf@sha256:2": row("gguf:b.gguf@sha256:2", 18, 0.753)}}}}
    table = tables.MULTI["second-model"]([doc])
    assert ("| banking77 (`banking77-short`), 770 fitted -> 308 scored | gguf:a.gguf (30 layers) | 1,376 | 3.9% | 70.5% "
            "| 5.5% | 13 min |") in table
    assert "| gguf:b.gguf (18 layers) | 1,376 | 3.9% | 75.3% |" in table
    assert table.count("`studies/second_model.py banking77` (commit abc1234, 2026-12-07)") == 1
    assert "2-core AMD EPYC" in table and "second b77" not in table
