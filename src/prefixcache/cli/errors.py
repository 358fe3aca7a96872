"""The CLI's boundary: where domain errors become one-line messages and exit codes.

Exit codes: 0 success, 1 verification disagreement or a record failed, 2 a usage
or input error (the message says what to do). ``PREFIXCACHE_DEBUG=1`` re-raises.

Also here: the two consoles (results on standard output, everything else on standard error) and
the checks that turn an option's bad value into a usage error naming the option.
This module imports neither torch nor the engine.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import IO, Callable, Iterable, Optional, TypeVar

import typer
from rich.console import Console

from ..errors import PrefixCacheError

# Off a terminal (a log file, CI, a pipe) rich would cut tables at 80 columns ("items…", "max|Δl…"): there
# each console prints at the tables' full natural width instead (rich never widens a table to the console).
UNBOUNDED = 10_000
err = Console(stderr=True, width=None if sys.stderr.isatty() else UNBOUNDED)
out = Console(width=None if sys.stdout.isatty() else UNBOUNDED)

T = TypeVar("T")


def reported(fn):
    """Turn domain errors into a one-line message and exit code 2 (unless PREFIXCACHE_DEBUG is set)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PrefixCacheError as exc:
            if os.environ.get("PREFIXCACHE_DEBUG"):
                raise
            err.print(f"[bold red]error:[/] {exc.render(cli_spelling)}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def cli_spelling(name: str, value: str | None = None) -> str:
    """A library setting as the CLI's option: ``cache_budget`` -> ``--cache-budget``, ``("method", "full")`` ->
    ``--method full``. The spelling :func:`reported` gives each :func:`~prefixcache.errors.setting` in a message."""
    option = "--" + name.replace("_", "-")
    return option if value is None else f"{option} {value}"


def choice(value: str, choices: Iterable[str], name: str) -> str:
    """``value`` if it is one of ``choices``, else a usage error naming the option ``name``."""
    choices = list(choices)
    if value not in choices:
        raise typer.BadParameter(f"{name} must be one of {', '.join(choices)}")
    return value


def parsed(parse: Callable[[str], T], value: str, name: str) -> T:
    """``parse(value)``; a ``ValueError`` becomes a usage error naming the option ``name``."""
    try:
        return parse(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=name) from None


def output_path(path: Optional[Path], name: str) -> Optional[Path]:
    """``path`` (or None) if a file can be made there: its folder exists and it is not a folder itself.
    Checked before any work is done, so a typo does not cost a model load or a whole run."""
    if path is None:
        return None
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a folder; name a file", param_hint=name)
    if not path.parent.is_dir():
        raise typer.BadParameter(f"{path.parent} is not a folder; create it first", param_hint=name)
    return path


def open_output(path: Path, mode: str, name: str) -> IO[str]:
    """``open(path, mode)`` as UTF-8 text; an OS refusal (permissions, a full disk) is a usage error naming ``name``."""
    try:
        return open(path, mode, encoding="utf-8")
    except OSError as exc:
        raise typer.BadParameter(f"cannot write {path}: {exc.strerror or exc}", param_hint=name) from None


def flag(ctx: typer.Context, name: str) -> str:
    """The command line spelling of parameter ``name`` (``ray_address`` -> ``--ray-address``)."""
    return next(p.opts[0] for p in ctx.command.params if p.name == name)


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the option was set by the user (command line or environment), not left at its default."""
    source = ctx.get_parameter_source(name)  # a ParameterSource of click, or of the click that typer vendors
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")
