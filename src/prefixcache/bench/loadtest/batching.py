"""The plain lane of ``prefixcache loadtest``: micro-batching against one item per pass, in one run.

What it does, in order:

0. snapshots the task file into a temporary folder, so the reference and both
   servers read the same bytes even if someone edits the task meanwhile;
1. computes the *sequential* reference in this process: every distinct ticket
   classified alone (``RunConfig("cached", 1)``), on the same model and dtype, and
   times the engine itself on those items one per pass and batched: the ceiling
   no server can pass (plus the bound at 100% of the measured matmul peak);
2. starts one ``python -m prefixcache serve`` per lane (micro-batched
   ``--max-batch N`` and ``--max-batch 1``) on free 127.0.0.1 ports with random API
   keys, warms both up, then sends the same ``--requests`` requests to each from
   ``--clients`` concurrent clients (one keep-alive connection each), in
   alternating rounds (A B, B A) so that load drift on a shared machine hits both
   lanes alike, and stops the servers;
3. checks every response against the reference (:mod:`.judge`), and reports items/s
   and p50/p99 request latency per lane, plus the mean pass size, pass time and the
   share of the wall time the model was busy, from ``/metrics`` (:mod:`.report`).

It passes when there are no errors and micro-batched throughput is at least
``--target``x the one-at-a-time lane. With ``--openai``, the lanes are ``/v1/classify`` and the
OpenAI-compatible chat route (:mod:`.openai_lane`), both micro-batched, against ``--openai-target``.
"""

from __future__ import annotations

import math
import os
import secrets
import tempfile
from dataclasses import dataclass, replace

from .clients import classify_sender, drive, machine_load
from .judge import Lane, check
from .options import LoadTestOptions
from .reference import sequential_reference, snapshot_task, workload
from .report import report
from .served import HOST, Launch, Server, pass_figures, queue_for


@dataclass(frozen=True)
class Judged:
    """What every response is checked against: the requests, the sequential result of each text, the
    tolerance, and the task's name (as the server registers it)."""

    requests: list
    reference: dict
    tolerance: float
    task_name: str


def run_loadtest(options: LoadTestOptions) -> bool:
    """Run the plain lane (or, with ``options.openai``, the openai lane); print the table; True when it passes."""
    from ...task.definition import load_task

    served = options.served
    print(f"load test: {options.clients} clients, {options.requests} requests x {options.items_per_request} "
          f"item(s) per lane, model {served.model}, task {options.task}, dtype {served.dtype}, loopback {HOST}", flush=True)
    print(f"machine: {os.cpu_count()} CPUs, load average {machine_load()} at start", flush=True)
    requests = workload(options.requests, options.items_per_request, options.distinct)
    with tempfile.TemporaryDirectory(prefix="prefixcache-loadtest-") as folder:
        options = replace(options, task=snapshot_task(options.task, folder))  # from here on, the snapshot's path
        name = load_task(options.task).name
        reference, ceiling, tolerance = sequential_reference(options, requests)
        if options.openai:
            lanes = [Lane("classify", options.max_batch), Lane("openai guided_choice", options.max_batch, api="openai")]
        else:
            lanes = [Lane(f"micro-batched (<= {options.max_batch})", options.max_batch), Lane("max-batch 1", 1)]
        run_lanes(lanes, options, Judged(requests, reference, tolerance, name))
    return report(lanes, options, ceiling, tolerance)


def start_servers(lanes: list[Lane], options: LoadTestOptions, servers: dict[str, tuple[Server, str]]) -> None:
    """One server per lane, into ``servers`` (lane name -> (server, key)) as each starts."""
    for lane in lanes:
        key = secrets.token_urlsafe(24)
        print(f"[{lane.name}] starting server (--max-batch {lane.max_batch})", flush=True)
        launch = Launch(options.served, (options.task,), lane.max_batch,
                        queue_for(options.clients, options.items_per_request), options.max_step_tokens)
        servers[lane.name] = (Server(launch, key), key)


def senders(lane: Lane, port: int, key: str, options: LoadTestOptions, task_name: str):
    """What makes one client's ``send`` for the lane: POST /v1/classify, or the openai client's chat."""
    if lane.api == "openai":
        from .openai_lane import openai_sender

        return lambda: openai_sender(port, key, options.task)
    return lambda: classify_sender(port, key, task_name)


def run_lanes(lanes: list[Lane], options: LoadTestOptions, judged: Judged) -> None:
    """Start one server per lane, then drive the lanes in alternating rounds (A B, B A, ...).

    Interleaving makes a drift in background load (a shared machine) hit every lane alike.
    Each round sends a contiguous slice of the requests; every request is sent once per lane.
    """
    servers: dict[str, tuple[Server, str]] = {}
    requests = judged.requests
    try:
        start_servers(lanes, options, servers)
        for lane in lanes:  # warm-up: the first passes pay one-time costs (allocations, kernel selection)
            server, key = servers[lane.name]
            make_sender = senders(lane, server.port, key, options, judged.task_name)
            drive(requests[: min(8, options.clients)], options.clients, make_sender)
        size = -(-len(requests) // options.rounds)
        slices = [(start, requests[start : start + size]) for start in range(0, len(requests), size)]
        for number, (offset, chunk) in enumerate(slices):
            for lane in lanes if number % 2 == 0 else lanes[::-1]:
                seconds = run_round(lane, servers[lane.name], (offset, chunk), options, judged)
                print(f"[{lane.name}] round {number + 1}/{len(slices)}: {len(chunk)} requests in {seconds:.1f} s", flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()
    for lane in lanes:
        print(f"[{lane.name}] {lane.items} items in {lane.seconds:.1f} s: {lane.items_per_second:.2f} items/s, "
              f"p50 {lane.percentile(0.5):.0f} ms, p99 {lane.percentile(0.99):.0f} ms", flush=True)


def run_round(lane: Lane, running: tuple[Server, str], part: tuple[int, list], options: LoadTestOptions,
              judged: Judged) -> float:
    """Send one slice (``part``: its offset and requests) to the lane's server; check and count it; its seconds."""
    (server, key), (offset, chunk) = running, part
    before = pass_figures(server.port, key)
    outcomes, seconds = drive(chunk, options.clients, senders(lane, server.port, key, options, judged.task_name))
    if lane.api == "openai":
        from .openai_lane import cached_share

        low, mean = cached_share(outcomes)
        lane.cached_min = low if math.isnan(lane.cached_min) else min(lane.cached_min, low)
        lane.cached_mean = mean
    after = pass_figures(server.port, key)
    lane.seconds += seconds
    lane.passes += after[0] - before[0]
    lane.pass_items += after[1] - before[1]
    lane.pass_seconds += after[2] - before[2]
    check(lane, [(offset + n, *rest) for n, *rest in outcomes], judged.requests, judged.reference, judged.tolerance)
    return seconds
