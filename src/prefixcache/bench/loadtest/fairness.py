"""One client floods the server; how long does another client's one-item request take? (issue 19, item 9)
``prefixcache loadtest fairness``.

The server tells clients apart by their key's role and their address (``docs/server.md``, Fairness). On
loopback every address in 127.0.0.0/8 reaches the server, so each client gets its own source
address: the *flood* sends from 127.0.0.2, the *victim* from 127.0.0.3.

For each ``--max-batch`` (and each ``--max-step-tokens``, when given) it starts one ``prefixcache serve``
(``support-tickets``, the given model and dtype) and measures, in order:

1. **idle**: the victim's one-item ``POST /v1/classify`` requests, one after another, on the idle server;
2. **flood**: ``--flood-connections`` threads of the flooding client each send ``--flood-items``-item
   requests back to back (a 429, once the flood holds its share of the queue, is counted and retried after
   its ``Retry-After``), and meanwhile the victim sends the same one-item requests from its own address.

It prints a markdown table (victim p50/p99/max, the p99 as a multiple of the idle p99, the flood's
items/s in its passes, the 429s) and a verdict on the issue's bar: the other client's p99 under the flood within
``--ratio`` x its idle p99. It passes when every lane's verdict passes and nothing failed.
"""

from __future__ import annotations

import http.client
import json
import secrets
import threading
import time
from dataclasses import dataclass, field

from .clients import pct
from .options import CLASSIFY_TASK, FairnessOptions
from .served import HOST, TICKET, Launch, Server, pass_figures

FLOOD_ADDRESS, VICTIM_ADDRESS = "127.0.0.2", "127.0.0.3"


@dataclass
class Flood:
    """What the flooding client got: items answered, 429s, other failures."""

    items: int = 0
    refused: int = 0
    failures: list[str] = field(default_factory=list)
    passes: float = 0.0  # the server's forward passes while the victim ran, their items and seconds
    pass_items: float = 0.0
    pass_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


def connect(port: int, address: str) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(HOST, port, timeout=600, source_address=(address, 0))


def classify(conn: http.client.HTTPConnection, key: str, items: list[dict]) -> tuple[int, float, dict]:
    """One POST /v1/classify: (status, seconds, headers)."""
    body = json.dumps({"task": CLASSIFY_TASK, "items": items})
    started = time.perf_counter()
    conn.request("POST", "/v1/classify", body=body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    response.read()
    return response.status, time.perf_counter() - started, dict(response.getheaders())


def flood_loop(port: int, key: str, size: int, stop: threading.Event, flood: Flood) -> None:
    """``size``-item requests back to back from the flood's address until ``stop``."""
    conn = connect(port, FLOOD_ADDRESS)
    items = [{"id": f"f{i}", "text": f"{TICKET} (copy {i})"} for i in range(size)]
    while not stop.is_set():
        try:
            status, _, headers = classify(conn, key, items)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            conn = connect(port, FLOOD_ADDRESS)
            # a kept-alive connection the server closed while this client slept on Retry-After (uvicorn's
            # keep-alive timeout) is reopened, as HTTP client libraries do; any other failure is counted
            if not isinstance(exc, (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)):
                with flood.lock:
                    flood.failures.append(type(exc).__name__)
            continue
        with flood.lock:
            if status == 200:
                flood.items += size
            elif status == 429:
                flood.refused += 1
            else:
                flood.failures.append(str(status))
        if status == 429:
            stop.wait(float(headers.get("retry-after", headers.get("Retry-After", "1"))))


def victim(port: int, key: str, address: str, count: int, failures: list[str]) -> list[float]:
    """``count`` one-item requests one after another from ``address``; their latencies in seconds."""
    conn, samples = connect(port, address), []
    while len(samples) < count:
        status, seconds, _ = classify(conn, key, [{"id": "v", "text": TICKET}])
        if status != 200:
            failures.append(f"victim {status}")
            if len(failures) > count:
                break
            time.sleep(0.5)
            continue
        samples.append(seconds)
    return samples


def flooded(port: int, key: str, options: FairnessOptions, failures: list[str]) -> tuple[list[float], Flood, float]:
    """The victim's latencies from its address while the flood runs; the flood's figures and seconds."""
    stop, flood = threading.Event(), Flood()
    threads = [threading.Thread(target=flood_loop, args=(port, key, options.flood_items, stop, flood))
               for _ in range(options.flood_connections)]
    started, before = time.perf_counter(), pass_figures(port, key)
    [thread.start() for thread in threads]
    time.sleep(options.flood_lead)  # let the flood fill the queue first
    samples = victim(port, key, VICTIM_ADDRESS, options.requests, failures)
    seconds = time.perf_counter() - started
    after, answered = pass_figures(port, key), flood.items
    stop.set()
    [thread.join() for thread in threads]
    flood.passes, flood.pass_items, flood.pass_seconds = (a - b for a, b in zip(after, before))
    flood.items = answered  # requests still in flight when the victim is done are not counted
    return samples, flood, seconds


def run_server(options: FairnessOptions, max_batch: int, step_tokens: int | None) -> list[dict]:
    """The victim idle, then under the flood, on one server at ``max_batch`` and ``step_tokens`` (None: the
    server's default ``--max-step-tokens``)."""
    key = secrets.token_urlsafe(24)
    server = Server(Launch(options.served, (CLASSIFY_TASK,), max_batch, max_step_tokens=step_tokens), key)
    rows, failures = [], []
    lane = f"{max_batch} / {step_tokens or 'default'}"
    try:
        victim(server.port, key, VICTIM_ADDRESS, 3, failures)  # warm-up
        idle = victim(server.port, key, VICTIM_ADDRESS, options.requests, failures)
        rows.append(dict(settings=lane, lane="idle", samples=idle, flood=None, seconds=0.0))
        samples, flood, seconds = flooded(server.port, key, options, failures)
        rows.append(dict(settings=lane, lane="flood", samples=samples, flood=flood, seconds=seconds))
        print(f"  {lane}: victim p99 {pct(samples, 0.99):.0f} ms, flood {flood.items} items", flush=True)
    finally:
        server.stop()
    for row in rows:
        row["failures"] = failures
    return rows


def passes(flood: Flood | None) -> str:
    """Mean items and milliseconds of the server's passes while the victim ran under the flood."""
    if not flood or not flood.passes:
        return "–"
    return f"{flood.pass_items / flood.passes:.1f}, {1000 * flood.pass_seconds / flood.passes:.0f}"


def report(rows: list[dict], options: FairnessOptions) -> bool:
    """The markdown table and the verdicts; True when every verdict passes."""
    print("\n| --max-batch / --max-step-tokens | lane | victim requests | p50 ms | p99 ms | max ms | p99 / idle p99 "
          "| model items/s in passes | flood 429s | mean pass: items, ms |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    verdicts, idle = [], {}
    for row in rows:
        samples, flood = row["samples"], row["flood"]
        p99 = pct(samples, 0.99)
        if row["lane"] == "idle":
            idle[row["settings"]] = p99
        ratio = p99 / idle[row["settings"]]
        rate = f"{flood.pass_items / flood.pass_seconds:.1f}" if flood and flood.pass_seconds else "–"
        print(f"| {row['settings']} | {row['lane']} | {len(samples)} | {pct(samples, 0.5):.0f} | {p99:.0f} "
              f"| {pct(samples, 1.0):.0f} | {ratio:.1f}x | {rate} | {flood.refused if flood else '–'} | {passes(flood)} |")
        if row["lane"] == "flood":
            verdicts.append((f"{row['settings']}: the other client's p99 is {ratio:.1f}x idle "
                             f"(bar {options.ratio:.0f}x)", ratio <= options.ratio))
        if flood and flood.failures:
            verdicts.append((f"flood failures: {sorted(set(flood.failures))}", False))
    failures = rows[0]["failures"] if rows else []
    verdicts.append((f"victim failures: {len(failures)} {sorted(set(failures))}", not failures))
    print("\n" + "\n".join(f"* {'PASS' if ok else 'FAIL'}: {text}" for text, ok in verdicts))
    return all(ok for _, ok in verdicts)


def run_fairness(options: FairnessOptions) -> bool:
    """One server per (``--max-batch``, ``--max-step-tokens``) pair, in turn; the table; True when it passes."""
    rows = []
    for max_batch in options.max_batches:
        for step_tokens in options.step_tokens:
            rows += run_server(options, max_batch, step_tokens)
    return report(rows, options)
