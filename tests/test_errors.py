"""One error home (``prefixcache.errors``): messages name settings neutrally, and each boundary spells them.

A library message names a setting with ``setting(name, value)``; ``str(exc)`` reads ``cache_budget`` or
``method="full"``, the CLI's boundary ``--cache-budget`` or ``--method full``, the HTTP app a task field or a
server setting. The guard at the end keeps CLI flags out of the library's messages.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
from pathlib import Path

import pytest
import typer

from prefixcache.cli.errors import reported, cli_spelling
from prefixcache.errors import InputError, PoolBudgetError, PrefixCacheError, PromptError, neutral_spelling, setting
from prefixcache.eval.evaluate import parse_steps

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "prefixcache"


def budget_error() -> PoolBudgetError:
    return PoolBudgetError(
        f"prefix 'p' needs 2 MiB but the whole {setting('cache_budget')} is 1 MiB; raise {setting('cache_budget')}, "
        f"use {setting('kv_storage', 'int8')}, or shorten the task's instruction and examples"
    )


# --- (a) str() is neutral ---------------------------------------------------------------------------------


def test_str_names_the_library_settings_not_flags():
    message = str(budget_error())
    assert message == (
        "prefix 'p' needs 2 MiB but the whole cache_budget is 1 MiB; raise cache_budget, "
        "use kv_storage=\"int8\", or shorten the task's instruction and examples"
    )
    assert "--" not in message and "\x1f" not in message


def test_a_library_message_is_neutral_end_to_end():
    with pytest.raises(InputError) as refused:
        parse_steps("0,x")
    assert str(refused.value).startswith("sweep_examples takes whole numbers") and "--" not in str(refused.value)


def test_neutral_spelling_and_plain_messages():
    assert neutral_spelling("cache_budget") == "cache_budget"
    assert neutral_spelling("method", "full") == 'method="full"'
    assert str(PrefixCacheError("no setting here")) == "no setting here"
    assert PrefixCacheError("no setting here").render(cli_spelling) == "no setting here"
    assert str(PrefixCacheError()) == ""


def test_a_quoted_error_keeps_its_markers():
    """``exc.args[0]`` embedded in another error is still spelled by the boundary that renders the outer one."""
    outer = PrefixCacheError(f"task 't': {budget_error().args[0]}")
    assert "raise --cache-budget, use --kv-storage int8" in outer.render(cli_spelling)
    assert "raise cache_budget" in str(outer)


# --- (b) the CLI's spelling -------------------------------------------------------------------------------


def test_cli_spelling():
    assert cli_spelling("cache_budget", None) == "--cache-budget"
    assert cli_spelling("method", "full") == "--method full"
    assert budget_error().render(cli_spelling).endswith(
        "raise --cache-budget, use --kv-storage int8, or shorten the task's instruction and examples"
    )


def test_the_cli_boundary_prints_flags(capsys):
    @reported
    def command():
        raise PromptError(f"Use {setting('method', 'full')}, or rename one label.")

    with pytest.raises(typer.Exit) as stopped:
        command()
    assert stopped.value.exit_code == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "error: Use --method full, or rename one label." in said


# --- (c) the HTTP app's spelling --------------------------------------------------------------------------


def test_http_spelling():
    pytest.importorskip("fastapi")
    from prefixcache.server.app import http_spelling

    assert http_spelling("cache_budget", None) == "the server's setting cache_budget_bytes"
    assert http_spelling("method", "full") == 'the server\'s setting method="full"'
    assert http_spelling("head", None) == "the task's field 'head'"
    assert http_spelling("kv_storage", "int8") == 'kv_storage="int8" (not a setting of this server)'


def test_the_http_app_answers_in_its_own_words():
    pytest.importorskip("fastapi")
    from prefixcache.server.app import _error_response

    response = asyncio.run(_error_response(None, budget_error()))
    detail = json.loads(response.body)["detail"]
    assert response.status_code == 503
    assert "raise the server's setting cache_budget_bytes" in detail and "--" not in detail


# --- (d) the guard: no CLI flag in a library message --------------------------------------------------------

FLAG = re.compile(r"--[A-Za-z]")
NOT_OURS = re.compile(r"pip install --[a-z-]+")  # another tool's flag, quoted in an install hint
LOG_CALLS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}


def _message_calls(tree: ast.AST):
    """Each ``raise SomeError(...)`` call and each logging call (``log.warning(...)``, ``logging.info(...)``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            yield node.exc
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_CALLS:
            yield node


def flags_in_messages(root: Path) -> list[str]:
    """``file:line: text`` for every string constant (f-string parts included) in a message that names a flag."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "cli":
            continue  # the CLI speaks in flags
        for call in _message_calls(ast.parse(path.read_text(encoding="utf-8"))):
            for argument in [*call.args, *(k.value for k in call.keywords)]:
                for node in ast.walk(argument):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str):
                        if FLAG.search(NOT_OURS.sub("", node.value)):
                            found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.value!r}")
    return found


def test_no_library_message_names_a_cli_flag():
    found = flags_in_messages(PACKAGE)
    assert not found, "name a setting with errors.setting(...), not a CLI flag:\n" + "\n".join(found)


def test_the_guard_catches_a_flag(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "bad.py").write_text(
        "import logging\n"
        "def f(x):\n"
        "    logging.getLogger().warning('use --cache-dir %s', x)\n"
        "    raise ValueError(f'{x}: drop --head')\n"
    )
    (tmp_path / "lib" / "fine.py").write_text("def g():\n    raise ValueError('run `pip install --no-deps x`')\n")
    found = flags_in_messages(tmp_path / "lib")
    assert sorted(line.split(":")[:2] for line in found) == [["lib/bad.py", "3"], ["lib/bad.py", "4"]]
