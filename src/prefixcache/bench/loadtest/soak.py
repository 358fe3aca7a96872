"""The soak of ``prefixcache loadtest --soak SECONDS``: one server, three tasks, a pool that holds two.

``--clients`` closed-loop clients send one-item classify requests for that many seconds, cycling over
the three bundled classification tasks, to one ``prefixcache serve`` whose ``--cache-budget`` holds the two
largest prefixes and not the third (so evictions and rebuilds go on the whole time). Every minute it records
the requests answered, errors, p50/p99 latency, the server's resident memory (RSS, from ``psutil``), and the
pool's hits and evictions (from ``/metrics``). The verdict: no errors, RSS at the end within 5% of the first
minute's, and the last minute's p99 within 1.5x of the first's.
"""

from __future__ import annotations

import collections
import json
import secrets
import threading
import time

from .clients import classify_sender
from .options import LoadTestOptions
from .served import Launch, Server, pool_figures, queue_for

SOAK_TASKS = ("support-tickets", "natcs-intents", "tickets-compact")


def budget_for_two(model: str, dtype: str) -> int:
    """Bytes that hold the two largest of :data:`SOAK_TASKS`' prefixes but not all three."""
    from ...cache.pool import PrefixPool
    from ...model.load import load_model
    from ...task.definition import load_task
    from ...task.prompt import build_prompt

    loaded = load_model(model, dtype)
    pool = PrefixPool()
    sizes = sorted(pool.size_of(loaded, len(build_prompt(load_task(t), loaded.tokenizer).prefix_ids)) for t in SOAK_TASKS)
    return sizes[1] + sizes[2] + sizes[0] // 2


class Window:
    """What the clients answered since the last minute was recorded."""

    def __init__(self):
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.errors = 0
        self.codes: collections.Counter = collections.Counter()

    def add(self, seconds: float, status: int, body: bytes) -> None:
        with self.lock:
            self.latencies.append(seconds)
            self.errors += status != 200
            if status != 200:
                self.codes[(status, body[:160])] += 1

    def take(self) -> tuple[list[float], int]:
        """The latencies and the error count so far; both start again from nothing."""
        with self.lock:
            latencies, errors, self.latencies, self.errors = self.latencies, self.errors, [], 0
        return latencies, errors


def soak_client(number: int, server: tuple[Server, str], stop_at: float, texts: list[str], window: Window) -> None:
    """One closed-loop client: one-item requests cycling over the tasks until ``stop_at``."""
    (running, key), n = server, number
    sends = {task: classify_sender(running.port, key, task) for task in _task_names(SOAK_TASKS)}
    names = list(sends)
    while time.monotonic() < stop_at:
        task = names[n % len(names)]
        started = time.perf_counter()
        status, body = sends[task]([{"id": f"c{number}-{n}", "text": texts[n % len(texts)]}])
        window.add(time.perf_counter() - started, status, body)
        n += len(names) + 1


def run_soak(options: LoadTestOptions, duration: float) -> bool:
    """Run the soak; print the per-minute table and the verdict; True when every target is met."""
    import psutil

    served = options.served
    budget = budget_for_two(served.model, served.dtype)
    key = secrets.token_urlsafe(24)
    print(f"[soak] starting server: tasks {', '.join(SOAK_TASKS)}, --cache-budget {budget}", flush=True)
    launch = Launch(served, SOAK_TASKS, options.max_batch, queue_for(options.clients, options.items_per_request),
                    options.max_step_tokens, ("--cache-budget", str(budget)))
    server = Server(launch, key)
    rss, texts, window = psutil.Process(server.proc.pid), _texts(), Window()
    minutes: list[dict] = []
    stop_at = time.monotonic() + duration
    threads = [threading.Thread(target=soak_client, args=(i, (server, key), stop_at, texts, window), daemon=True)
               for i in range(options.clients)]
    try:
        for t in threads:
            t.start()
        started = time.monotonic()
        while any(t.is_alive() for t in threads):
            time.sleep(min(60.0, max(0.1, started + 60 * (len(minutes) + 1) - time.monotonic())))
            latencies, errors = window.take()
            minutes.append(_minute(len(minutes) + 1, latencies, errors, rss.memory_info().rss, pool_figures(server.port, key)))
            print(_row(minutes[-1]), flush=True)
            with window.lock:
                for (status, body), count in window.codes.most_common(3):
                    print(f"    {count} x {status}: {body!r}", flush=True)
                window.codes.clear()
    finally:
        server.stop()
    return _verdict(minutes, budget, options, duration)


def _task_names(specs) -> list[str]:
    from ...task.definition import load_task

    return [load_task(spec).name for spec in specs]


def _texts() -> list[str]:
    from ...io.records import bundled_dataset

    with open(bundled_dataset(), encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh if line.strip()]


def _minute(number: int, latencies: list[float], errors: int, rss: int, pool: tuple[float, float]) -> dict:
    ordered = sorted(latencies)
    pick = lambda q: 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")  # noqa: E731
    return {"minute": number, "requests": len(latencies), "errors": errors, "p50_ms": pick(0.5), "p99_ms": pick(0.99),
            "rss_mb": rss / 2**20, "pool_hits": pool[0], "pool_evictions": pool[1]}


def _row(m: dict) -> str:
    return (f"minute {m['minute']:>3}: {m['requests']:>6} requests, {m['errors']} errors, p50 {m['p50_ms']:.0f} ms, "
            f"p99 {m['p99_ms']:.0f} ms, RSS {m['rss_mb']:.0f} MiB, pool hits {m['pool_hits']:.0f}, evictions {m['pool_evictions']:.0f}")


def _verdict(minutes: list[dict], budget: int, options: LoadTestOptions, duration: float) -> bool:
    if not minutes:
        print("FAIL: no minute was recorded")
        return False
    first, last = minutes[0], minutes[-1]
    errors = sum(m["errors"] for m in minutes)
    growth = last["rss_mb"] / first["rss_mb"] - 1
    p99_ratio = last["p99_ms"] / first["p99_ms"]
    print(f"\nsoak: {duration:.0f} s, {options.clients} clients, tasks {', '.join(SOAK_TASKS)}, pool budget {budget / 2**20:.1f} MiB "
          f"(holds two of the three prefixes)")
    print(f"errors {errors} (target 0); RSS {first['rss_mb']:.0f} -> {last['rss_mb']:.0f} MiB, {growth:+.1%} (target <= +5%); "
          f"p99 first minute {first['p99_ms']:.0f} ms, last {last['p99_ms']:.0f} ms, {p99_ratio:.2f}x (target <= 1.5x); "
          f"pool hits {last['pool_hits']:.0f}, evictions {last['pool_evictions']:.0f}")
    ok = errors == 0 and growth <= 0.05 and p99_ratio <= 1.5
    print("PASS" if ok else "FAIL")
    if options.json_path:
        with open(options.json_path, "w", encoding="utf-8") as fh:
            json.dump({"duration_s": duration, "clients": options.clients, "budget_bytes": budget, "minutes": minutes,
                       "errors": errors, "rss_growth": growth, "p99_ratio": p99_ratio, "ok": ok}, fh, indent=2)
    return ok
