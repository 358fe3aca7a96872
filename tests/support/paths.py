"""Where things are, for tests that read the repository's own files (docs, task files, the source tree)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "prefixcache"
DOCS = REPO / "docs"
DATA = REPO / "tests" / "data"
