"""The job file: what a classify job's labels depend on, written beside its output so that
``--resume`` continues only the very same job.

An output's lines say which records are done, not how they were classified. Resuming with another
task, prompt, label set, model, method, dtype or head would silently mix two classifiers' labels in
one file, so a job writes ``<out>.job.json`` (a sidecar, so the output stays pure JSON Lines)
before its first line, and a resume compares it with its own and refuses any difference, naming
each field and both values.

This module knows nothing about models or tasks: only the fingerprint's fields, as strings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from ..errors import InputError, setting

FIELDS = ("task", "prompt", "labels", "model", "method", "dtype", "head", "calibration", "threshold")
# job files written before calibration lack the last two; they read as None, which is what a job without them has
WHAT = {  # how a message names each field, and the option that changes it
    "task": ("the task", "task"),
    "prompt": ("the task's prompt (instruction, examples, template)", "task"),
    "labels": ("the label set", "task"),
    "model": ("the model", "model"),
    "method": ("the scoring method", "method"),
    "dtype": ("the dtype", "dtype"),
    "head": ("the fitted head", "head"),
    "calibration": ("the calibration", "calibration"),
    "threshold": ("the confidence threshold", "min_confidence"),
}


def job_path(out: Path) -> Path:
    """The job file beside the output ``out``: ``<out>.job.json``."""
    return out.with_name(out.name + ".job.json")


def write_job(out: Path, fingerprint: Mapping[str, str | None], notes: Mapping | None = None) -> None:
    """Write ``fingerprint`` to the job file atomically (a temporary file, fsynced, then renamed over it).
    ``notes``: more keys to record that a resume does not compare (how the threshold was chosen, its expected coverage)."""
    path = job_path(out)
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as fh:
        json.dump({**(notes or {}), **{name: fingerprint.get(name) for name in FIELDS}}, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(temporary, path)


def check_job(out: Path, fingerprint: Mapping[str, str | None], done_lines: int) -> None:
    """Refuse to resume ``out`` unless its job file matches ``fingerprint``.

    An output with no lines needs no job file (nothing to mix with).

    Raises:
        InputError: the output has lines but no readable job file, or some field differs (all named).
    """
    path = job_path(out)
    if not path.exists():
        if done_lines:
            raise InputError(f"{out} has {done_lines} lines but no {path.name} beside it, so what classified them "
                             f"cannot be checked: move it aside, or choose another {setting('out')}")
        return
    try:
        stored = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path} cannot be read ({exc}): move {out} and it aside, or choose another {setting('out')}") from exc
    differ = [name for name in FIELDS if not isinstance(stored, dict) or stored.get(name) != fingerprint.get(name)]
    if differ:
        said = "; ".join(f"{WHAT[name][0]} ({setting(WHAT[name][1])}): {_value(stored, name)} then, {fingerprint[name]!r} now"
                         for name in differ)
        raise InputError(f"{out} was written by another job, so resuming would mix two classifiers' labels. What differs: "
                         f"{said}. Resume with the same settings, or choose another {setting('out')}")


def _value(stored, name: str) -> str:
    return repr(stored.get(name)) if isinstance(stored, dict) and name in stored else "missing"
