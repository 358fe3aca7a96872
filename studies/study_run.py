"""What the llama.cpp studies share: their command line (``--items``, ``--threads``, ``--json``) and the facts every
study JSON opens with (machine, date, the commit checked out when the run started)."""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from prefixcache.model.load import set_threads
from prefixcache.model.machine import machine_info


def study_args(doc: str, items: int) -> tuple[argparse.Namespace, int, dict]:
    """Parse the study's command line; returns the arguments, the threads set, and the JSON's opening facts."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--items", type=int, default=items)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return args, threads, {"machine": machine_info("float32", threads), "date": time.strftime("%Y-%m-%d"),
                           "commit": commit}
