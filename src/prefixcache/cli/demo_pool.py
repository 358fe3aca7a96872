"""``prefixcache demo --pool``: five tasks through a prefix pool whose budget holds three (docs/pool.md).

Prints, from one run: the five prefixes, their sizes and the budget (any three fit, no four do); for each
eviction policy, the pool's counters after the same access sequence, then LRU again with a disk tier, where
evicted prefixes come back from disk; the cold start of all five prefixes computed against loaded from that
disk tier, with a check that labels from a disk-loaded prefix equal those from a computed one; and int8
storage: bytes held against float, and label agreement against float storage.

Every function here imports the engine in its body (the CLI's start-up stays free of torch).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import typer
from rich.console import Console

ACCESSES = (0, 1, 2, 3, 4, 0, 0, 2, 1, 4, 0, 3, 2, 0, 4)
"""Task indices in the order the demo asks for them (the first five load every task once)."""
PER_ACCESS = 4
"""Tickets classified at every access."""
BATCH = 32


def five_tasks() -> list:
    """Three bundled tasks and two variants of support-tickets that share its leading part."""
    from ..task.definition import load_task

    tickets = load_task("support-tickets")
    first9 = tickets.model_copy(update={"name": "support-tickets-first9", "examples": tickets.examples[:9]})
    mixed = tickets.model_copy(update={"name": "support-tickets-6+3", "examples": tickets.examples[:6] + tickets.examples[9:]})
    return [tickets, load_task("tickets-compact"), load_task("natcs-intents"), first9, mixed]


def choose_budget(sizes: list[int]) -> int | None:
    """The smallest budget in which any three entries fit and no four do; None if the sizes allow none."""
    ordered = sorted(sizes)
    low, high = sum(ordered[-3:]), sum(ordered[:4]) - 1
    return low if low <= high else None


def run_sequence(loaded, tasks, config, store, records, accesses=ACCESSES):
    """A fresh pool (over ``store``, if any) through ``accesses``; the pool and each access's lookup source."""
    from ..cache.pool import PrefixPool
    from ..scheduler.classify import Classifier, RunConfig

    pool = PrefixPool(config, store)
    sources = []
    for index in accesses:
        classifier = Classifier(loaded, tasks[index], pool=pool)
        classifier.classify_all(records, RunConfig("batched", BATCH))
        sources.append(f"{tasks[index].name}:{classifier.last_lookup.source}")
    return pool, sources


def cold_start(loaded, tasks, config, store) -> tuple[float, list[str]]:
    """Seconds to get every task's prefix ready in a fresh pool (prompt building excluded), and the sources."""
    from ..cache.pool import PrefixPool
    from ..task.prompt import build_prompt

    pool = PrefixPool(config, store)
    prompts = [build_prompt(t, loaded.tokenizer) for t in tasks]
    started = time.perf_counter()
    sources = [pool.get(loaded, p.prefix_ids, name=t.name).source for t, p in zip(tasks, prompts)]
    return time.perf_counter() - started, sources


def print_stats(out: Console, title: str, pool) -> None:
    from ..cache.pool import format_bytes

    s = pool.stats()
    out.print(
        f"  {title:<8} hits {s.hits:>2}  misses {s.misses:>2}  evictions {s.evictions:>2}  "
        f"bytes held {format_bytes(s.bytes_held)} ({s.bytes_held:,} B, {s.entries} entries) of {format_bytes(s.budget_bytes)}  "
        f"prefill tokens saved {s.prefill_tokens_saved:,} (computed {s.prefill_tokens_computed:,})  "
        f"extended {s.partial_reuses}  disk loads {s.disk_loads}  disk writes {s.disk_writes}",
        highlight=False, soft_wrap=True,
    )


def plan(loaded, tasks, out: Console, err: Console) -> int:
    """Print the five prefixes and the access sequence; the budget (exit 1 when the sizes allow none)."""
    from ..cache.pool import PrefixPool, format_bytes
    from ..task.prompt import build_prompt

    prompts = [build_prompt(t, loaded.tokenizer) for t in tasks]
    sizes = [PrefixPool().size_of(loaded, len(p.prefix_ids)) for p in prompts]
    budget = choose_budget(sizes)
    if budget is None:
        err.print(f"no budget holds every three and no four of the prefix sizes {sizes}")
        raise typer.Exit(1)
    out.print("\nfive prefixes:")
    for task, prompt, size in zip(tasks, prompts, sizes):
        out.print(f"  {task.name:<24} {len(prompt.prefix_ids):>5} tokens  {format_bytes(size):>10}", highlight=False)
    out.print(f"budget {format_bytes(budget)} ({budget:,} B): any three fit, no four do", highlight=False)
    out.print(f"access sequence: {' '.join(map(str, ACCESSES))} ({len(ACCESSES)} lookups), {PER_ACCESS} tickets each",
              highlight=False)
    return budget


def policies_and_disk(loaded, tasks, budget: int, records, check, out: Console) -> None:
    """Every policy through the sequence, LRU again over a disk tier, then the cold start with and without it."""
    from ..cache.config import PoolConfig
    from ..cache.disk import DiskStore
    from ..cache.eviction import POLICIES
    from ..cache.pool import PrefixPool
    from ..scheduler.classify import Classifier, RunConfig

    with tempfile.TemporaryDirectory(prefix="prefixcache-pool-demo-") as folder:
        store = DiskStore(folder)
        out.print("\npool counters after the sequence:")
        runs = [(policy, PoolConfig(budget, policy), None) for policy in POLICIES] + [("lru+disk", PoolConfig(budget), store)]
        for title, config, tier in runs:
            pool, sources = run_sequence(loaded, tasks, config, tier, records)
            print_stats(out, title, pool)
            out.print(f"           sources: {', '.join(sources)}", highlight=False, soft_wrap=True)
        files = len(list(Path(folder).glob("*.safetensors")))
        out.print(f"\ncold start of all five prefixes in a fresh pool ({files} files on disk):")
        computed_s, computed_src = cold_start(loaded, tasks, PoolConfig(budget), None)
        loaded_s, loaded_src = cold_start(loaded, tasks, PoolConfig(budget), store)
        out.print(f"  without disk tier: {computed_s:6.2f} s  ({', '.join(computed_src)})", highlight=False)
        out.print(f"  with disk tier:    {loaded_s:6.2f} s  ({', '.join(loaded_src)})  -> "
                  f"{computed_s / max(loaded_s, 1e-9):.1f}x faster", highlight=False)
        from_disk = Classifier(loaded, tasks[0], pool=PrefixPool(PoolConfig(budget), store))
        a = [p.label for p in from_disk.classify_all(check, RunConfig("batched", BATCH))]
        b = [p.label for p in Classifier(loaded, tasks[0]).classify_all(check, RunConfig("batched", BATCH))]
        out.print(f"  labels from the disk-loaded prefix equal labels from a computed one: {a == b} "
                  f"({len(a)} tickets, source {from_disk.last_lookup.source})", highlight=False)


def int8_storage(loaded, tasks, budget: int, records, check, out: Console) -> None:
    """The five tasks once each into an int8 pool: bytes against float, and label agreement with float storage."""
    from ..cache.config import PoolConfig
    from ..cache.pool import PrefixPool, format_bytes
    from ..eval.verify_storage import storage_agreement
    from ..scheduler.classify import Classifier, RunConfig

    out.print("\nint8 storage (same budget, the five tasks loaded once each):")
    pool, _ = run_sequence(loaded, tasks, PoolConfig(budget, "lru", "int8"), None, records, accesses=range(len(tasks)))
    print_stats(out, "int8", pool)
    s = pool.stats()
    out.print(f"  held {format_bytes(s.bytes_held)} where float would hold {format_bytes(s.float_bytes)}: "
              f"{format_bytes(s.bytes_saved)} saved ({100 * s.bytes_saved / s.float_bytes:.0f}%)", highlight=False)
    classifier = Classifier(loaded, tasks[0], pool=PrefixPool(PoolConfig(budget, storage="int8")))
    agreement = storage_agreement(classifier, check, RunConfig("batched", BATCH))
    out.print(f"  {tasks[0].name}: int8 labels agree with float storage on {agreement.agree}/{agreement.records} "
              f"({100 * agreement.rate:.1f}%), max |Δ log-prob| {agreement.max_abs_logprob_diff:.3f}", highlight=False)


def run_pool_demo(loaded, check_records: int, out: Console, err: Console) -> None:
    """The whole pool demo on ``loaded``; the label checks run on the first ``check_records`` bundled tickets."""
    from ..io.records import bundled_dataset, read_records

    started = time.perf_counter()
    tickets = list(read_records(bundled_dataset(), id_field="id"))
    records, check = tickets[:PER_ACCESS], tickets[:check_records]
    tasks = five_tasks()
    budget = plan(loaded, tasks, out, err)
    policies_and_disk(loaded, tasks, budget, records, check, out)
    int8_storage(loaded, tasks, budget, records, check, out)
    out.print(f"\ntotal {time.perf_counter() - started:.0f} s")
