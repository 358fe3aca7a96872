"""Run the README's quick start as written: every fenced block marked ``<!-- run -->`` on the line before it, in
order, as one bash script from the repository root (CI runs it after ``make test``: ``make quickstart``).

A ``python`` block runs through ``.venv/bin/python`` (or this interpreter, with ``--python``); a server started
in the background with ``&`` is stopped when the script ends, however it ends. Exit status: the script's.

    python tools/readme_commands.py --list            # the blocks, as they will run
    python tools/readme_commands.py --run             # run them (needs the embedded model; a few minutes)
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKED = re.compile(r"^<!-- run -->\n```(?P<lang>bash|python)\n(?P<code>.*?)^```", re.S | re.M)
PROLOGUE = """set -euo pipefail
trap 'jobs -p | xargs -r kill 2>/dev/null || true' EXIT
"""


def marked_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, code)`` of every block marked ``<!-- run -->``, in order."""
    return [(m["lang"], m["code"]) for m in MARKED.finditer(text)]


def as_script(blocks: list[tuple[str, str]], python: str) -> str:
    """One bash script: bash blocks as they are, python blocks through ``python`` from a here-document."""
    parts = [PROLOGUE]
    for lang, code in blocks:
        parts.append(code if lang == "bash" else f"{python} - <<'PYTHON'\n{code}PYTHON\n")
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true", help="run the blocks (default: print the script)")
    parser.add_argument("--list", action="store_true", help="print the script that --run runs")
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    parser.add_argument("--python", default=".venv/bin/python", help="the interpreter of python blocks")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the run is stopped (a server that never starts)")
    args = parser.parse_args()
    script = as_script(marked_blocks(Path(args.readme).read_text()), args.python)
    if not args.run:
        print(script)
        return 0
    shell = subprocess.Popen(["bash", "-c", script], cwd=ROOT, start_new_session=True)
    try:
        return shell.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(shell.pid, signal.SIGTERM)  # its own process group: the shell and the server it started
        shell.wait()
        print(f"the quick start did not finish in {args.timeout:g} s", file=sys.stderr)
        return 124


if __name__ == "__main__":
    sys.exit(main())
