"""Model specs: unknown names and unreachable hub ids fail fast with a message that says what to do."""

from __future__ import annotations

import time

import pytest
import torch

from prefixcache.errors import ModelNotFoundError
from prefixcache.models import local_source, resolve_dtype


def test_unknown_bare_name():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        local_source("gpt-17")


def test_unreachable_hub_id_fails_fast_and_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("prefixcache.models._hub_reachable", lambda timeout=3.0: False)
    started = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as info:
        local_source("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(info.value)
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct" in message
    assert "--model smollm2-135m" in message
    assert time.perf_counter() - started < 30


def test_missing_gguf_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such .gguf"):
        local_source(str(tmp_path / "nope.gguf"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        local_source(str(tmp_path))


def test_dtype_resolution():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", cpu) in (torch.float32, torch.bfloat16)
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
