"""The ``prefixcache`` command: one typer app, one module per command (``cli/<command>.py``).

Importing this module imports no torch, transformers or engine module: each command imports those
in its body when it runs, so ``--help``, ``tasks``, ``models`` and ``cache ls`` answer at once.
Each command is wrapped in :func:`~prefixcache.cli.errors.reported`, the one place where domain
errors become messages and exit codes.
"""

from __future__ import annotations

import typer

from . import bench, catalog, classify, demo, evaluate, extract, fit, serve, suggest, verify
from .cache import cache_app
from .loadtest import loadtest_app

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Run small language models on narrow automation jobs through a cached prompt prefix.",
)
app.command()(classify.classify)
app.command()(verify.verify)
app.command()(catalog.tasks)
app.command()(catalog.models)
app.command()(demo.demo)
app.command()(bench.bench)
app.command("eval")(evaluate.eval_)
app.command()(fit.fit)
app.command()(suggest.suggest)
app.command()(serve.serve)
app.command()(extract.extract)
app.add_typer(cache_app, name="cache")
app.add_typer(loadtest_app, name="loadtest")


def main() -> None:  # pragma: no cover - entry point
    app()
