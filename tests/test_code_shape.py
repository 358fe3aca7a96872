"""Size limits on the package (issue 14): no module over 400 lines, no function over 60 (decorators and
docstring included). A long function is split into named steps; a long module into modules that say
what they hold. Checked by parsing src/ with ast.

No function takes more than 7 parameters either ("Names that explain themselves", item 3): settings that
travel together are one small frozen dataclass, built once at the boundary and passed down. The one
exception is a typer command, whose parameters are its options (registered in cli/app.py as
``app.command()(module.function)``, or decorated ``@some_app.command(...)`` or ``@some_app.callback(...)`` in
cli/)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "prefixcache"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 7
MODULES = sorted(SRC.rglob("*.py"))
CLI = SRC / "cli"

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


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The names a call binds: positional-only, ordinary and keyword-only, less a method's leading ``self`` or
    ``cls``. ``*args`` and ``**kwargs`` are not counted: they pass through (an attention function whose
    signature transformers fixes, a wrapper)."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def _is_command_registration(node: ast.AST) -> bool:
    """``X.command(...)`` or ``X.callback(...)``: a typer app registering a command or a group's own options (called
    on the function, or as its decorator)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("command", "callback"))


def typer_commands() -> set[tuple[str, str]]:
    """(module stem, function name) of every typer command in cli/: ``app.command(...)(module.function)`` calls
    (the module named as ``from . import module [as alias]`` imports it) and functions decorated with
    ``@some_app.command(...)`` or ``@some_app.callback(...)``."""
    found = set()
    for path in sorted(CLI.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = {alias.asname or alias.name: alias.name for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None
                   for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _is_command_registration(node.func) and node.args:
                target = node.args[0]
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id in modules):
                    found.add((modules[target.value.id], target.attr))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(_is_command_registration(d) for d in node.decorator_list):
                    found.add((path.stem, node.name))
    return found


def test_the_typer_commands_are_found():
    """The exemption below is not vacuous, nor too wide: it finds the app's commands (top-level and ``cache``), each a
    function defined in cli/, and nothing else."""
    commands = typer_commands()
    assert {("classify", "classify"), ("fit", "fit"), ("serve", "serve"), ("cache", "cache_ls")} <= commands, commands
    defined = {(path.stem, node.name) for path in sorted(CLI.glob("*.py"))
               for node in functions(ast.parse(path.read_text(encoding="utf-8")))}
    assert commands <= defined, f"registered commands not defined in cli/: {sorted(commands - defined)}"
    assert len(commands) >= 13, sorted(commands)  # 11 in cli/app.py, cache ls and cache clear (at least)


def test_no_function_takes_more_than_seven_parameters():
    commands = typer_commands()
    over = []
    for path in MODULES:
        command_module = path.parent == CLI
        for node in functions(ast.parse(path.read_text(encoding="utf-8"))):
            if command_module and (path.stem, node.name) in commands:
                continue  # a typer command's parameters are its options
            if len(parameters(node)) > MAX_PARAMETERS:
                over.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({len(parameters(node))} parameters)")
    assert not over, (f"functions over {MAX_PARAMETERS} parameters (group settings that travel together into a frozen "
                      "dataclass built at the boundary):\n" + "\n".join(over))


def test_the_check_catches_a_long_parameter_list():
    tree = ast.parse(
        "def eight(a, b, c, d, /, e, f, *, g, h): pass\n"
        "def seven(a, b, c, d, e, f, g, *args, **kwargs): pass\n"
        "class C:\n"
        "    def method(self, a, b, c, d, e, f, g): pass\n"
        "    @classmethod\n"
        "    def build(cls, a, b, c, d, e, f, g, h): pass\n"
    )
    counts = {node.name: len(parameters(node)) for node in functions(tree)}
    assert counts == {"eight": 8, "seven": 7, "method": 7, "build": 8}
    assert sorted(name for name, n in counts.items() if n > MAX_PARAMETERS) == ["build", "eight"]
