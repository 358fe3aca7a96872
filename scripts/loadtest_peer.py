#!/usr/bin/env python3
"""`prefixcache serve` against llama.cpp's own `llama-server`, over the OpenAI chat API, in one run.

Both servers run the same ``.gguf`` (the embedded SmolLM2-135M by default) on loopback, one after the other
(never at once, so neither takes the other's cores). Each gets the same chats from ``--clients`` closed-loop
clients, each an unmodified official ``openai`` client, in two workloads:

* **classification**: the task's system prompt, its worked examples and the ticket, answered with one of the
  task's labels: ``guided_choice`` for prefixcache, the equivalent GBNF ``grammar`` for llama-server;
* **extraction**: a system prompt and the ticket, answered under a ``json_schema`` ``response_format`` of three
  fields (``max_tokens`` 80), greedy.

It reports requests/s, p50/p99 latency and the share of valid answers (a label of the task; JSON with the three
fields) per server and workload, and the ratio prefixcache / llama-server. Without a ``llama-server`` binary
(``--llama-server``, or ``LLAMA_SERVER``, or one on ``PATH``) the llama-server lane is skipped, and says so.

    python scripts/loadtest_peer.py --llama-server /path/to/llama-server --requests 64 --clients 8
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from loadtest import HOST, Server

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": ["string", "null"]},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "product": {"type": ["string", "null"]},
    },
    "required": ["order_id", "sentiment", "product"],
    "additionalProperties": False,
}
EXTRACT_SYSTEM = ("Read the customer's support ticket. Answer with JSON: order_id (copied exactly as written, or null), "
                  "sentiment (positive, neutral or negative) and product (or null).")


@dataclass
class Result:
    server: str
    workload: str
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    valid: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"))
    p.add_argument("--gguf", default=None, help="the .gguf both servers run (default: the embedded model's)")
    p.add_argument("--task", default="support-tickets", help="the classification task (labels, prompt, examples)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="threads for both servers (default: all cores)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the figures as JSON here")
    return p.parse_args()


def embedded_gguf() -> str:
    from prefixcache.model.load import embedded_gguf

    return str(embedded_gguf("smollm2-135m"))


def chats(task_name: str, count: int) -> tuple[list[list[dict]], list[list[dict]], list[str]]:
    """``count`` classification chats and extraction chats over the bundled tickets, and the task's labels."""
    from prefixcache import load_task
    from prefixcache.bench.workload import ticket_records
    from prefixcache.task.prompt import input_lead, render_messages

    task = load_task(task_name)
    head, lead = render_messages(task)[:-1], input_lead(task)
    texts = [record.fields["text"] for record in ticket_records(count)]
    classify = [head + [{"role": "user", "content": lead + text}] for text in texts]
    extract = [[{"role": "system", "content": EXTRACT_SYSTEM}, {"role": "user", "content": text}] for text in texts]
    return classify, extract, list(task.labels)


def drive(base_url: str, key: str, messages: list[list[dict]], clients: int, extra: dict, valid) -> tuple[float, list, list, int]:
    """Send every chat once from ``clients`` closed-loop clients; (seconds, latencies, errors, valid answers)."""
    import openai

    work: queue.SimpleQueue = queue.SimpleQueue()
    for chat in messages:
        work.put(chat)
    latencies, errors, ok, lock = [], [], [0], threading.Lock()

    def client() -> None:
        api = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
        model = api.models.list().data[0].id
        while True:
            try:
                chat = work.get_nowait()
            except queue.Empty:
                return
            started = time.perf_counter()
            try:
                answer = api.chat.completions.create(model=model, messages=chat, temperature=0, **extra)
                text = answer.choices[0].message.content or ""
                good = valid(text)
            except openai.OpenAIError as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                continue
            with lock:
                latencies.append(time.perf_counter() - started)
                ok[0] += good

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, latencies, errors, ok[0]


def is_json_answer(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(SCHEMA["properties"])


def workloads(args, labels: list[str], peer: bool) -> list[tuple[str, dict, object]]:
    """(name, the request's extra fields, the validity check) per workload, for prefixcache or the peer."""
    if peer:
        grammar = "root ::= " + " | ".join(json.dumps(label) for label in labels)
        choose = {"max_tokens": 16, "extra_body": {"grammar": grammar}}
    else:
        choose = {"extra_body": {"guided_choice": labels}}
    schema = {"max_tokens": 80, "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "ticket", "schema": SCHEMA}}}
    return [("classification", choose, lambda text: text in labels), ("extraction", schema, is_json_answer)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama.cpp's ``llama-server`` with ``--parallel`` slots on a free loopback port."""

    def __init__(self, binary: str, gguf: str, clients: int, threads: int | None, key: str):
        self.port = free_port()
        cmd = [binary, "-m", gguf, "--host", HOST, "--port", str(self.port), "--parallel", str(clients),
               "-c", str(2048 * clients), "--api-key", key, "--log-disable"]
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("llama-server never became healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_server(name: str, start, base_url_of, args, classify, extract, labels, peer: bool) -> list[Result]:
    key = secrets.token_urlsafe(16)
    print(f"[{name}] starting", flush=True)
    server = start(key)
    results = []
    try:
        for (workload, extra, valid), messages in zip(workloads(args, labels, peer), (classify, extract)):
            drive(base_url_of(server), key, messages[: args.clients], args.clients, extra, valid)  # warm-up
            seconds, latencies, errors, ok = drive(base_url_of(server), key, messages, args.clients, extra, valid)
            result = Result(name, workload, seconds, latencies, ok, errors)
            results.append(result)
            print(f"[{name}] {workload}: {result.rate:.2f} req/s, p99 {result.percentile(0.99):.2f} s, "
                  f"{ok}/{len(messages)} valid, {len(errors)} errors", flush=True)
    finally:
        server.stop()
    return results


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    gguf = args.gguf or embedded_gguf()
    classify, extract, labels = chats(args.task, args.requests)
    ours = argparse.Namespace(task=args.task, model=gguf if args.gguf else "smollm2-135m", dtype=args.dtype,
                              clients=args.clients, items_per_request=1, threads=args.threads, max_step_tokens=None)
    results = run_server("prefixcache", lambda key: Server(ours, 32, key, extra=("--max-queue-per-client", "512")),
                         lambda s: f"http://{HOST}:{s.port}/v1", args, classify, extract, labels, peer=False)
    if args.llama_server and Path(args.llama_server).exists():
        results += run_server("llama-server", lambda key: LlamaServer(args.llama_server, gguf, args.clients, args.threads, key),
                              lambda s: f"http://{HOST}:{s.port}/v1", args, classify, extract, labels, peer=True)
    else:
        print("llama-server lane skipped: no llama-server binary (pass --llama-server or set LLAMA_SERVER)")
    from prefixcache.model.machine import machine_info, machine_name

    print(f"\n{machine_name(machine_info(args.dtype))}; {args.requests} requests per workload, {args.clients} clients, dtype {args.dtype}")
    print("| workload | prefixcache req/s | llama-server req/s | ratio | p99 prefixcache / llama-server | valid |")
    print("|---|---|---|---|---|---|")
    by = {(r.server, r.workload): r for r in results}
    for workload in ("classification", "extraction"):
        a, b = by[("prefixcache", workload)], by.get(("llama-server", workload))
        ratio = f"**{a.rate / b.rate:.2f}x**" if b and b.rate else "-"
        peer = f"{b.rate:.2f}" if b else "skipped"
        p99 = f"{a.percentile(0.99):.2f} s / {b.percentile(0.99):.2f} s" if b else f"{a.percentile(0.99):.2f} s / -"
        valid = f"{a.valid}/{args.requests}" + (f", {b.valid}/{args.requests}" if b else "")
        print(f"| {workload} | {a.rate:.2f} | {peer} | {ratio} | {p99} | {valid} |")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps([r.__dict__ | {"rate": r.rate} for r in results], indent=1))
    return 0 if all(not r.errors for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
