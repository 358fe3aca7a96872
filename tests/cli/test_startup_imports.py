"""Start-up imports: a one-record ``classify`` pulls in no heavy library it does not use, and the task layer
(prompts, tokenizer, chat templates) imports neither torch nor transformers.

Each run is a fresh interpreter (``tests/support/import_probe.py``), which records, for each watched library, the
innermost module of ours on the stack when the library was first imported: a check of what is imported and
by whom, with no timing in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML

pytestmark = pytest.mark.slow  # each test runs a fresh interpreter through a whole command

ROOT = Path(__file__).resolve().parents[2]
# Libraries a one-record classify has no use for (transformers: unless the model needs the fallback).
HEAVY = ("transformers", "pandas", "pyarrow", "sklearn", "scipy", "sympy", "matplotlib", "accelerate", "gguf",
         "llguidance", "ray", "fastapi", "uvicorn")
# The modules that build a model through transformers when it needs the fallback (the lean decoder needs none).
MODEL_FILES = {"prefixcache.attention.shared_prefix", "prefixcache.cache.kv", "prefixcache.model.load"}


def probe(tmp_path: Path, *command: str) -> dict:
    out = tmp_path / "imports.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PREFIXCACHE_DEBUG": ""}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "import_probe.py"), str(out), ",".join(HEAVY), "--", *command],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def assert_only_the_model_imports_heavy_libraries(report: dict) -> None:
    imported = set(report["modules"])
    wrong = {lib: report["importers"].get(lib) for lib in HEAVY
             if lib in imported and report["importers"].get(lib) not in MODEL_FILES}
    assert not wrong, f"imported by modules that do not build the model (library: importer): {wrong}"


def test_a_one_record_classify_imports_no_heavy_library_outside_the_model(tmp_path_factory, tmp_path):
    model = save_tiny_model(tmp_path_factory, "llama")
    (tmp_path / "task.yaml").write_text(TASK_YAML)
    (tmp_path / "one.jsonl").write_text('{"id": "r1", "text": "I was charged twice"}\n')
    report = probe(tmp_path, "classify", str(tmp_path / "one.jsonl"), "--task", str(tmp_path / "task.yaml"),
                   "--model", model, "--out", str(tmp_path / "labels.jsonl"), "--threads", "1")
    assert json.loads((tmp_path / "labels.jsonl").read_text())["label"] in {"billing", "technical", "account"}
    assert_only_the_model_imports_heavy_libraries(report)
    heavy = sorted(set(HEAVY) & set(report["modules"]))
    assert not heavy, f"a Llama model runs on the lean decoder and the lean tokenizer, yet {heavy} were imported"


def test_the_probe_names_the_module_that_imports_a_library(tmp_path_factory, tmp_path):
    """The same run reading Parquet: pyarrow is then needed, and the probe names our reader as its importer,
    which the check above would refuse."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = save_tiny_model(tmp_path_factory, "llama")
    (tmp_path / "task.yaml").write_text(TASK_YAML)
    pq.write_table(pa.table({"id": ["r1"], "text": ["I was charged twice"]}), tmp_path / "one.parquet")
    report = probe(tmp_path, "classify", str(tmp_path / "one.parquet"), "--task", str(tmp_path / "task.yaml"),
                   "--model", model, "--out", str(tmp_path / "labels.jsonl"), "--threads", "1")
    assert report["importers"]["pyarrow"] == "prefixcache.io.records"
    with pytest.raises(AssertionError, match="pyarrow"):
        assert_only_the_model_imports_heavy_libraries(report)


@pytest.mark.embedded
def test_a_one_record_classify_of_the_embedded_model_imports_no_heavy_library_outside_the_model(tmp_path):
    first = (ROOT / "src" / "prefixcache" / "datasets" / "support_tickets.jsonl").read_text().splitlines()[0]
    (tmp_path / "one.jsonl").write_text(first + "\n")
    report = probe(tmp_path, "classify", str(tmp_path / "one.jsonl"), "--task", "support-tickets",
                   "--out", str(tmp_path / "labels.jsonl"))
    assert (tmp_path / "labels.jsonl").read_text().count("\n") == 1
    assert_only_the_model_imports_heavy_libraries(report)


def test_the_task_layer_imports_neither_torch_nor_transformers(tmp_path):
    """Rendering a prompt, tokenizing it and finding its restart point need only tokenizers and jinja2."""
    folder = tmp_path / "tokenizer"
    from tests.support.models import make_tokenizer

    make_tokenizer().save_pretrained(folder)
    script = (
        "import sys, json\n"
        "from prefixcache.task.tokenizer import load_tokenizer\n"
        "from prefixcache.task.definition import parse_task\n"
        "from prefixcache.task.prompt import build_prompt\n"
        "from prefixcache.task.chat import chat_prompt\n"
        f"tok = load_tokenizer({str(folder)!r})\n"
        f"prompt = build_prompt(parse_task({TASK_YAML!r}, 'tiny.yaml'), tok)\n"
        "assert prompt.restart is not None and prompt.encode(tok, ['refund please'])[0].suffix_ids\n"
        "chat_prompt(tok, [{'role': 'user', 'content': 'hi'}])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    modules = {name.partition(".")[0] for name in json.loads(done.stdout)}
    assert not modules & {"torch", "transformers", "numpy", *HEAVY}, sorted(modules & {"torch", "transformers", "numpy", *HEAVY})
