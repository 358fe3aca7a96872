"""``prefixcache cache ls|clear``: the prefix pool's disk tier (``--cache-dir``). Reads headers only: no torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..cache.config import format_bytes
from ..cache.manifest import DiskFolder
from ..model.paths import default_prefix_dir
from .errors import reported, err, out

cache_app = typer.Typer(no_args_is_help=True, help="The prefix pool's disk tier (--cache-dir): list or clear stored prefixes.")
CacheDirArg = typer.Option(
    None, "--cache-dir", help="The folder given to --cache-dir (default: $PREFIXCACHE_CACHE_DIR, else "
    "~/.cache/prefixcache/prefixes, under $PREFIXCACHE_HOME when set)."
)


def chosen_folder(cache_dir: Path | None) -> Path | None:
    """``cache_dir``, or the default folder when it exists; None (after saying so) when the default does not."""
    if cache_dir is not None:
        return cache_dir
    folder = default_prefix_dir()
    if not folder.is_dir():
        err.print(f"{folder}: no stored prefixes (the folder does not exist; a command's --cache-dir, or "
                  f"PREFIXCACHE_CACHE_DIR, names the folder prefixes are saved to)")
        return None
    return folder


@cache_app.command("ls")
@reported
def cache_ls(
    cache_dir: Optional[Path] = CacheDirArg, as_json: bool = typer.Option(False, "--json", help="One JSON object per line.")
):
    """List stored prefixes with their manifests (headers only; data is not read), and the folder's budget
    (with --json, on every line as budget_bytes, null for none)."""
    cache_dir = chosen_folder(cache_dir)
    if cache_dir is None:
        return
    folder = DiskFolder(cache_dir, create=False)
    files, budget = folder.files(), folder.budget_bytes
    if as_json:
        for f in files:
            manifest = f.manifest and f.manifest.to_metadata()
            line = {"file": f.path.name, "bytes": f.size, "manifest": manifest, "problem": f.problem, "budget_bytes": budget}
            print(json.dumps(line))
        return
    limit = f"budget {format_bytes(budget)}" if budget else "no budget"
    table = Table(title=f"{cache_dir}: {len(files)} stored prefixes, {format_bytes(sum(f.size for f in files))} ({limit})")
    for col in ("file", "task", "model", "dtype", "storage", "tokens", "size", "created"):
        table.add_column(col)
    for f in files:
        m = f.manifest
        if m is None:
            table.add_row(f.path.name, f"[red]{f.problem}[/]", "", "", "", "", format_bytes(f.size), "")
        else:
            table.add_row(f.path.name[:16], m.name, m.model, m.dtype, m.storage, m.tokens, format_bytes(f.size), m.created)
    out.print(table)


@cache_app.command("clear")
@reported
def cache_clear(cache_dir: Optional[Path] = CacheDirArg):
    """Delete every stored prefix in the folder (other files and the folder's budget are kept).

    Safe while other processes use the folder: it takes the folder's lock, and a save in progress lands after it."""
    cache_dir = chosen_folder(cache_dir)
    if cache_dir is None:
        return
    cleared = DiskFolder(cache_dir, create=False).clear()
    err.print(f"removed {cleared.files} stored prefixes ({format_bytes(cleared.bytes)}) from {cache_dir}")
