"""The cells every docs table is made of: a markdown table, durations, milliseconds, percentages, and the italic
caption that names the machine a JSON was measured on."""

from __future__ import annotations

from ..model.machine import machine_caption


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def ms(value: float) -> str:
    """Milliseconds: 1,351 / 43.7 / 0.74."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}%"


def caption(doc: dict, facts: str) -> str:
    """The italic line under a table: the machine, then the run's own facts and, where recorded, its command."""
    machine = doc.get("machine")
    where = machine_caption(machine) if machine else "machine not recorded"
    command = f" Command: `{machine['command']}`." if machine and machine.get("command") else ""
    return f"\n*Machine: {where}. {facts}.{command}*\n"


def duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
