#!/usr/bin/env python3
"""Mixed load on `prefixcache serve`: extraction clients and one-item classification clients at once, in one run.

What it does, per lane (this checkout's code, and with ``--baseline-src DIR`` another checkout's ``src/`` for
the same server command, so that two versions are compared side by side on one machine):

1. starts one ``python -m prefixcache serve`` with ``support-tickets`` and ``ticket-fields`` on a free loopback
   port, and warms both tasks up;
2. **idle**: one client sends ``--idle`` one-item ``POST /v1/classify`` requests one after another;
3. **mixed**: ``--extract-clients`` closed-loop clients send one-item ``POST /v1/extract`` requests while
   ``--classify-clients`` others send one-item classifications, for ``--seconds``; every answer is checked
   (status 200, one result, a label or a fields object).

It prints a markdown table per lane (extraction requests/s, classification p50/p99 under load and that p99 as a
multiple of the idle p99) and, with a baseline, the ratios of this checkout to it. Exit code 0 when nothing
failed; 1 otherwise.

    python scripts/loadtest_mixed.py                                  # this checkout only
    git worktree add /tmp/base <commit>
    python scripts/loadtest_mixed.py --baseline-src /tmp/base/src     # both, lanes alternating
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtest import HOST, Server, add_server_options, pct

CLASSIFY_TASK, EXTRACT_TASK = "support-tickets", "ticket-fields"


@dataclass
class Lane:
    name: str
    src: str | None  # a checkout's src/ put first on the server's PYTHONPATH; None: the installed package
    idle: list[float] = field(default_factory=list)
    classify: list[float] = field(default_factory=list)
    extract: list[float] = field(default_factory=list)
    seconds: float = float("nan")
    failures: list[str] = field(default_factory=list)

    @property
    def extract_rate(self) -> float:
        return len(self.extract) / self.seconds

    def row(self) -> str:
        idle99, load99 = pct(self.idle, 0.99), pct(self.classify, 0.99)
        return (f"| {self.name} | {self.extract_rate:.2f} | {len(self.classify) / self.seconds:.2f} | {pct(self.idle, 0.5):.0f} / "
                f"{idle99:.0f} | {pct(self.classify, 0.5):.0f} / {load99:.0f} | **{load99 / idle99:.2f}x** | "
                f"{pct(self.extract, 0.5):.0f} / {pct(self.extract, 0.99):.0f} | {len(self.failures)} |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_options(p, dtype="auto")
    p.add_argument("--baseline-src", default=None, help="another checkout's src/ folder, run as the baseline lane")
    p.add_argument("--extract-clients", type=int, default=8)
    p.add_argument("--classify-clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0, help="length of the mixed phase per lane")
    p.add_argument("--idle", type=int, default=30, help="one-item classifications timed on the idle server")
    p.add_argument("--json", dest="json_path", default=None, help="write every lane's samples here")
    return p.parse_args()


def texts() -> list[str]:
    from prefixcache.bench.workload import ticket_records

    return [record.fields["text"] for record in ticket_records(600)]


def sender(port: int, key: str):
    """A ``send(route, task, item) -> (seconds, failure or None)`` on one keep-alive connection."""
    conn = http.client.HTTPConnection(HOST, port, timeout=600)

    def send(route: str, task: str, item: dict) -> tuple[float, str | None]:
        body = json.dumps({"task": task, "items": [item]}).encode()
        started = time.perf_counter()
        conn.request("POST", route, body=body, headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        data = response.read()
        seconds = time.perf_counter() - started
        if response.status != 200:
            return seconds, f"{route} {item['id']}: {response.status} {data[:200]!r}"
        results = json.loads(data)["results"]
        answer = results[0].get("label" if route == "/v1/classify" else "fields") if len(results) == 1 else None
        return seconds, None if answer is not None else f"{route} {item['id']}: no answer in {data[:200]!r}"

    return send


def closed_loop(port: int, key: str, route: str, task: str, pool: list[str], start: int, stop: threading.Event,
                samples: list[float], failures: list[str]) -> None:
    send, n = sender(port, key), start
    while not stop.is_set():
        seconds, failure = send(route, task, {"id": f"r{n}", "text": pool[n % len(pool)]})
        if failure:
            failures.append(failure)
        elif not stop.is_set():  # only answers inside the timed window count
            samples.append(seconds)
        n += 97


def run_lane(lane: Lane, args, pool: list[str]) -> None:
    key = secrets.token_urlsafe(16)
    saved = os.environ.get("PYTHONPATH")
    if lane.src:
        os.environ["PYTHONPATH"] = lane.src + (os.pathsep + saved if saved else "")
    serve_args = argparse.Namespace(task=CLASSIFY_TASK, model=args.model, dtype=args.dtype, threads=args.threads,
                                    clients=args.extract_clients + args.classify_clients, items_per_request=1)
    print(f"[{lane.name}] starting", flush=True)
    try:
        server = Server(serve_args, 32, key, tasks=(CLASSIFY_TASK, EXTRACT_TASK),
                        extra=("--max-queue-per-client", "512"))
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        send = sender(server.port, key)
        for i in range(3):  # warm-up: both tasks' prefixes built and every code path run once
            send("/v1/extract", EXTRACT_TASK, {"id": f"w{i}", "text": pool[i]})
            send("/v1/classify", CLASSIFY_TASK, {"id": f"w{i}", "text": pool[i]})
        for i in range(args.idle):
            seconds, failure = send("/v1/classify", CLASSIFY_TASK, {"id": f"i{i}", "text": pool[i]})
            lane.failures.append(failure) if failure else lane.idle.append(seconds)
        stop = threading.Event()
        threads = [threading.Thread(target=closed_loop, args=(server.port, key, "/v1/extract", EXTRACT_TASK, pool, i, stop,
                                                              lane.extract, lane.failures)) for i in range(args.extract_clients)]
        threads += [threading.Thread(target=closed_loop, args=(server.port, key, "/v1/classify", CLASSIFY_TASK, pool,
                                                               300 + i, stop, lane.classify, lane.failures))
                    for i in range(args.classify_clients)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        time.sleep(args.seconds)
        stop.set()
        lane.seconds = time.perf_counter() - started
        for thread in threads:
            thread.join()
    finally:
        server.stop()
    print(f"[{lane.name}] {len(lane.extract)} extractions, {len(lane.classify)} classifications in {lane.seconds:.1f} s, "
          f"{len(lane.failures)} failures", flush=True)


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    pool = texts()
    lanes = [Lane("this checkout", None)] + ([Lane("baseline", str(Path(args.baseline_src).resolve()))]
                                            if args.baseline_src else [])
    for lane in lanes:
        run_lane(lane, args, pool)
    from prefixcache.model.machine import machine_info, machine_name

    print(f"\n{machine_name(machine_info(args.dtype))}; dtype {args.dtype}; {args.extract_clients} extraction clients and "
          f"{args.classify_clients} classification clients, one item per request, {args.seconds:.0f} s per lane")
    print("| lane | extraction req/s | classification req/s | idle classify p50 / p99 ms | loaded classify p50 / p99 ms "
          "| p99 loaded / idle | extraction p50 / p99 ms | failures |")
    print("|---|---|---|---|---|---|---|---|")
    for lane in lanes:
        print(lane.row())
    if len(lanes) == 2:
        ours, base = lanes
        print(f"\nextraction throughput, this checkout / baseline: **{ours.extract_rate / base.extract_rate:.2f}x**")
    for lane in lanes:
        for failure in lane.failures[:5]:
            print(f"[{lane.name}] {failure}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps([lane.__dict__ for lane in lanes], indent=1))
    return 0 if not any(lane.failures for lane in lanes) else 1


if __name__ == "__main__":
    sys.exit(main())
