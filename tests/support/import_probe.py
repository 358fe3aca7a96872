"""Run a prefixcache command and record which module of ours first pulled in each watched library.

    python tests/support/import_probe.py OUT.json LIBRARIES -- classify records.jsonl --task ...

``LIBRARIES`` is a comma-separated list of top-level package names. OUT.json gets
``{"modules": [every top-level module imported], "importers": {library: the innermost prefixcache module on
the stack when it was first imported, or null}}``. A finder placed first on ``sys.meta_path`` sees each
import before it happens and lets the real finders do the work. Used by ``tests/cli/test_startup_imports.py``.
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys
import traceback
from pathlib import Path

SOURCE = str(Path(__file__).resolve().parents[2] / "src" / "prefixcache")


def _module_of(filename: str) -> str | None:
    if not filename.startswith(SOURCE):
        return None
    parts = Path(filename[len(SOURCE) + 1:]).with_suffix("").parts
    return ".".join(("prefixcache", *parts)).removesuffix(".__init__")


class Watch:
    """A meta-path finder that finds nothing: it notes who imports a watched library first."""

    def __init__(self, libraries: set[str]):
        self.libraries = libraries
        self.importers: dict[str, str | None] = {}

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in self.libraries and top not in self.importers:
            ours = [m for m in (_module_of(f.filename) for f in traceback.extract_stack()) if m]
            self.importers[top] = ours[-1] if ours else None
        return None


def main() -> None:
    out, libraries, _, *command = sys.argv[1:]
    watch = Watch(set(libraries.split(",")))
    sys.meta_path.insert(0, watch)

    def report():
        modules = sorted({name.partition(".")[0] for name in sys.modules})
        Path(out).write_text(json.dumps({"modules": modules, "importers": watch.importers}))

    atexit.register(report)
    sys.argv = ["prefixcache", *command]
    runpy.run_module("prefixcache", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
