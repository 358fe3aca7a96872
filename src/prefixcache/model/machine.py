"""The machine a figure was measured on, as every ``--json`` writer records it (``bench``, ``eval``, the load test).

:func:`machine_info` returns a plain dict, the ``"machine"`` key of those documents::

    {"cpu": "AMD EPYC", "cores": 2, "flags": ["avx2", "avx512_bf16", ...], "gpu": null,
     "dtype": "bfloat16", "threads": 2, "torch": "2.13.0", "os": "Linux 6.8 x86_64",
     "command": "prefixcache bench --items 120 --json docs/bench/figures/bench.json", "load_average": [1.2, 0.9, 0.5]}

``flags`` keeps only the CPU flags that decide what a run gets (:data:`NOTABLE_FLAGS`); ``dtype`` is the run's
dtype as the caller resolved it. :func:`machine_caption` is the one-line form the docs' tables are captioned with.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path

import torch

NOTABLE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_model(cpuinfo: str) -> str:
    """The first ``model name`` of a ``/proc/cpuinfo`` text ("" when it has none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return ""


def cpu_flags(cpuinfo: str) -> list[str]:
    """The :data:`NOTABLE_FLAGS` the first ``flags`` line of a ``/proc/cpuinfo`` text lists, in that order."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            present = set(value.split())
            return [f for f in NOTABLE_FLAGS if f in present]
    return []


def usable_cores() -> int:
    """Cores this process may run on (its affinity), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gpu_name() -> str | None:
    """The first CUDA device's name, or None without one."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def command_line(argv: list[str] | None = None) -> str:
    """The command this process was started with, as a user would type it: ``prefixcache bench --items 120``
    (also under ``python -m prefixcache``), ``python studies/hostile_requests.py --dtype float32``."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    first = argv[0]
    if first.endswith("__main__.py"):
        first = "prefixcache"
    elif first.endswith(".py"):
        first = f"python {first}"
    else:
        first = Path(first).name
    return " ".join([first, *(shlex.quote(a) for a in argv[1:])])


def machine_info(dtype: str, threads: int | None = None) -> dict:
    """This machine, for a ``--json`` document: CPU model, usable cores, notable flags, GPU, the run's ``dtype``
    and torch ``threads`` (default: torch's current count), torch's version, the OS, the command, and the 1/5/15
    minute load averages when the document is written (a figure from a shared machine means little without them)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    return {
        "cpu": cpu_model(cpuinfo) or platform.processor() or platform.machine(),
        "cores": usable_cores(),
        "flags": cpu_flags(cpuinfo),
        "gpu": gpu_name(),
        "dtype": dtype,
        "threads": threads if threads is not None else torch.get_num_threads(),
        "torch": torch.__version__,
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "command": command_line(),
        "load_average": [round(x, 1) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def machine_name(machine: dict) -> str:
    """A machine dict in a few words: ``"NVIDIA H200 (16-core host)"`` or ``"2-core AMD EPYC, AVX512-BF16, no AMX"``."""
    flags = set(machine.get("flags") or [])
    if machine.get("gpu"):
        return f"{machine['gpu']} ({machine.get('cores', '?')}-core {machine.get('cpu') or 'host'})"
    isa = "AMX" if "amx_tile" in flags else "AVX512-BF16, no AMX" if "avx512_bf16" in flags else (
        "AVX-512" if "avx512f" in flags else "AVX2 only" if "avx2" in flags else "no AVX2")
    return f"{machine.get('cores', '?')}-core {machine.get('cpu') or 'CPU'}, {isa}"


def machine_caption(machine: dict) -> str:
    """:func:`machine_name`, then the run dtype, torch's version and, where the dict has one, its ``note``."""
    parts = [machine_name(machine), f"run dtype {machine.get('dtype', '?')}"]
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    if machine.get("load_average"):
        parts.append(f"load average {machine['load_average'][1]:g} over the last 5 minutes when written")
    if machine.get("note"):
        parts.append(machine["note"])
    return "; ".join(parts)
