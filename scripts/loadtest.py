#!/usr/bin/env python3
"""Load test of `prefixcache serve` on loopback: micro-batching against one item per pass, in one run.

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
3. checks every response against the reference (same ids in the same order,
   same label, each probability within ``--tolerance``; a changed label is a
   flagged near tie, not a failure, only where the reference margin is within
   twice the lane's own measured drift), and reports items/s and p50/p99 request
   latency per lane, plus the mean pass size, pass time and the share of the wall
   time the model was busy, from ``/metrics``.

Exit code 0 when there are no errors and micro-batched throughput is at least
``--target``x the one-at-a-time lane; 1 otherwise.

    python scripts/loadtest.py --model smollm2-135m                   # serve's default dtype (auto)
    python scripts/loadtest.py --model smollm2-135m --dtype float32   # the strict reference
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

HOST = "127.0.0.1"
TICKET = "My card was charged twice for the same order last week and I would like one of the charges refunded."


@dataclass
class Lane:
    name: str
    max_batch: int
    api: str = "classify"  # or "openai": the chat route with guided_choice, through the official client
    cached_min: float = float("nan")  # openai lane: the smallest share of a prompt reused from the pool
    cached_mean: float = float("nan")
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    near_ties: int = 0
    max_prob_diff: float = 0.0
    max_logprob_diff: float = 0.0  # the lane's largest |log-prob difference| from the sequential result
    steady_drift: float = 0.0  # the same, over responses whose label did not change: the lane's numerical noise
    flips: list = field(default_factory=list)  # (reference margin, description) of every changed label
    items: int = 0
    seconds: float = 0.0
    passes: float = 0.0
    pass_items: float = 0.0
    pass_seconds: float = 0.0  # time the model thread spent in forward passes

    @property
    def busy(self) -> float:
        """Share of the wall time the model was running a pass (the rest is HTTP, queueing and gaps)."""
        return self.pass_seconds / self.seconds if self.seconds else 0.0

    @property
    def items_per_second(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


def add_server_options(p: argparse.ArgumentParser, dtype: str) -> None:
    """The server's model, dtype and torch threads, as every script here takes them."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default=dtype)
    p.add_argument("--threads", type=int, default=None, help="torch threads in the server (default: all cores)")


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile in milliseconds."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000 if ordered else float("nan")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="support-tickets")
    p.add_argument("--dtype", default="auto", help="auto (serve's default: bfloat16 where the CPU has it), bfloat16, "
                   "or float32 (the strict reference)")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the server (default: all cores)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=320, help="measured requests per lane")
    p.add_argument("--items-per-request", type=int, default=1)
    p.add_argument("--distinct", type=int, default=96, help="distinct tickets, cycled over the requests (each item keeps a unique id)")
    p.add_argument("--max-batch", type=int, default=32, help="the micro-batched lane's --max-batch")
    p.add_argument("--max-step-tokens", type=int, default=None, help="the batched server's --max-step-tokens (default: serve's)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per lane (A B, B A, ...), against load drift")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest |probability difference| counted as equal (default: 1e-4 in float32; 0.1 in bfloat16, "
                        "whose rounding differs with the rows in a pass)")
    p.add_argument("--near-tie", type=float, default=None,
                   help="a reference margin (log-prob) at or below this is a near tie: a changed label there is flagged, "
                        "not failed (default: twice the lane's max |log-prob difference| over the responses whose label "
                        "did not change: its numerical noise)")
    p.add_argument("--target", type=float, default=4.0, help="required throughput ratio, micro-batched / one at a time")
    p.add_argument("--openai", action="store_true",
                   help="compare POST /v1/classify with the OpenAI-compatible chat route (guided_choice, the official "
                        "openai client) on the same task, both micro-batched; the target becomes --openai-target")
    p.add_argument("--openai-target", type=float, default=0.8, help="required ratio, openai items/s / classify items/s")
    p.add_argument("--duration", type=float, default=None,
                   help="soak instead: this many seconds of --clients clients over three tasks, with a pool budget that "
                        "holds two of their prefixes (scripts/loadtest_soak.py); RSS, errors and latency per minute")
    p.add_argument("--json", dest="json_path", default=None, help="also write the figures as JSON here")
    return p.parse_args()


def snapshot_task(spec: str, folder: str) -> str:
    """Copy the task's YAML (a bundled name or a path) into ``folder``; return the copy's path."""
    source = Path(spec)
    if source.is_file():
        text = source.read_text(encoding="utf-8")
    else:
        text = (resources.files("prefixcache.tasks") / f"{spec}.yaml").read_text(encoding="utf-8")
    target = Path(folder) / "task.yaml"
    target.write_text(text, encoding="utf-8")
    return str(target)


def workload(n_requests: int, per_request: int, distinct: int) -> list[list[dict]]:
    """Requests of bundled support tickets (``distinct`` of them, cycled), each item with a unique id."""
    from prefixcache.io.records import bundled_dataset

    with open(bundled_dataset(), encoding="utf-8") as fh:
        texts = [json.loads(line)["text"] for line in fh if line.strip()][:distinct]
    items = [{"id": f"q{i}", "text": texts[i % len(texts)]} for i in range(n_requests * per_request)]
    return [items[i : i + per_request] for i in range(0, len(items), per_request)]


@dataclass
class Ceiling:
    """What the engine itself does on the same items, in this process, with no HTTP: the most any
    server can reach, since a server pass is an engine pass.

    ``ideal_ms`` is the batched per-item time at 100% of the measured matmul peak, counting the
    linear layers' and the attention's FLOPs only; ``bound`` is the ratio even that would give.
    """

    one_ms: float  # per item, one item per pass (the reference run)
    batched_ms: float  # per item, ``batch`` items per pass
    batch: int
    ideal_ms: float
    peak_gflops: float
    dtype: str

    @property
    def ratio(self) -> float:
        return self.one_ms / self.batched_ms

    @property
    def bound(self) -> float:
        return self.one_ms / self.ideal_ms


def sequential_reference(args, requests) -> tuple[dict[str, object], Ceiling]:
    """Every distinct text classified alone, in this process (text -> Prediction), and the engine's ceiling."""
    import torch

    from prefixcache import Classifier, Record, RunConfig, load_model, load_task
    from prefixcache.bench.lanes import matmul_peak_gflops, nonembedding_params
    from prefixcache.scheduler.classify import RunStats, warmup

    loaded = load_model(args.model, args.dtype, args.threads)
    if args.tolerance is None:
        args.tolerance = 1e-4 if loaded.dtype == torch.float32 else 0.1
    classifier = Classifier(loaded, load_task(args.task))
    texts = list(dict.fromkeys(item["text"] for request in requests for item in request))
    records = [Record(text, {"text": text}) for text in texts]
    warmup(classifier)
    started = time.perf_counter()
    stats = RunStats()
    predictions = classifier.classify_all(records, RunConfig("cached", 1), stats=stats)
    one_ms = 1000 * (time.perf_counter() - started) / len(records)
    batched_ms = float("inf")
    for _ in range(2):  # best of two: the figure is a ceiling
        started = time.perf_counter()
        classifier.classify_all(records, RunConfig("batched", args.max_batch))
        batched_ms = min(batched_ms, 1000 * (time.perf_counter() - started) / len(records))
    dtype = str(loaded.dtype).removeprefix("torch.")
    peak = matmul_peak_gflops(loaded.dtype, loaded.device)
    config = loaded.model.config.get_text_config(decoder=True)
    prefix = len(classifier.prompt.prefix_ids)
    width = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    own = stats.tokens_computed / len(records)
    per_token = 2 * nonembedding_params(loaded.model) + 4 * config.num_hidden_layers * width * (prefix + own / 2)
    ideal_ms = 1000 * per_token * own / (peak * 1e9)
    ceiling = Ceiling(one_ms, batched_ms, args.max_batch, ideal_ms, peak, dtype)
    print(f"sequential reference: {len(records)} distinct items one per pass in-process, {1000 / one_ms:.1f} items/s "
          f"({loaded.identity}, {dtype})", flush=True)
    return {p.id: p for p in predictions}, ceiling


class Server:
    """`prefixcache serve` in a subprocess on a free loopback port; stopped with SIGINT (graceful)."""

    def __init__(self, args, max_batch: int, key: str, tasks: tuple[str, ...] = (), extra: tuple[str, ...] = ()):
        task_flags = [flag for task in (tasks or (args.task,)) for flag in ("--task", task)]
        cmd = [sys.executable, "-m", "prefixcache", "serve", *task_flags, *extra, "--model", args.model, "--dtype", args.dtype,
               "--host", HOST, "--port", "0", "--max-batch", str(max_batch),
               "--max-queue", str(max(1024, args.clients * args.items_per_request * 2)), "--log-level", "warning"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if getattr(args, "max_step_tokens", None) is not None:
            cmd += ["--max-step-tokens", str(args.max_step_tokens)]
        env = {**os.environ, "PREFIXCACHE_API_KEY": key, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log: list[str] = []
        self.port = self._wait_for_port()
        threading.Thread(target=self._drain, daemon=True).start()
        self._wait_healthy()

    def _wait_for_port(self, timeout: float = 300) -> int:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.log.append(line)
            if "listening on http://" in line:
                return int(line.rsplit(":", 1)[1])
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError("the server did not start:\n" + "".join(self.log[-30:]))

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def _wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited:\n" + "".join(self.log[-30:]))
            try:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("the server never became healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def post(conn: http.client.HTTPConnection, body: bytes, key: str) -> tuple[int, bytes]:
    conn.request("POST", "/v1/classify", body=body, headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    return response.status, response.read()


def classify_sender(port: int, key: str, task: str):
    """A ``send(items) -> (status, body)`` for one client thread: POST /v1/classify on one keep-alive connection."""
    conn = http.client.HTTPConnection(HOST, port, timeout=300)

    def send(items: list[dict]) -> tuple[int, bytes]:
        nonlocal conn
        body = json.dumps({"task": task, "items": items}).encode()
        for attempt in (1, 2):
            try:
                return post(conn, body, key)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                conn = http.client.HTTPConnection(HOST, port, timeout=300)
                # a kept-alive connection the server closed while idle (uvicorn's keep-alive timeout) is retried
                # once on a new one, as HTTP client libraries do; any other failure, or a second one, is an error
                stale = isinstance(exc, (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected))
                if attempt == 2 or not stale:
                    return 0, f"{type(exc).__name__}: {exc}".encode()

    return send


def drive(port: int, key: str, task: str, requests: list[list[dict]], clients: int, api: str = "classify", task_path: str = ""):
    """Send every request once from ``clients`` threads. Returns [(request index, status, body, seconds)], wall seconds."""
    counter = itertools.count()
    lock = threading.Lock()
    outcomes = []

    def client():
        if api == "openai":
            from loadtest_openai import openai_sender

            send = openai_sender(HOST, port, key, task_path)
        else:
            send = classify_sender(port, key, task)
        while True:
            with lock:
                n = next(counter)
            if n >= len(requests):
                break
            started = time.perf_counter()
            status, data = send(requests[n])
            outcomes.append((n, status, data, time.perf_counter() - started))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, time.perf_counter() - started


def check(lane: Lane, outcomes, requests, reference, args) -> None:
    """Compare every response with the sequential reference; fill the lane's figures.

    Changed labels are only collected here: whether each is a near tie depends on the lane's
    drift over all its responses (see :func:`settle`).
    """
    for n, status, data, seconds in outcomes:
        lane.latencies.append(seconds)
        if status != 200:
            lane.errors.append(f"request {n}: HTTP {status}: {data[:200]!r}")
            continue
        results = json.loads(data)["results"]
        want_ids = [item["id"] for item in requests[n]]
        if [r["id"] for r in results] != want_ids:
            lane.errors.append(f"request {n}: ids {[r['id'] for r in results]} != {want_ids}")
            continue
        lane.items += len(results)
        for item, result in zip(requests[n], results):
            want = reference[item["text"]]
            pairs = [(result["scores"][label], p) for label, p in want.scores.probabilities.items()]
            diff = max(abs(got - p) for got, p in pairs)
            drift = max(abs(math.log(got) - math.log(p)) for got, p in pairs)
            lane.max_prob_diff = max(lane.max_prob_diff, diff)
            lane.max_logprob_diff = max(lane.max_logprob_diff, drift)
            description = f"{result['id']}: {result['label']} {result['scores']} vs sequential {want.label} {want.scores.probabilities}"
            if result["label"] != want.label:
                lane.flips.append((want.scores.margin, description))
                continue
            lane.steady_drift = max(lane.steady_drift, drift)
            if diff > args.tolerance:
                lane.mismatches.append(description)


def settle(lane: Lane, args) -> float:
    """Sort the lane's changed labels into flagged near ties and mismatches; return the near-tie bound used.

    The default bound is twice the drift measured on the responses whose label did not change, so a
    grossly wrong response cannot widen the bound that would excuse it.
    """
    bound = args.near_tie if args.near_tie is not None else 2 * lane.steady_drift
    for margin, description in lane.flips:
        if margin <= bound:
            lane.near_ties += 1
        else:
            lane.mismatches.append(description)
    return bound


def pool_figures(port: int, key: str) -> tuple[float, float]:
    """(pool hits, pool evictions) from the server's /metrics."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"})
    lines = conn.getresponse().read().decode().splitlines()
    value = lambda name: sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))
    return value("prefixcache_pool_hits_total"), value("prefixcache_pool_evictions_total")


def run_soak(args) -> int:
    from loadtest_soak import SOAK_TASKS, soak

    def server_factory(budget: int):
        key = secrets.token_urlsafe(24)
        print(f"[soak] starting server: tasks {', '.join(SOAK_TASKS)}, --cache-budget {budget}", flush=True)
        return Server(args, args.max_batch, key, SOAK_TASKS, ("--cache-budget", str(budget))), key

    return 0 if soak(args, server_factory, classify_sender, pool_figures) else 1


def pass_figures(port: int, key: str) -> tuple[float, float, float]:
    """(forward passes, items in them, seconds spent in them) from the server's /metrics."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"})
    lines = conn.getresponse().read().decode().splitlines()

    def total(series: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(series))

    return total("prefixcache_batch_size_count"), total("prefixcache_batch_size_sum"), total("prefixcache_batch_seconds_sum")


def run_lanes(lanes: list[Lane], args, requests, reference, task_name: str) -> None:
    """Start one server per lane, then drive the lanes in alternating rounds (A B, B A, ...).

    Interleaving makes a drift in background load (a shared machine) hit every lane alike.
    Each round sends a contiguous slice of the requests; every request is sent once per lane.
    """
    servers: dict[str, tuple[Server, str]] = {}
    try:
        for lane in lanes:
            key = secrets.token_urlsafe(24)
            print(f"[{lane.name}] starting server (--max-batch {lane.max_batch})", flush=True)
            servers[lane.name] = (Server(args, lane.max_batch, key), key)
        for lane in lanes:  # warm-up: the first passes pay one-time costs (allocations, kernel selection)
            server, key = servers[lane.name]
            drive(server.port, key, task_name, requests[: min(8, args.clients)], args.clients, lane.api, args.task)
        size = -(-len(requests) // args.rounds)
        slices = [(start, requests[start : start + size]) for start in range(0, len(requests), size)]
        for number, (offset, chunk) in enumerate(slices):
            for lane in lanes if number % 2 == 0 else lanes[::-1]:
                server, key = servers[lane.name]
                before = pass_figures(server.port, key)
                outcomes, seconds = drive(server.port, key, task_name, chunk, args.clients, lane.api, args.task)
                if lane.api == "openai":
                    from loadtest_openai import cached_share

                    low, mean = cached_share(outcomes)
                    lane.cached_min = low if math.isnan(lane.cached_min) else min(lane.cached_min, low)
                    lane.cached_mean = mean
                after = pass_figures(server.port, key)
                lane.seconds += seconds
                lane.passes += after[0] - before[0]
                lane.pass_items += after[1] - before[1]
                lane.pass_seconds += after[2] - before[2]
                check(lane, [(offset + n, *rest) for n, *rest in outcomes], requests, reference, args)
                print(f"[{lane.name}] round {number + 1}/{len(slices)}: {len(chunk)} requests in {seconds:.1f} s", flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()
    for lane in lanes:
        print(f"[{lane.name}] {lane.items} items in {lane.seconds:.1f} s: {lane.items_per_second:.2f} items/s, "
              f"p50 {lane.percentile(0.5):.0f} ms, p99 {lane.percentile(0.99):.0f} ms", flush=True)


def report(lanes: list[Lane], args, ceiling: Ceiling) -> bool:
    first, second = lanes
    bounds = [settle(lane, args) for lane in lanes]
    faster, slower = (second, first) if args.openai else (first, second)
    ratio = faster.items_per_second / slower.items_per_second if slower.items_per_second else float("inf")
    head = f"{'lane':<22}{'items':>7}{'errors':>8}{'mismatch':>10}{'items/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'mean pass':>11}{'pass ms':>9}{'busy':>6}"
    print("\n" + head + "\n" + "-" * len(head))
    for lane in lanes:
        mean_pass = lane.pass_items / lane.passes if lane.passes else float("nan")
        pass_ms = 1000 * lane.pass_seconds / lane.passes if lane.passes else float("nan")
        print(f"{lane.name:<22}{lane.items:>7}{len(lane.errors):>8}{len(lane.mismatches):>10}{lane.items_per_second:>10.2f}"
              f"{lane.percentile(0.5):>9.0f}{lane.percentile(0.99):>9.0f}{mean_pass:>11.1f}{pass_ms:>9.0f}{lane.busy:>6.0%}")
    errors = sum(len(lane.errors) + len(lane.mismatches) for lane in lanes)
    near = sum(lane.near_ties for lane in lanes)
    diff = max(lane.max_prob_diff for lane in lanes)
    if args.openai:
        args.target = args.openai_target
        print(f"\n[openai] prompt tokens reused from the pool per request: smallest {second.cached_min:.1%}, "
              f"mean {second.cached_mean:.1%} (target >= 90%)")
    print(f"\nthroughput ratio ({faster.name} / {slower.name}): {ratio:.2f}x  (target >= {args.target:g}x); "
          f"load average at the end {machine_load()} on {os.cpu_count()} CPUs")
    print(f"responses equal to the sequential result: {'all' if not errors else 'NOT all'}; max |prob diff| {diff:.1e} "
          f"(tolerance {args.tolerance:g}); max |log-prob diff| {max(lane.max_logprob_diff for lane in lanes):.1e}; "
          f"near-tie label flips flagged: {near} (margin <= {max(bounds):.2g})")
    print(f"engine in-process on the same items (no HTTP): {ceiling.one_ms:.1f} ms/item one per pass, "
          f"{ceiling.batched_ms:.1f} ms/item at B={ceiling.batch}: ceiling {ceiling.ratio:.2f}x; "
          f"at 100% of the {ceiling.dtype} matmul peak ({ceiling.peak_gflops:.0f} GFLOP/s) a batched item would take "
          f"{ceiling.ideal_ms:.3g} ms: bound {ceiling.bound:.1f}x")
    for lane in lanes:
        for line in (lane.errors + lane.mismatches)[:5]:
            print(f"  [{lane.name}] {line}")
    ok = errors == 0 and ratio >= args.target
    print("PASS" if ok else "FAIL")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            from prefixcache.model.machine import machine_info  # torch: only once the figures are in

            json.dump({"machine": machine_info(ceiling.dtype, args.threads), "ratio": ratio, "engine_ceiling": ceiling.ratio, "arithmetic_bound": ceiling.bound,
                       "engine_one_ms": ceiling.one_ms, "engine_batched_ms": ceiling.batched_ms, "cpus": os.cpu_count(), "load_average_end": os.getloadavg(), "errors": errors, "near_ties": near, "max_prob_diff": diff, "lanes": [
                {"name": lane.name, "max_batch": lane.max_batch, "items": lane.items, "seconds": lane.seconds,
                 "items_per_second": lane.items_per_second, "p50_ms": lane.percentile(0.5), "p99_ms": lane.percentile(0.99),
                 "errors": len(lane.errors), "mismatches": len(lane.mismatches), "passes": lane.passes,
                 "pass_seconds": lane.pass_seconds, "api": lane.api, "cached_min": lane.cached_min}
                for lane in lanes]}, fh, indent=2)
    return ok


def machine_load() -> str:
    """The 1/5/15-minute load averages: figures from a shared machine mean little without them."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    args = parse_args()
    if args.duration:
        return run_soak(args)
    print(f"load test: {args.clients} clients, {args.requests} requests x {args.items_per_request} item(s) per lane, "
          f"model {args.model}, task {args.task}, dtype {args.dtype}, loopback {HOST}", flush=True)
    print(f"machine: {os.cpu_count()} CPUs, load average {machine_load()} at start", flush=True)
    requests = workload(args.requests, args.items_per_request, args.distinct)
    with tempfile.TemporaryDirectory(prefix="prefixcache-loadtest-") as folder:
        from prefixcache import load_task

        args.task = snapshot_task(args.task, folder)  # from here on, the snapshot's path
        name = load_task(args.task).name
        reference, ceiling = sequential_reference(args, requests)
        if args.openai:
            lanes = [Lane("classify", args.max_batch), Lane("openai guided_choice", args.max_batch, api="openai")]
        else:
            lanes = [Lane(f"micro-batched (<= {args.max_batch})", args.max_batch), Lane("max-batch 1", 1)]
        run_lanes(lanes, args, requests, reference, name)
    return 0 if report(lanes, args, ceiling) else 1


if __name__ == "__main__":
    sys.exit(main())
