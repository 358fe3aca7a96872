"""The README's commands as written: every `prefixcache` line in the README's and the docs' shell blocks parses
against the real command line (options that exist, values among the choices), and the quick start that CI runs
(`make quickstart`: tools/readme_commands.py) covers fit, classify --head, eval, verify, serve with curl and the
openai client, and the Ray line."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import typer

from prefixcache.cli.app import app
from prefixcache.cli.verify import CACHED_MODES
from prefixcache.model.catalog import DTYPE_CHOICES
from prefixcache.types import METHODS, MODES

ROOT = Path(__file__).resolve().parents[1]
SHELL_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
VARIABLES = {"$TRAIN": "train.jsonl", "$TICKETS": "tickets.jsonl", "$S": "x", "$(BANKING77)": "b.csv"}
CHOICES = {"--dtype": DTYPE_CHOICES, "--method": METHODS, "--mode": MODES}
CHOICES_OF = {("verify", "--mode"): CACHED_MODES}
UsageError = typer.BadParameter.__mro__[1]  # typer's own click (typer._click): NoSuchOption, BadParameter, ...


def load_script():
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / "tools/readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command_lines(text: str) -> list[str]:
    """Each `prefixcache ...` command in the text's bash blocks, continuation lines joined, comments dropped."""
    found = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip().split(" < ")[0].split(" &")[0].split(" > ")[0]
            words = line.split()
            if words and words[0] in ("prefixcache", ".venv/bin/prefixcache", "nice") and "prefixcache" in line:
                found.append(line[line.index("prefixcache"):])
    return found


def check_command(line: str) -> None:
    """Parse ``line`` as the CLI would; raises the CLI's UsageError (unknown option, bad value) or AssertionError."""
    for name, value in VARIABLES.items():
        line = line.replace(name, value)
    words = shlex.split(line)[1:]
    group = typer.main.get_command(app)
    ctx = group.make_context("prefixcache", list(words), resilient_parsing=True)
    name, command, rest = group.resolve_command(ctx, words)
    if hasattr(command, "resolve_command") and rest and rest[0] in command.commands:
        name, command, rest = command.resolve_command(ctx, rest)  # else the group's own options (`loadtest --soak 60`)
    command.make_context(name, list(rest), parent=ctx)  # click consumes the list it is given
    for option, value in zip(rest, rest[1:]):
        allowed = CHOICES_OF.get((name, option), CHOICES.get(option))
        assert allowed is None or value in allowed, f"{line}: {option} {value} is not one of {allowed}"


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_every_documented_command_parses(path):
    problems = []
    for line in command_lines(path.read_text()):
        try:
            check_command(line)
        except (UsageError, AssertionError) as exc:
            problems.append(f"{line}\n    {exc}")
    assert not problems, "\n".join(problems)


def test_a_documented_command_with_a_wrong_option_or_value_is_caught():
    with pytest.raises(AssertionError, match="--mode full"):
        check_command("prefixcache verify tickets.jsonl --mode full")
    with pytest.raises(UsageError):
        check_command("prefixcache classify --ray --start-timeout 60 tickets.jsonl")
    check_command("prefixcache cache ls")  # no --cache-dir needed
    check_command("prefixcache loadtest --soak 600 --clients 32")  # a group's own options
    check_command("prefixcache loadtest fairness --max-batch 32,8")
    with pytest.raises(UsageError):
        check_command("prefixcache loadtest --duration 600")  # the old script's spelling of --soak
    with pytest.raises(UsageError):
        check_command("prefixcache loadtest mixed --soak 600")  # the plain lane's option, on another lane


def test_the_quick_start_that_ci_runs_covers_every_step():
    script = load_script().as_script(load_script().marked_blocks((ROOT / "README.md").read_text()), ".venv/bin/python")
    lines = command_lines("```bash\n" + script + "```\n")
    commands = [shlex.split(line.replace("$TRAIN", "t").replace("$TICKETS", "t"))[1] for line in lines]
    assert {"fit", "classify", "eval", "verify", "serve"} <= set(commands), commands
    assert any("--head" in line and " classify " in f" {line} " for line in lines)
    assert any("--ray" in line for line in lines)
    assert "curl" in script and "import openai" in script and "kill %1" in script
    assert "make quickstart" in (ROOT / ".ci/run").read_text()
    assert "readme_commands.py --run" in (ROOT / "Makefile").read_text()


def test_the_bundled_files_the_quick_start_names_exist():
    text = (ROOT / "README.md").read_text()
    for path in re.findall(r"(?:src|tests)/[\w/.-]+\.jsonl", text):
        assert (ROOT / path).is_file(), path


PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_every_documented_import_of_prefixcache_works(path):
    imports = [line for block in PYTHON_BLOCK.findall(path.read_text()) for line in block.splitlines()
               if re.match(r"(from prefixcache[\w.]* import |import prefixcache)", line)]
    for line in imports:
        exec(compile(line, f"{path.name}: {line}", "exec"), {})
