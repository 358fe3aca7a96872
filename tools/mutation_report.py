"""Print mutmut's kill rate per module, from the meta files `mutmut run` leaves under ./mutants/.

Usage (from the directory where `mutmut run` ran):  python tools/mutation_report.py [--survivors] [MUTANTS_DIR]

One row per mutated module: killed / survived / timeout / other / not run / total / kill %.
"kill %" counts timeouts as killed (a mutant that hangs the tests is caught) and is taken over the
mutants that were run; mutants not run yet (a partial run) are shown, not counted.
`--survivors` also lists each surviving mutant's name, for `mutmut show NAME`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# mutmut 3's exit-code meaning (mutmut/stats.py: status_by_exit_code).
KILLED = {1, 3}
SURVIVED = {0}
TIMEOUT = {36, 24, -24, 152, 255}
NOT_RUN = {None}


def status(code: int | None) -> str:
    if code in KILLED:
        return "killed"
    if code in SURVIVED:
        return "survived"
    if code in TIMEOUT:
        return "timeout"
    if code in NOT_RUN:
        return "not run"
    if code in (5, 33):
        return "no tests"
    return "other"


def module_name(meta: Path, root: Path) -> str:
    rel = meta.relative_to(root).as_posix()[: -len(".py.meta")]
    return rel.removeprefix("src/").replace("/", ".")


def collect(root: Path) -> dict[str, dict[str, str]]:
    """{module: {mutant name: status}} for every meta file under root."""
    out: dict[str, dict[str, str]] = {}
    for meta in sorted(root.rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        out[module_name(meta, root)] = {k: status(v) for k, v in data["exit_code_by_key"].items()}
    return out


def table(results: dict[str, dict[str, str]]) -> str:
    cols = ("killed", "survived", "timeout", "no tests", "other", "not run")
    head = f"{'module':34} " + " ".join(f"{c:>8}" for c in cols) + f" {'total':>6} {'kill %':>7}"
    lines = [head, "-" * len(head)]
    for module, by_name in results.items():
        counts = {c: sum(1 for s in by_name.values() if s == c) for c in cols}
        run = len(by_name) - counts["not run"]
        caught = counts["killed"] + counts["timeout"]
        pct = f"{100 * caught / run:6.1f}%" if run else "    n/a"
        lines.append(f"{module:34} " + " ".join(f"{counts[c]:>8}" for c in cols) + f" {len(by_name):>6} {pct:>7}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    show_survivors = "--survivors" in argv
    args = [a for a in argv if not a.startswith("--")]
    root = Path(args[0] if args else "mutants")
    if not root.is_dir():
        print(f"no {root}/ here: run `make mutants` (or `mutmut run`) first", file=sys.stderr)
        return 2
    results = collect(root)
    if not results:
        print(f"no mutmut meta files under {root}/", file=sys.stderr)
        return 2
    print(table(results))
    if show_survivors:
        for module, by_name in results.items():
            for name, s in by_name.items():
                if s in ("survived", "no tests", "other"):
                    print(f"{s:9} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
