# Study behind docs/server.md, "Limits and roles" (what an uploaded task costs to parse or refuse).
"""How long a task upload takes to parse or to refuse, best of three, on the machine it runs on.

* a valid task of about 1.2 MiB (a classification task whose labels have long descriptions and whose examples
  are many), read by libyaml's C loader (what the server uses) and by the pure-Python loader;
* a valid task at the default ``max_task_bytes`` (256 KiB), through ``parse_upload`` as the server reads it;
* tasks with 500 and 4,000 labels that are not strings, and an upload with 3,000 such labels: refused;
* 5,000 levels of nesting read by the pure-Python loader (what libyaml refuses at once).

    PYTHONPATH=src python studies/task_parse_cost.py
"""

from __future__ import annotations

import time

import yaml

from prefixcache.errors import PrefixCacheError
from prefixcache.model.machine import machine_info, machine_name
from prefixcache.server.settings import ServerSettings
from prefixcache.server.uploads import parse_upload
from prefixcache.task import yaml_source


def task_text(labels: int, description: int, examples: int) -> str:
    """A valid classification task: ``labels`` labels with descriptions of ``description`` characters, and
    ``examples`` worked examples."""
    lines = ["name: big", "kind: classify", "instruction: Route the ticket.", "labels:"]
    lines += [f"  label_{i}: \"{('word ' * (description // 5)).strip()}\"" for i in range(labels)]
    lines += ["examples:"]
    lines += [f"  - text: \"ticket number {i} about something that broke again today\"\n    label: label_{i % labels}"
              for i in range(examples)]
    return "\n".join(lines) + "\n"


def bad_labels(count: int) -> str:
    """A task whose ``count`` labels map to numbers, not description strings."""
    return "name: big\nkind: classify\ninstruction: Route it.\nlabels:\n" + "".join(f"  l{i}: {i}\n" for i in range(count))


def best_of(runs: int, work) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def refused(text: str, settings: ServerSettings) -> None:
    try:
        parse_upload("big", "application/yaml", text.encode(), settings, ("classify",))
    except PrefixCacheError:
        return
    raise AssertionError("the upload was accepted")


def nested_refused(levels: int) -> None:
    try:
        yaml_source._compose(yaml_source.UniqueKeyLoader, "a: " + "[" * levels + "]" * levels + "\n")
    except RecursionError:
        return
    raise AssertionError("the nesting was read")


def main() -> None:
    big = task_text(labels=400, description=2_000, examples=6_000)
    default = task_text(labels=100, description=1_500, examples=1_000)
    roomy = ServerSettings(max_task_bytes=2 * len(big), max_labels=10_000, max_examples=100_000)
    rows = [
        (f"valid task, {len(big) / 2**20:.2f} MiB, C loader", best_of(3, lambda: yaml_source._compose(yaml_source.FAST_LOADER, big))),
        (f"valid task, {len(big) / 2**20:.2f} MiB, pure-Python loader", best_of(3, lambda: yaml_source._compose(yaml_source.UniqueKeyLoader, big))),
        (f"valid task, {len(default) / 2**10:.0f} KiB, parse_upload", best_of(3, lambda: parse_upload(
            "big", "application/yaml", default.encode(), roomy, ("classify",)))),
        ("500 labels that are not strings, refused", best_of(3, lambda: refused(bad_labels(500), roomy))),
        ("4,000 labels that are not strings, refused (max_labels 10,000)", best_of(3, lambda: refused(bad_labels(4_000), roomy))),
        ("5,000 levels of nesting, pure-Python loader (it recurses until it gives up)",
         best_of(3, lambda: nested_refused(5_000))),
        (f"{len(bad_labels(3_000)) / 1000:.0f} KB upload with 3,000 such labels, refused at the default max_labels",
         best_of(3, lambda: refused(bad_labels(3_000), ServerSettings()))),
    ]
    print(f"{machine_name(machine_info('float32'))}; PyYAML {yaml.__version__}, libyaml {yaml.__with_libyaml__}; best of 3\n")
    print("| upload | seconds |\n|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
