"""Where prefixcache keeps files on disk. Imports no torch (``cache ls`` answers at once).

* :func:`cache_home`: ``$PREFIXCACHE_HOME``, else ``$XDG_CACHE_HOME/prefixcache``, else ``~/.cache/prefixcache``;
  converted models live under ``models/``.
* :func:`default_prefix_dir`: the folder ``cache ls`` and ``cache clear`` read without ``--cache-dir``:
  ``$PREFIXCACHE_CACHE_DIR`` (which is also every command's ``--cache-dir`` when that is not given), else
  ``cache_home() / "prefixes"``.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "PREFIXCACHE_CACHE_DIR"


def cache_home() -> Path:
    """Root of prefixcache's on-disk cache (``$PREFIXCACHE_HOME`` or ``~/.cache/prefixcache``)."""
    env = os.environ.get("PREFIXCACHE_HOME")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prefixcache"


def default_prefix_dir() -> Path:
    """``$PREFIXCACHE_CACHE_DIR``, else ``cache_home() / "prefixes"``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else cache_home() / "prefixes"
