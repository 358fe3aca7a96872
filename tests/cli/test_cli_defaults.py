"""The CLI types no default twice: each option's default is the library's own (issue 14, item 5).

Walks the real typer app. For every option whose parameter name is also a keyword of a library entry
point (or a field of a settings object), the two defaults must be equal, so changing one place cannot
leave the CLI and the library disagreeing.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import typer.main

from prefixcache.cache.config import PoolConfig
from prefixcache.cli.app import app
from prefixcache.io.records import scan_records
from prefixcache.scheduler.feature_pass import collect_features
from prefixcache.server.settings import ServerSettings
from prefixcache.types import RunConfig

ray = pytest.importorskip("ray", reason="the Ray extra is installed by .ci/run; without it its defaults go unchecked")
from prefixcache.scaleout.job import RayCluster, WorkerSpec  # noqa: E402
from prefixcache.scaleout.ray import run_ray_classify  # noqa: E402

# Parameters whose CLI meaning differs from the library keyword of the same name.
DIFFERENT_MEANING = {
    ("serve", "task"),  # serve takes a list of tasks
    ("bench", "batch_size"),  # bench sweeps its own batch sizes
    ("verify", "dtype"),  # verify is an exactness check: float32 by default (README), whatever auto picks
}
SKIP_VALUES = (None, False)  # "not given" defaults carry no value to drift


def library_defaults() -> dict[str, object]:
    """keyword -> default, over the settings objects and the entry points the CLI calls."""
    found: dict[str, object] = {}
    for settings in (RunConfig(), PoolConfig(), ServerSettings(), RayCluster()):
        for f in dataclasses.fields(settings):
            found.setdefault(f.name, getattr(settings, f.name))
    for f in dataclasses.fields(WorkerSpec):  # its task has no default: the declared defaults of the others
        if f.default is not dataclasses.MISSING:
            found.setdefault(f.name, f.default)
    for fn in (scan_records, collect_features, run_ray_classify):
        for name, p in inspect.signature(fn).parameters.items():
            if p.default is not inspect.Parameter.empty:
                found.setdefault(name, p.default)
    return found


def cli_defaults():
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        for param in command.params:
            if param.default not in SKIP_VALUES and (name, param.name) not in DIFFERENT_MEANING:
                yield name, param.name, param.default


def drift(library: dict[str, object]) -> tuple[list, list[str]]:
    """(options that share a library keyword, a line per option whose default differs)."""
    shared = [(cmd, opt, value) for cmd, opt, value in cli_defaults() if opt in library]
    differ = [
        f"{cmd} --{opt.replace('_', '-')}: CLI {value!r}, library {library[opt]!r}"
        for cmd, opt, value in shared
        if str(value) != str(library[opt])  # a Mode enum and its string are the same default
    ]
    return shared, differ


def test_every_shared_option_default_is_the_library_default():
    shared, differ = drift(library_defaults())
    assert len(shared) >= 10, f"too few options matched a library keyword: {shared}"
    assert not differ, "defaults typed twice and now different:\n" + "\n".join(differ)


def test_the_check_sees_a_drifted_default():
    """The walk is not vacuous: a library default changed in one place is reported, per command."""
    library = library_defaults()
    library["text_field"] = "body"
    _, differ = drift(library)
    assert any(line.startswith("classify --text-field") for line in differ), differ
