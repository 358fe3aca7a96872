"""The soak of ``scripts/loadtest.py --duration SECONDS``: one server, three tasks, a pool that holds two.

``--clients`` closed-loop clients send one-item classify requests for ``--duration`` seconds, cycling over
the three bundled classification tasks, to one ``prefixcache serve`` whose ``--cache-budget`` holds the two
largest prefixes and not the third (so evictions and rebuilds go on the whole time). Every minute it records
the requests answered, errors, p50/p99 latency, the server's resident memory (RSS, from ``psutil``), and the
pool's hits and evictions (from ``/metrics``). The verdict: no errors, RSS at the end within 5% of the first
minute's, and the last minute's p99 within 1.5x of the first's.
"""

from __future__ import annotations

import collections
import json
import threading
import time

SOAK_TASKS = ("support-tickets", "natcs-intents", "tickets-compact")


def budget_for_two(model: str, dtype: str) -> int:
    """Bytes that hold the two largest of :data:`SOAK_TASKS`' prefixes but not all three."""
    from prefixcache import load_model, load_task
    from prefixcache.cache.pool import PrefixPool
    from prefixcache.task.prompt import build_prompt

    loaded = load_model(model, dtype)
    pool = PrefixPool()
    sizes = sorted(pool.size_of(loaded, len(build_prompt(load_task(t), loaded.tokenizer).prefix_ids)) for t in SOAK_TASKS)
    return sizes[1] + sizes[2] + sizes[0] // 2


def soak(args, server_factory, classify_sender, pool_figures) -> bool:
    """Run the soak; print the per-minute table and the verdict; True when every target is met."""
    import psutil

    budget = budget_for_two(args.model, args.dtype)
    server, key = server_factory(budget)
    rss = psutil.Process(server.proc.pid)
    texts = _texts()
    minutes: list[dict] = []
    stop_at = time.monotonic() + args.duration
    lock = threading.Lock()
    current = {"latencies": [], "errors": 0, "codes": collections.Counter()}

    def client(number: int) -> None:
        sends = {task: classify_sender(server.port, key, task) for task in _task_names(SOAK_TASKS)}
        names = list(sends)
        n = number
        while time.monotonic() < stop_at:
            task = names[n % len(names)]
            started = time.perf_counter()
            status, body = sends[task]([{"id": f"c{number}-{n}", "text": texts[n % len(texts)]}])
            with lock:
                current["latencies"].append(time.perf_counter() - started)
                current["errors"] += status != 200
                if status != 200:
                    current["codes"][(status, body[:160])] += 1
            n += len(names) + 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    try:
        for t in threads:
            t.start()
        started = time.monotonic()
        while any(t.is_alive() for t in threads):
            time.sleep(min(60.0, max(0.1, started + 60 * (len(minutes) + 1) - time.monotonic())))
            with lock:
                window, current["latencies"], errors, current["errors"] = current["latencies"], [], current["errors"], 0
            minutes.append(_minute(len(minutes) + 1, window, errors, rss.memory_info().rss, pool_figures(server.port, key)))
            print(_row(minutes[-1]), flush=True)
            with lock:
                for (status, body), count in current["codes"].most_common(3):
                    print(f"    {count} x {status}: {body!r}", flush=True)
                current["codes"].clear()
    finally:
        server.stop()
    return _verdict(minutes, budget, args)


def _task_names(specs) -> list[str]:
    from prefixcache import load_task

    return [load_task(spec).name for spec in specs]


def _texts() -> list[str]:
    from prefixcache.io.records import bundled_dataset

    with open(bundled_dataset(), encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh if line.strip()]


def _minute(number: int, latencies: list[float], errors: int, rss: int, pool: tuple[float, float]) -> dict:
    ordered = sorted(latencies)
    pick = lambda q: 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")
    return {"minute": number, "requests": len(latencies), "errors": errors, "p50_ms": pick(0.5), "p99_ms": pick(0.99),
            "rss_mb": rss / 2**20, "pool_hits": pool[0], "pool_evictions": pool[1]}


def _row(m: dict) -> str:
    return (f"minute {m['minute']:>3}: {m['requests']:>6} requests, {m['errors']} errors, p50 {m['p50_ms']:.0f} ms, "
            f"p99 {m['p99_ms']:.0f} ms, RSS {m['rss_mb']:.0f} MiB, pool hits {m['pool_hits']:.0f}, evictions {m['pool_evictions']:.0f}")


def _verdict(minutes: list[dict], budget: int, args) -> bool:
    if not minutes:
        print("FAIL: no minute was recorded")
        return False
    first, last = minutes[0], minutes[-1]
    errors = sum(m["errors"] for m in minutes)
    growth = last["rss_mb"] / first["rss_mb"] - 1
    p99_ratio = last["p99_ms"] / first["p99_ms"]
    print(f"\nsoak: {args.duration:.0f} s, {args.clients} clients, tasks {', '.join(SOAK_TASKS)}, pool budget {budget / 2**20:.1f} MiB "
          f"(holds two of the three prefixes)")
    print(f"errors {errors} (target 0); RSS {first['rss_mb']:.0f} -> {last['rss_mb']:.0f} MiB, {growth:+.1%} (target <= +5%); "
          f"p99 first minute {first['p99_ms']:.0f} ms, last {last['p99_ms']:.0f} ms, {p99_ratio:.2f}x (target <= 1.5x); "
          f"pool hits {last['pool_hits']:.0f}, evictions {last['pool_evictions']:.0f}")
    ok = errors == 0 and growth <= 0.05 and p99_ratio <= 1.5
    print("PASS" if ok else "FAIL")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump({"duration_s": args.duration, "clients": args.clients, "budget_bytes": budget, "minutes": minutes,
                       "errors": errors, "rss_growth": growth, "p99_ratio": p99_ratio, "ok": ok}, fh, indent=2)
    return ok
