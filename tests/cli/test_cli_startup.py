"""The CLI starts at once: importing its app, or the package, loads neither torch nor transformers (nor the
engine), and the listing commands run without them. Checked in a fresh interpreter, by module, not by time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "safetensors.torch", "prefixcache.engine", "prefixcache.scheduler", "prefixcache.cache.pool")


def loaded_after(code: str) -> list[str]:
    """The HEAVY modules present in ``sys.modules`` after running ``code`` in a new interpreter."""
    probe = f"{code}\nimport sys, json\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "code",
    [
        "import prefixcache",
        "from prefixcache import Record, RunConfig, Prediction, Mode",
        "import prefixcache.cli.app",
        "from prefixcache.cli.app import app\nfrom typer.testing import CliRunner\nassert CliRunner().invoke(app, ['--help']).exit_code == 0",
        "from prefixcache.cli.app import app\nfrom typer.testing import CliRunner\nassert CliRunner().invoke(app, ['models']).exit_code == 0",
        "from prefixcache.cli.app import app\nfrom typer.testing import CliRunner\nassert CliRunner().invoke(app, ['tasks']).exit_code == 0",
        "from prefixcache.cli.app import app\nfrom typer.testing import CliRunner\nimport tempfile\n"
        "assert CliRunner().invoke(app, ['cache', 'ls', '--cache-dir', tempfile.mkdtemp()]).exit_code == 0",
        "from prefixcache.cli.app import app\nfrom typer.testing import CliRunner\n"
        "assert CliRunner().invoke(app, ['loadtest', '--help']).exit_code == 0",
    ],
    ids=["package", "value types", "cli app", "--help", "models", "tasks", "cache ls", "loadtest --help"],
)
def test_no_engine_at_start_up(code):
    assert loaded_after(code) == [], "the CLI's start-up must not import the engine (docs/architecture.md)"


def test_a_public_name_loads_on_first_use():
    assert "torch" in loaded_after("from prefixcache import Classifier"), "Classifier is the engine, loaded lazily"
