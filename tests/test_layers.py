"""The layers contract ([tool.importlinter] in pyproject.toml): each layer imports only the layers below it,
and no two sibling modules import each other, directly or round about. Checked with import-linter's own
``lint-imports``; the second and third tests show the contract fails on a deliberately added bad import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")

pytestmark = [
    pytest.mark.source_text,
    pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (pip install '.[test]')"),
]


def lint(project: Path, src: Path) -> subprocess.CompletedProcess:
    """Run ``lint-imports`` on ``project``'s pyproject.toml, importing ``prefixcache`` from ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=project, env=env, capture_output=True, text=True, timeout=300)


def copy_project(tmp_path: Path) -> Path:
    """The package and pyproject.toml copied into ``tmp_path``; returns the copied package folder."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "src" / "prefixcache", tmp_path / "src" / "prefixcache", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "src" / "prefixcache"


def test_the_package_keeps_its_layers_and_has_no_cycles():
    result = lint(ROOT, ROOT / "src")
    assert result.returncode == 0, f"the layers contract is broken:\n{result.stdout}\n{result.stderr}"
    assert "2 kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.slow
def test_an_upward_import_breaks_the_contract(tmp_path):
    """Storage (cache/) importing the record loop (run/), as quant.py once did inside a function."""
    package = copy_project(tmp_path)
    layouts = package / "cache" / "layouts.py"
    layouts.write_text(layouts.read_text() + "\n\ndef _upward():\n    from ..scheduler.classify import Classifier\n\n    return Classifier\n")
    result = lint(tmp_path, tmp_path / "src")
    assert result.returncode != 0, f"an upward import passed the contract:\n{result.stdout}"
    assert "prefixcache.cache.layouts -> prefixcache.scheduler.classify" in result.stdout, result.stdout
    assert str(tmp_path) in lint_origin(tmp_path), "lint-imports read the copy, not the installed package"


@pytest.mark.slow
def test_a_cycle_between_siblings_breaks_the_contract(tmp_path):
    """The disk tier importing the pool, which imports the disk tier."""
    package = copy_project(tmp_path)
    disk = package / "cache" / "disk.py"
    disk.write_text(disk.read_text() + "\n\ndef _cycle():\n    from .pool import PrefixPool\n\n    return PrefixPool\n")
    result = lint(tmp_path, tmp_path / "src")
    assert result.returncode != 0, f"a cycle passed the contract:\n{result.stdout}"
    assert "no cycles between sibling modules or packages BROKEN" in " ".join(result.stdout.split()), result.stdout


def lint_origin(project: Path) -> str:
    """Where ``prefixcache`` is imported from with the PYTHONPATH :func:`lint` sets."""
    code = "import importlib.util; print(importlib.util.find_spec('prefixcache').origin)"
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
