"""Size limits on the package (issue 14): no module over 400 lines, no function over 60 (decorators and
docstring included). A long function is split into named steps; a long module into modules that say
what they hold. Checked by parsing src/ with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "prefixcache"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MODULES = sorted(SRC.rglob("*.py"))

pytestmark = pytest.mark.source_text


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def length(node: ast.AST) -> int:
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return node.end_lineno - first + 1


def test_the_package_is_found():
    assert len(MODULES) > 50 and (SRC / "scheduler" / "loop.py") in MODULES, f"no package at {SRC}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_module_and_function_sizes(path):
    text = path.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(SRC)} has {lines} lines (at most {MAX_MODULE_LINES}): split it"
    long = [f"{node.name} (line {node.lineno}): {length(node)} lines" for node in functions(ast.parse(text)) if length(node) > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(SRC)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_check_catches_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (node,) = functions(ast.parse(f"@decorator\ndef f():\n{body}\n"))
    assert length(node) == MAX_FUNCTION_LINES + 2 > MAX_FUNCTION_LINES
