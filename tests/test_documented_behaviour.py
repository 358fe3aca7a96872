"""What the README and the docs say about the command line and the server holds (issue 40's findings):
tables printed off a terminal at full width, a bare `cache ls`, `serve --head`, verify's float32 default, and
OpenAI's error shape for the middleware's 401 and 413 on the OpenAI-compatible routes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest
import typer
from typer.testing import CliRunner

from prefixcache.cache.manifest import DiskFolder
from prefixcache.cli import serve as serve_command
from prefixcache.cli.app import app
from prefixcache.server import ServerSettings, ServerThread, create_app

from tests.support.models import tiny_loaded
from tests.server.live import call

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

WIDE_TABLE = """
from prefixcache.bench.lanes import ModeResult
from prefixcache.cli.errors import out
from prefixcache.cli.reports import timing_table
rows = [ModeResult(mode, "bfloat16", b, 600, 9.5, 18.28, 0.95, 3.1e-01, 1000, 1.0, 23.0, 201, 0, "full", 2**31, 0, 41.0)
        for mode, b in (("full", 1), ("cached", 1), ("batched", 32))]
out.print(timing_table(rows, "gguf:SmolLM2-135M-Instruct.Q4_1.gguf | 600 items | prefix 149 tok | 2 threads"))
"""


def test_tables_are_printed_at_full_width_when_stdout_is_not_a_terminal():
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "COLUMNS": "80"}
    printed = subprocess.run([sys.executable, "-c", WIDE_TABLE], capture_output=True, text=True, env=env, check=True).stdout
    for header in ("mode", "dtype", "items", "ms/item", "items/s", "x full", "agree", "max|Δlp|", "ties", "%peak",
                   "%shape", "peak RSS"):
        assert header in printed
    assert "…" not in printed, printed
    assert "batched" in printed and "18.28x" in printed and "2.0 GiB" in printed
    assert max(len(line) for line in printed.splitlines()) > 80


def test_a_bare_cache_ls_reads_the_default_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PREFIXCACHE_CACHE_DIR", raising=False)
    result = runner.invoke(app, ["cache", "ls"])
    assert result.exit_code == 0, result.output
    assert str(tmp_path / "home" / "prefixes") in result.output and "does not exist" in result.output
    DiskFolder(tmp_path / "home" / "prefixes", create=True)
    listed = runner.invoke(app, ["cache", "ls"])
    assert listed.exit_code == 0 and "0 stored prefixes" in listed.output
    assert runner.invoke(app, ["cache", "clear"]).exit_code == 0


def test_the_cache_dir_variable_is_every_commands_cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "shared"
    DiskFolder(folder, create=True)
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(folder))
    listed = runner.invoke(app, ["cache", "ls", "--json"])
    assert listed.exit_code == 0 and listed.output == ""  # the folder exists and holds nothing
    command = typer.main.get_command(app)
    for name in ("classify", "verify", "extract"):
        ctx = command.commands[name].make_context(name, ["x.jsonl"], resilient_parsing=True)
        assert ctx.params["cache_dir"] == folder, name


def test_verify_checks_in_float32_unless_told_otherwise():
    verify = typer.main.get_command(app).commands["verify"]
    ctx = verify.make_context("verify", ["x.jsonl"])
    assert ctx.params["dtype"] == "float32"
    assert "float32" in next(p for p in verify.params if p.name == "dtype").help


@pytest.fixture
def captured_server(monkeypatch):
    """``serve`` with the server itself replaced: what it would have served."""
    seen = {}
    monkeypatch.setattr(serve_command, "server_runner", lambda: lambda loaded, specs, settings, level: seen.update(specs=specs))
    monkeypatch.setattr(serve_command, "load", lambda *args: None)
    return seen


def test_serve_head_scores_the_one_task_through_that_head(captured_server, tmp_path, monkeypatch):
    head = tmp_path / "h.safetensors"
    head.write_bytes(b"x")
    monkeypatch.setattr("prefixcache.engine.head_file.load_head", lambda path: None)
    result = runner.invoke(app, ["serve", "--task", "support-tickets", "--head", str(head)])
    assert result.exit_code == 0, result.output
    (spec,) = captured_server["specs"]
    assert spec.name == "support-tickets" and spec.head == str(head.resolve())


def test_serve_head_is_refused_beside_two_tasks_or_for_a_missing_file(captured_server, tmp_path):
    two = runner.invoke(app, ["serve", "--task", "support-tickets", "--task", "natcs-intents", "--head", "h.safetensors"])
    assert two.exit_code == 2 and "exactly one" in two.output
    missing = runner.invoke(app, ["serve", "--task", "support-tickets", "--head", str(tmp_path / "none.safetensors")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    assert "specs" not in captured_server


@pytest.fixture(scope="module")
def keyed_server(task):
    settings = ServerSettings(api_key="k", max_body_bytes=2048)
    with ServerThread(create_app(tiny_loaded("qwen2"), [task], settings)) as running:
        yield running


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/models"])
def test_openai_routes_refuse_a_missing_key_in_openais_error_shape(keyed_server, path):
    method, body = ("GET", None) if path == "/v1/models" else ("POST", {"model": "m", "prompt": "x"})
    status, headers, answer = call(keyed_server, method, path, body)
    assert status == 401 and set(answer) == {"error"}
    assert answer["error"]["type"] == "authentication_error" and "API key" in answer["error"]["message"]


def test_the_openai_client_raises_its_own_errors_for_401_and_413(keyed_server):
    anonymous = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        anonymous.models.list()
    assert "API key" in refused.value.message
    keyed = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.APIStatusError) as too_big:
        keyed.completions.create(model="m", prompt="x" * 4096)
    assert too_big.value.status_code == 413
    assert too_big.value.body["type"] == "invalid_request_error" and "max_body_bytes" in too_big.value.body["message"]


def test_other_routes_keep_the_detail_shape(keyed_server):
    status, _, answer = call(keyed_server, "POST", "/v1/classify", {"task": "t", "items": []})
    assert status == 401 and set(answer) == {"detail"}
    status, _, answer = call(keyed_server, "POST", "/v1/classify", raw=b"x" * 4096, headers={"Authorization": "Bearer k"})
    assert status == 413 and set(answer) == {"detail"}
