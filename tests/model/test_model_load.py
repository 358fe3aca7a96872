"""Model specs: unknown names and unreachable hub ids fail fast with a message that says what to do."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch

from prefixcache.errors import ModelNotFoundError
from prefixcache.model.load import local_source, resolve_dtype


def test_unknown_bare_name():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        local_source("gpt-17")


def test_unreachable_hub_id_fails_fast_and_says_what_to_do(monkeypatch, tmp_path):
    """The real probe dials a hub endpoint that refuses connections (port 443 of the loopback address,
    where nothing listens): no mock. The bound is on behaviour: the probe's connect timeout is 3 s."""
    from huggingface_hub import constants

    endpoint = "https://127.0.0.1"  # the probe connects to port 443 of the endpoint's host
    with pytest.raises(OSError):  # the premise: nothing listens there
        socket.create_connection(("127.0.0.1", 443), timeout=3).close()
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)  # huggingface_hub reads HF_ENDPOINT once, at import
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # so the probe really dials
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache: the model is not there
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    started = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as info:
        local_source("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(info.value)
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in message  # huggingface_hub >= 1.0 has no huggingface-cli
    assert 'model="smollm2-135m"' in message
    assert time.perf_counter() - started < 30, "an unreachable hub must fail within a few connect timeouts"


def test_missing_gguf_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such .gguf"):
        local_source(str(tmp_path / "nope.gguf"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        local_source(str(tmp_path))


def _expected_auto_cpu_dtype() -> torch.dtype:
    """Decided here from /proc/cpuinfo's flags, independently of prefixcache: native bf16 -> bfloat16."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: no flags to read, so no claim of native bf16
        return torch.float32
    flags = {flag for line in lines if line.startswith("flags") for flag in line.partition(":")[2].split()}
    return torch.bfloat16 if flags & {"avx512_bf16", "amx_bf16"} else torch.float32


def test_dtype_resolution():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", cpu) == _expected_auto_cpu_dtype(), "auto on this CPU must follow its bf16 flags"
    with pytest.raises(ValueError):
        resolve_dtype("int3", cpu)


@pytest.mark.parametrize("spec", ["/nonexistent/model", "./no-such-model", "~/no-such-model", "a/b/c"])
def test_missing_folder_path_says_the_folder_does_not_exist(spec):
    with pytest.raises(ModelNotFoundError, match="no such model folder") as info:
        local_source(spec)
    assert "does not exist" in str(info.value) and spec in str(info.value)


def test_a_file_that_is_not_a_gguf_is_not_a_model(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="is a file, not a model folder"):
        local_source(str(path))


def test_an_invalid_hub_id_is_a_model_not_found_error():
    with pytest.raises(ModelNotFoundError, match="nor a valid Hugging Face id"):
        local_source("no such model!")


# --- random:<arch> ---------------------------------------------------------------------------------------


@pytest.fixture
def tiny_arch(monkeypatch):
    """A tiny architecture in the catalog, paired with the tests' tiny tokenizer instead of the embedded one's:
    (its name, the tokenizer specs asked for)."""
    from prefixcache.model import load as load_module
    from prefixcache.model.catalog import MODEL_CONFIGS

    from tests.support.models import make_tokenizer, tiny_config

    tokenizer = make_tokenizer()
    params = {"model_type": "qwen2", **tiny_config("qwen2", len(tokenizer)).to_diff_dict()}
    params.pop("transformers_version", None)
    monkeypatch.setitem(MODEL_CONFIGS, "tiny-qwen2", params)
    asked = []  # the tokenizer specs asked for, in order
    monkeypatch.setattr(load_module, "load_model_tokenizer", lambda spec: asked.append(spec) or tokenizer)
    return "tiny-qwen2", asked


def test_random_arch_is_that_architecture_with_the_same_seeded_weights_every_time(tiny_arch):
    from prefixcache.model.load import load_model

    tiny_arch, _ = tiny_arch
    first = load_model(f"random:{tiny_arch}", "float32")
    second = load_model(f"random:{tiny_arch}", "float32")
    assert first.spec == f"random:{tiny_arch}" and first.identity == f"random:{tiny_arch}"
    assert first.config.model_type == "qwen2" and first.config.hidden_size == 64 and first.config.num_hidden_layers == 2
    assert first.dtype == torch.float32 and not first.model.training
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "two loads must give the same weights"


def test_random_arch_takes_the_default_models_tokenizer_unless_one_is_named(tiny_arch):
    from prefixcache.model import load as load_module
    from prefixcache.model.catalog import DEFAULT_MODEL

    tiny_arch, asked = tiny_arch
    load_module.load_model(f"random:{tiny_arch}", "float32")
    named = load_module.load_model(f"random:{tiny_arch}@/models/tokenizer", "float32")
    assert asked == [DEFAULT_MODEL, "/models/tokenizer"]
    assert named.spec == f"random:{tiny_arch}@/models/tokenizer" and named.config.hidden_size == 64


def test_an_unknown_random_arch_names_the_known_ones():
    from prefixcache.model.load import load_model

    with pytest.raises(ModelNotFoundError, match="qwen2.5-0.5b"):
        load_model("random:gpt-17", "float32")


def test_classify_runs_on_a_random_arch_through_the_cli(tiny_arch, tmp_path):
    import json

    from typer.testing import CliRunner

    from prefixcache.cli.app import app

    from tests.support.tasks import TASK_YAML, TEXTS

    tiny_arch, _ = tiny_arch
    (tmp_path / "task.yaml").write_text(TASK_YAML)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["classify", str(tmp_path / "in.jsonl"), "--task", str(tmp_path / "task.yaml"),
                                      "--model", f"random:{tiny_arch}", "--dtype", "float32", "--id-field", "id",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"random:{tiny_arch}" in result.output, "the load line names the random architecture"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(len(TEXTS))]
    assert all(r["label"] in {"billing", "technical", "account"} for r in rows)
