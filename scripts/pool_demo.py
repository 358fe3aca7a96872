"""Pool demo: five tasks through a prefix pool whose budget holds three, on the embedded model.

Prints, from one run:

1. the five prefixes and their sizes, and the budget (chosen so that any three fit and no four do);
2. for each eviction policy, the pool's counters after the same access sequence
   (hits, misses, evictions, bytes held, prefill tokens saved, partial reuses),
   then LRU again with the disk tier, where evicted prefixes come back from disk;
3. cold start: the time to get all five prefixes ready in a fresh pool, computed
   (no disk tier) vs loaded from the disk tier that step 2 filled, plus a check
   that labels from disk-loaded prefixes equal labels from computed ones;
4. int8 storage: bytes held against float, and label agreement against float storage.

Usage: python scripts/pool_demo.py [--model smollm2-135m] [--records 4] [--check-records 24] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from prefixcache.io.records import bundled_dataset, read_records  # noqa: E402
from prefixcache.model.load import load_model  # noqa: E402
from prefixcache.cache.pool import POLICIES, PoolConfig, PrefixPool, format_bytes  # noqa: E402
from prefixcache.task.prompt import build_prompt  # noqa: E402
from prefixcache.eval.verify_storage import storage_agreement  # noqa: E402
from prefixcache.scheduler.classify import Classifier, RunConfig  # noqa: E402
from prefixcache.cache.disk import DiskStore  # noqa: E402
from prefixcache.task.definition import load_task  # noqa: E402

ACCESSES = [0, 1, 2, 3, 4, 0, 0, 2, 1, 4, 0, 3, 2, 0, 4]
"""Task indices in the order the demo asks for them (the first five load every task once)."""


def five_tasks():
    """Three bundled tasks and two variants of support-tickets that share its leading part."""
    tickets = load_task("support-tickets")
    head = tickets.model_copy(update={"name": "support-tickets-first9", "examples": tickets.examples[:9]})
    mixed = tickets.model_copy(update={"name": "support-tickets-6+3", "examples": tickets.examples[:6] + tickets.examples[9:]})
    return [tickets, load_task("tickets-compact"), load_task("natcs-intents"), head, mixed]


def choose_budget(sizes: list[int]) -> int:
    """A budget in which any three entries fit and no four do (exits if the sizes allow no such budget)."""
    ordered = sorted(sizes)
    low, high = sum(ordered[-3:]), sum(ordered[:4]) - 1
    if low > high:
        sys.exit(f"no budget holds every three and no four of sizes {sizes}")
    return low


def run_sequence(loaded, tasks, config: PoolConfig, store: DiskStore | None, records, accesses=ACCESSES) -> tuple[PrefixPool, list[str]]:
    pool = PrefixPool(config, store)
    sources = []
    for index in accesses:
        classifier = Classifier(loaded, tasks[index], pool=pool)
        classifier.classify_all(records, RunConfig("batched", 32))
        sources.append(f"{tasks[index].name}:{classifier.last_lookup.source}")
    return pool, sources


def cold_start(loaded, tasks, config: PoolConfig, store: DiskStore | None) -> tuple[float, list[str]]:
    """Seconds to get every task's prefix ready in a fresh pool (prompt building excluded)."""
    pool = PrefixPool(config, store)
    prompts = [build_prompt(t, loaded.tokenizer) for t in tasks]
    started = time.perf_counter()
    sources = [pool.get(loaded, p.prefix_ids, name=t.name).source for t, p in zip(tasks, prompts)]
    return time.perf_counter() - started, sources


def print_stats(title: str, pool: PrefixPool) -> None:
    s = pool.stats()
    print(
        f"  {title:<8} hits {s.hits:>2}  misses {s.misses:>2}  evictions {s.evictions:>2}  "
        f"bytes held {format_bytes(s.bytes_held)} ({s.bytes_held:,} B, {s.entries} entries) of {format_bytes(s.budget_bytes)}  "
        f"prefill tokens saved {s.prefill_tokens_saved:,} (computed {s.prefill_tokens_computed:,})  "
        f"extended {s.partial_reuses}  disk loads {s.disk_loads}  disk writes {s.disk_writes}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--records", type=int, default=4, help="tickets classified at every access")
    parser.add_argument("--check-records", type=int, default=24, help="tickets for the label checks (disk tier, int8)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    started = time.perf_counter()
    loaded = load_model(args.model, "float32", args.threads)
    print(f"model {loaded.identity} (float32) loaded in {time.perf_counter() - started:.1f} s")
    tickets = list(read_records(bundled_dataset(), id_field="id"))
    records, check = tickets[: args.records], tickets[: args.check_records]
    tasks = five_tasks()
    prompts = [build_prompt(t, loaded.tokenizer) for t in tasks]
    sizes = [PrefixPool().size_of(loaded, len(p.prefix_ids)) for p in prompts]
    budget = choose_budget(sizes)
    print("\nfive prefixes:")
    for task, prompt, size in zip(tasks, prompts, sizes):
        print(f"  {task.name:<24} {len(prompt.prefix_ids):>5} tokens  {format_bytes(size):>10}")
    print(f"budget {format_bytes(budget)} ({budget:,} B): any three fit, no four do")
    print(f"access sequence: {' '.join(str(i) for i in ACCESSES)} ({len(ACCESSES)} lookups), {len(records)} tickets each")

    with tempfile.TemporaryDirectory(prefix="prefixcache-pool-demo-") as folder:
        store = DiskStore(folder)
        print("\npool counters after the sequence:")
        runs = [(policy, PoolConfig(budget, policy), None) for policy in POLICIES] + [("lru+disk", PoolConfig(budget), store)]
        for title, config, tier in runs:
            pool, sources = run_sequence(loaded, tasks, config, tier, records)
            print_stats(title, pool)
            print(f"           sources: {', '.join(sources)}")
            assert pool.stats().bytes_held <= budget

        print(f"\ncold start of all five prefixes in a fresh pool ({len(list(Path(folder).glob('*.safetensors')))} files on disk):")
        computed_s, computed_src = cold_start(loaded, tasks, PoolConfig(budget), None)
        loaded_s, loaded_src = cold_start(loaded, tasks, PoolConfig(budget), store)
        print(f"  without disk tier: {computed_s:6.2f} s  ({', '.join(computed_src)})")
        print(f"  with disk tier:    {loaded_s:6.2f} s  ({', '.join(loaded_src)})  -> {computed_s / loaded_s:.1f}x faster")

        from_disk = Classifier(loaded, tasks[0], pool=PrefixPool(PoolConfig(budget), store))
        computed = Classifier(loaded, tasks[0])
        a = [p.label for p in from_disk.classify_all(check, RunConfig("batched", 32))]
        b = [p.label for p in computed.classify_all(check, RunConfig("batched", 32))]
        print(f"  labels from the disk-loaded prefix equal labels from a computed one: {a == b} ({len(a)} tickets, source {from_disk.last_lookup.source})")

    print("\nint8 storage (same budget, the five tasks loaded once each):")
    pool, _ = run_sequence(loaded, tasks, PoolConfig(budget, "lru", "int8"), None, records, accesses=range(len(tasks)))
    print_stats("int8", pool)
    s = pool.stats()
    print(f"  held {format_bytes(s.bytes_held)} where float would hold {format_bytes(s.float_bytes)}: {format_bytes(s.bytes_saved)} saved ({100 * s.bytes_saved / s.float_bytes:.0f}%)")
    agreement = storage_agreement(Classifier(loaded, tasks[0], pool=PrefixPool(PoolConfig(budget, storage="int8"))), check, RunConfig("batched", 32))
    print(
        f"  {tasks[0].name}: int8 labels agree with float storage on {agreement.agree}/{agreement.records} "
        f"({100 * agreement.rate:.1f}%), max |Δ log-prob| {agreement.max_abs_logprob_diff:.3f}"
    )
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
