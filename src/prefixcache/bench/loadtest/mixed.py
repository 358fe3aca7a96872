"""Mixed load on `prefixcache serve` (``prefixcache loadtest mixed``): extraction clients and one-item
classification clients at once, in one run.

What it does, per lane (the installed package, and with ``--baseline-src DIR`` another checkout's ``src/`` for
the same server command, so that two versions are compared side by side on one machine):

1. starts one ``python -m prefixcache serve`` with ``support-tickets`` and ``ticket-fields`` on a free loopback
   port, and warms both tasks up;
2. **idle**: one client sends ``--idle`` one-item ``POST /v1/classify`` requests one after another;
3. **mixed**: ``--extract-clients`` closed-loop clients send one-item ``POST /v1/extract`` requests while
   ``--classify-clients`` others send one-item classifications, for ``--seconds``; every answer is checked
   (status 200, one result, a label or a fields object).

It prints a markdown table per lane (extraction requests/s, classification p50/p99 under load and that p99 as a
multiple of the idle p99) and, with a baseline, the ratios of this checkout to it. It passes when nothing failed.
"""

from __future__ import annotations

import http.client
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .clients import pct
from .options import CLASSIFY_TASK, EXTRACT_TASK, MixedOptions
from .served import HOST, Launch, Server, queue_for


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


@dataclass(frozen=True)
class Traffic:
    """One kind of closed-loop client: its route and task, the texts, and where its samples and failures go."""

    route: str
    task: str
    pool: list[str]
    samples: list[float]
    failures: list[str]


def texts() -> list[str]:
    from ..workload import ticket_records

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


def closed_loop(port: int, key: str, traffic: Traffic, start: int, stop: threading.Event) -> None:
    send, n = sender(port, key), start
    while not stop.is_set():
        seconds, failure = send(traffic.route, traffic.task, {"id": f"r{n}", "text": traffic.pool[n % len(traffic.pool)]})
        if failure:
            traffic.failures.append(failure)
        elif not stop.is_set():  # only answers inside the timed window count
            traffic.samples.append(seconds)
        n += 97


def start_lane(lane: Lane, options: MixedOptions) -> tuple[Server, str]:
    key = secrets.token_urlsafe(16)
    print(f"[{lane.name}] starting", flush=True)
    launch = Launch(options.served, (CLASSIFY_TASK, EXTRACT_TASK), 32,
                    queue_for(options.extract_clients + options.classify_clients, 1),
                    extra=("--max-queue-per-client", "512"), pythonpath=lane.src)
    return Server(launch, key), key


def run_lane(lane: Lane, options: MixedOptions, pool: list[str]) -> None:
    server, key = start_lane(lane, options)
    try:
        send = sender(server.port, key)
        for i in range(3):  # warm-up: both tasks' prefixes built and every code path run once
            send("/v1/extract", EXTRACT_TASK, {"id": f"w{i}", "text": pool[i]})
            send("/v1/classify", CLASSIFY_TASK, {"id": f"w{i}", "text": pool[i]})
        for i in range(options.idle):
            seconds, failure = send("/v1/classify", CLASSIFY_TASK, {"id": f"i{i}", "text": pool[i]})
            lane.failures.append(failure) if failure else lane.idle.append(seconds)
        stop = threading.Event()
        extract = Traffic("/v1/extract", EXTRACT_TASK, pool, lane.extract, lane.failures)
        classify = Traffic("/v1/classify", CLASSIFY_TASK, pool, lane.classify, lane.failures)
        threads = [threading.Thread(target=closed_loop, args=(server.port, key, extract, i, stop))
                   for i in range(options.extract_clients)]
        threads += [threading.Thread(target=closed_loop, args=(server.port, key, classify, 300 + i, stop))
                    for i in range(options.classify_clients)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        time.sleep(options.seconds)
        stop.set()
        lane.seconds = time.perf_counter() - started
        for thread in threads:
            thread.join()
    finally:
        server.stop()
    print(f"[{lane.name}] {len(lane.extract)} extractions, {len(lane.classify)} classifications in {lane.seconds:.1f} s, "
          f"{len(lane.failures)} failures", flush=True)


def run_mixed(options: MixedOptions) -> bool:
    """Every lane in turn; the table; True when nothing failed."""
    pool = texts()
    lanes = [Lane("this checkout", None)] + ([Lane("baseline", str(Path(options.baseline_src).resolve()))]
                                            if options.baseline_src else [])
    for lane in lanes:
        run_lane(lane, options, pool)
    from ...model.machine import machine_info, machine_name

    dtype = options.served.dtype
    machine = machine_info(dtype, options.served.threads)
    print(f"\n{machine_name(machine)}; dtype {dtype}; {options.extract_clients} extraction clients and "
          f"{options.classify_clients} classification clients, one item per request, {options.seconds:.0f} s per lane")
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
    if options.json_path:
        document = {"machine": machine, "lanes": [lane.__dict__ for lane in lanes]}
        Path(options.json_path).write_text(json.dumps(document, indent=1))
    return not any(lane.failures for lane in lanes)
