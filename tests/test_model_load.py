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
