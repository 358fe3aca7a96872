#!/usr/bin/env python3
# Study behind docs/reliability.md, "Hostile uploads" (its tables), and docs/server.md's upload parsing.
"""Hostile task uploads against a real server: does `/healthz` and classification stay responsive?

Issue 19 asks: while 20 hostile uploads run, `/healthz` p99 stays within 100 ms and a concurrent classify
within 2x of its idle latency. This script starts one ``prefixcache serve`` (``support-tickets``, the given
model and dtype) on a free loopback port with a client and an admin key, then measures on the idle server
`/healthz` (one request every 20 ms) and a one-item ``POST /v1/classify`` (median of several). Then 20 threads
each send one kind of hostile ``PUT /v1/tasks/{name}`` over and over for ``--duration`` seconds (a body just
under ``max_task_bytes`` with thousands of labels, bodies over ``max_task_bytes`` and ``max_body_bytes``,
nesting 5,000 deep, a "billion laughs" of anchors, an unclosed quote, ``{text:x>200000}``, a 5,000-digit
integer, 2024-13-45, lone surrogates escaped and as raw bytes) while `/healthz` is polled as before and one
classify request follows another. It prints a markdown table of the latencies, the status codes per upload
kind and the verdicts.

On a 2-core machine the attacking clients take CPU from the server they attack (20 threads sending as fast
as they can). ``--split-cores`` separates the two: the server on one core with one torch thread, this script
and the attack on the other, idle and attack measured alike.

Exit code 0 when `/healthz` p99 under attack is at most ``--healthz-p99-ms``, the classify median under attack
is at most ``--classify-ratio`` x its idle median, every classify and `/healthz` answered 200, and no upload
got a 5xx; 1 otherwise. A connection the server closes on an oversized body is counted, not failed.

    python studies/hostile_uploads.py
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import multiprocessing
import os
import secrets
import statistics
import threading
import time

# The load test's server launcher (a `prefixcache serve` subprocess on a free loopback port).
from prefixcache.bench.loadtest.clients import pct
from prefixcache.bench.loadtest.options import ServedModel
from prefixcache.bench.loadtest.served import HOST, TICKET, Launch, Server

HEAD = 'name: {name}\nkind: classify\ninstruction: "Classify the ticket."\n'
LABELS = 'labels:\n  billing: "Money."\n  technical: "Bugs."\n'


def many_labels(name: str, size: int) -> bytes:
    """A valid-looking task of about ``size`` bytes: labels with descriptions, thousands of them."""
    lines, total, i = [HEAD.format(name=name), "labels:\n"], 0, 0
    while total < size - 200:
        line = f'  label_{i:06d}: "Tickets about topic number {i}, routed to its own queue."\n'
        lines.append(line)
        total, i = total + len(line), i + 1
    return "".join(lines).encode()


def laughs(name: str, levels: int = 10) -> bytes:
    """Anchors nine times the one before, ``levels`` deep: 9**levels strings if anything expands them."""
    text = "l0: &l0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n"
    for i in range(1, levels):
        text += f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]\n"
    return (text + HEAD.format(name=name) + f"labels: {{billing: *l{levels - 1}, technical: *l{levels - 1}}}\n").encode()


def hostile_bodies(name: str, max_task_bytes: int, max_body_bytes: int) -> dict[str, tuple[str, bytes]]:
    """Kind -> (content type, body) of every hostile upload, for task ``name``."""
    head, yaml = HEAD.format(name=name), "application/yaml"
    valid = head + LABELS + 'input_template: "Ticket: {text}"\n'
    return {
        "thousands of labels, just under max_task_bytes": (yaml, many_labels(name, max_task_bytes - 64)),
        "over max_task_bytes": (yaml, many_labels(name, max_task_bytes + 64 * 1024)),
        "over max_body_bytes": (yaml, many_labels(name, 2 * max_body_bytes)),
        "nesting 5,000 deep": (yaml, (head + "labels: " + "[" * 5000 + "]" * 5000 + "\n").encode()),
        "billion laughs (9^10 aliases)": (yaml, laughs(name)),
        "unclosed quote": (yaml, (head + LABELS + 'input_template: "Ticket: {text}\nexamples: []\n').encode()),
        "format spec {text:x>200000}": (yaml, valid.replace("{text}", "{text:x>200000}").encode()),
        "5,000-digit integer": (yaml, (head + LABELS + "max_new_tokens: " + "9" * 5000 + "\n").encode()),
        "invalid date 2024-13-45": (yaml, valid.replace('"Money."', "2024-13-45").encode()),
        "lone surrogate, escaped": (yaml, valid.replace('"Bugs."', '"Bugs \\ud800 here"').encode()),
        "lone surrogate, raw bytes (JSON)": ("application/json", json.dumps(
            {"name": name, "instruction": "x", "labels": {"billing": "Money.", "technical": "Bugs"}}
        ).encode().replace(b"Bugs", b"Bugs \xed\xa0\x80")),
    }


def upload_loop(port: int, key: str, typed_body: tuple[str, bytes], stop, codes: collections.Counter) -> None:
    """PUT one hostile body again and again until ``stop``; count the status codes (or closed connections)."""
    headers = {"Content-Type": typed_body[0], "Authorization": f"Bearer {key}"}
    conn = None
    while not stop.is_set():
        try:
            conn = conn or http.client.HTTPConnection(HOST, port, timeout=120)
            conn.request("PUT", "/v1/tasks/hostile-upload", body=typed_body[1], headers=headers)
            response = conn.getresponse()
            response.read()
            code = str(response.status)
            if response.getheader("connection", "").lower() == "close":
                conn = conn.close()
        except (OSError, http.client.HTTPException) as exc:
            code = f"connection closed ({type(exc).__name__})"
            conn = conn.close() if conn else None
        codes[code] += 1  # one thread per counter: no lock needed


def attack_process(port: int, admin_key: str, bodies: dict, threads: int, stop, results) -> None:
    """``threads`` upload loops, the kinds in turn, in a child process: they do not share the probes' GIL."""
    kinds = list(bodies)
    codes = [collections.Counter() for _ in range(threads)]
    workers = [threading.Thread(target=upload_loop, args=(port, admin_key, bodies[kinds[i % len(kinds)]], stop, codes[i]),
                                daemon=True) for i in range(threads)]
    [worker.start() for worker in workers]
    stop.wait()
    [worker.join(timeout=120) for worker in workers]
    totals: dict[str, collections.Counter] = {kind: collections.Counter() for kind in kinds}
    [totals[kinds[i % len(kinds)]].update(counter) for i, counter in enumerate(codes)]
    results.put({kind: dict(counter) for kind, counter in totals.items()})


def timed_call(conn: http.client.HTTPConnection, method: str, path: str, label: str, samples: list[float],
               failures: list[str], **request) -> http.client.HTTPConnection:
    """One request on ``conn``: its latency into ``samples``, a non-200 or a failure into ``failures``. Returns
    the connection to use next (a new one after a failure)."""
    started = time.perf_counter()
    try:
        conn.request(method, path, **request)
        response = conn.getresponse()
        response.read()
        samples.append(time.perf_counter() - started)
        if response.status != 200:
            failures.append(f"{label} {response.status}")
        return conn
    except (OSError, http.client.HTTPException) as exc:
        failures.append(f"{label} {type(exc).__name__}")
        return http.client.HTTPConnection(HOST, conn.port, timeout=conn.timeout)


def poll_healthz(port: int, stop: threading.Event, gap: float, samples: list[float], failures: list[str]) -> None:
    """GET /healthz every ``gap`` seconds on one keep-alive connection until ``stop``; latencies into ``samples``."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    while not stop.is_set():
        conn = timed_call(conn, "GET", "/healthz", "/healthz", samples, failures)
        stop.wait(gap)


def classify_loop(port: int, key: str, stop: threading.Event, count: int, samples: list[float], failures: list[str]) -> None:
    """One-item classify requests one after another: ``count`` of them, or until ``stop`` when count is 0."""
    conn = http.client.HTTPConnection(HOST, port, timeout=300)
    body = json.dumps({"task": "support-tickets", "items": [{"id": "c", "text": TICKET}]})
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    while (len(samples) < count) if count else not stop.is_set():
        conn = timed_call(conn, "POST", "/v1/classify", "classify", samples, failures, body=body, headers=headers)


def measure(server: Server, args, client_key: str, admin_key: str, bodies: dict) -> dict:
    """Idle figures, then the same during the attack; every latency list and the upload status codes."""
    stop, failures = threading.Event(), []
    classify_loop(server.port, client_key, stop, 2, [], failures)  # warm-up
    idle_health, idle_classify, idle_stop = [], [], threading.Event()
    poller = threading.Thread(target=poll_healthz, args=(server.port, idle_stop, args.gap, idle_health, failures))
    poller.start()
    time.sleep(args.idle_seconds)
    idle_stop.set()
    poller.join()
    classify_loop(server.port, client_key, stop, args.idle_classify, idle_classify, failures)
    ctx = multiprocessing.get_context("fork")
    attack_stop, results = ctx.Event(), ctx.Queue()
    attack = ctx.Process(target=attack_process, args=(server.port, admin_key, bodies, args.uploads, attack_stop, results))
    health, classify = [], []
    workers = [threading.Thread(target=poll_healthz, args=(server.port, stop, args.gap, health, failures)),
               threading.Thread(target=classify_loop, args=(server.port, client_key, stop, 0, classify, failures))]
    attack.start()
    [worker.start() for worker in workers]
    time.sleep(args.duration)
    stop.set()
    attack_stop.set()
    [worker.join() for worker in workers]
    codes = results.get(timeout=180)
    attack.join()
    after = []
    classify_loop(server.port, client_key, threading.Event(), 1, after, failures)  # still serving afterwards
    return dict(idle_health=idle_health, idle_classify=idle_classify, health=health, classify=classify,
                codes=codes, failures=failures)


def report(m: dict, args) -> int:
    """Print the markdown tables and verdicts; the exit code."""
    idle_c, attack_c = statistics.median(m["idle_classify"]) * 1000, statistics.median(m["classify"]) * 1000
    ratio, p99 = attack_c / idle_c, pct(m["health"], 0.99)
    print(f"| measurement | idle | under {args.uploads} hostile uploads ({args.duration:.0f} s) |\n| --- | --- | --- |")
    for q, label in ((0.5, "p50"), (0.99, "p99"), (1.0, "max")):
        print(f"| `/healthz` {label}, ms | {pct(m['idle_health'], q):.1f} | {pct(m['health'], q):.1f} |")
    print(f"| `/healthz` requests | {len(m['idle_health'])} | {len(m['health'])} |")
    print(f"| classify (1 item) median, ms | {idle_c:.0f} | {attack_c:.0f} ({ratio:.2f}x idle) |")
    print(f"| classify p99 / max, ms | {pct(m['idle_classify'], 0.99):.0f} / {pct(m['idle_classify'], 1):.0f} "
          f"| {pct(m['classify'], 0.99):.0f} / {pct(m['classify'], 1):.0f} |")
    print(f"| classify requests | {len(m['idle_classify'])} | {len(m['classify'])} |")
    print("\n| upload kind | uploads | status codes |\n| --- | --- | --- |")
    totals: collections.Counter = collections.Counter()
    for kind, codes in m["codes"].items():
        totals.update(codes)
        print(f"| {kind} | {sum(codes.values())} | {', '.join(f'{c}: {n}' for c, n in sorted(codes.items()))} |")
    print(f"| all | {sum(totals.values())} | {', '.join(f'{c}: {n}' for c, n in sorted(totals.items()))} |")
    fivexx = sum(n for code, n in totals.items() if code.startswith("5"))
    verdicts = [(f"`/healthz` p99 {p99:.1f} ms <= {args.healthz_p99_ms:.0f} ms", p99 <= args.healthz_p99_ms),
                (f"classify {ratio:.2f}x idle <= {args.classify_ratio:.0f}x", ratio <= args.classify_ratio),
                (f"uploads answered 5xx: {fivexx}", fivexx == 0),
                (f"classify or `/healthz` failures: {len(m['failures'])} {sorted(set(m['failures']))}", not m["failures"])]
    print("\n" + "\n".join(f"* {'PASS' if ok else 'FAIL'}: {text}" for text, ok in verdicts))
    return 0 if all(ok for _, ok in verdicts) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the server (default: all cores)")
    p.add_argument("--uploads", type=int, default=20, help="concurrent hostile upload threads")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of attack")
    p.add_argument("--idle-seconds", type=float, default=6.0, help="seconds of /healthz polling on the idle server")
    p.add_argument("--idle-classify", type=int, default=7, help="classify requests timed on the idle server")
    p.add_argument("--gap", type=float, default=0.02, help="seconds between /healthz polls")
    p.add_argument("--healthz-p99-ms", type=float, default=100.0)
    p.add_argument("--classify-ratio", type=float, default=2.0)
    p.add_argument("--split-cores", action="store_true",
                   help="pin the server (1 torch thread) to the first core and the attacking clients to the second, "
                        "so that the attack's own client CPU does not count against the server")
    args = p.parse_args()
    client_key, admin_key = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    os.environ["PREFIXCACHE_ADMIN_KEY"] = admin_key  # Server passes this process's environment on
    from prefixcache.server.settings import ServerSettings

    defaults = ServerSettings()
    bodies = hostile_bodies("hostile-upload", defaults.max_task_bytes, defaults.max_body_bytes)
    if args.split_cores:  # the server (and its upload parser) on the first core, this script and the attack on the second
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[0]})
        args.threads = 1
    server = Server(Launch(ServedModel(args.model, args.dtype, args.threads), ("support-tickets",), 32), client_key)
    if args.split_cores:
        os.sched_setaffinity(0, {cores[1]})
    try:
        figures = measure(server, args, client_key, admin_key, bodies)
    finally:
        server.stop()
    return report(figures, args)


if __name__ == "__main__":
    raise SystemExit(main())
