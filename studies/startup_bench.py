# Study behind docs/benchmarks.md, "Start-up" (its wall-time table).
"""Start-up wall times of prefixcache, for two source trees side by side (each command a fresh interpreter).

    git archive main src | tar -x -C /tmp/before        # the tree to compare against
    python studies/startup_bench.py --before /tmp/before/src --after src --runs 3

Runs every command ``--runs`` times per tree, the trees alternating (so drift in the machine's load falls
on both), and prints a Markdown table of the medians: ``import prefixcache.engine``, the engine modules a
classify run imports, loading the embedded model's tokenizer, and a one-record ``classify`` of the embedded
model with the bundled support-tickets task (its first record). Needs the embedded model installed and
converted once (any earlier run does that).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "src" / "prefixcache" / "datasets" / "support_tickets.jsonl"


def commands(work: Path) -> dict[str, list[str]]:
    one = work / "one.jsonl"
    one.write_text(DATA.read_text().splitlines()[0] + "\n")
    py = [sys.executable]
    return {
        "`import prefixcache.engine`": py + ["-c", "import prefixcache.engine"],
        "`import prefixcache.scheduler.classify` (the engine modules classify uses)": py + ["-c", "import prefixcache.scheduler.classify"],
        "the embedded model's tokenizer loaded": py + ["-c", "from prefixcache.model.load import load_model_tokenizer as t; t('smollm2-135m')"],
        "one-record `classify`, embedded model": py + ["-m", "prefixcache", "classify", str(one), "--task", "support-tickets",
                                                       "--out", str(work / "out.jsonl")],
    }


def timed(command: list[str], src: str, work: Path) -> float:
    (work / "out.jsonl").unlink(missing_ok=True)
    (work / "out.jsonl.job.json").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": src}
    started = time.perf_counter()
    subprocess.run(command, env=env, cwd=work, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the src folder to compare against")
    parser.add_argument("--after", required=True, help="the src folder under test")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    trees = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        todo = commands(work)
        runs = {(name, tree): [] for name in todo for tree in trees}
        for _ in range(args.runs):
            for name, command in todo.items():
                for tree, src in trees.items():
                    runs[name, tree].append(timed(command, src, work))
    print("| command | before (s) | after (s) | after / before |")
    print("|---|---|---|---|")
    for name in todo:
        before, after = (statistics.median(runs[name, tree]) for tree in trees)
        print(f"| {name} | {before:.2f} | {after:.2f} | {after / before:.2f} |")
    print(f"\nmedians of {args.runs} runs each, the two trees alternating")


if __name__ == "__main__":
    main()
