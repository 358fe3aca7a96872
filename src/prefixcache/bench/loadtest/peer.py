"""`prefixcache serve` against llama.cpp's own `llama-server`, over the OpenAI chat API, in one run
(``prefixcache loadtest peer``).

Both servers run the same ``.gguf`` (the embedded SmolLM2-135M by default) on loopback, one after the other
(never at once, so neither takes the other's cores). Each gets the same chats from ``--clients`` closed-loop
clients, each an unmodified official ``openai`` client (a test extra: imported only when the lane runs), in two
workloads:

* **classification**: the task's system prompt, its worked examples and the ticket, answered with one of the
  task's labels: ``guided_choice`` for prefixcache, the equivalent GBNF ``grammar`` for llama-server;
* **extraction**: a system prompt and the ticket, answered under a ``json_schema`` ``response_format`` of three
  fields (``max_tokens`` 80), greedy.

It reports requests/s, p50/p99 latency and the share of valid answers (a label of the task; JSON with the three
fields) per server and workload, and the ratio prefixcache / llama-server. Without a ``llama-server`` binary
(``--llama-server``, or ``LLAMA_SERVER``, or one on ``PATH``) the llama-server lane is skipped, and says so.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...model.catalog import DEFAULT_MODEL
from .llama_server import LlamaServer, found_binary
from .options import PeerOptions, ServedModel
from .served import HOST, Launch, Server, queue_for

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
    answer_tokens: list[int] = field(default_factory=list)  # each answer's completion tokens (the server's usage)

    @property
    def tokens_per_answer(self) -> float:
        return sum(self.answer_tokens) / len(self.answer_tokens) if self.answer_tokens else float("nan")

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass(frozen=True)
class Chats:
    """The classification chats, the extraction chats, and the task's labels."""

    classify: list[list[dict]]
    extract: list[list[dict]]
    labels: list[str]


def chats(task_name: str, count: int) -> Chats:
    """``count`` classification chats and extraction chats over the bundled tickets, and the task's labels."""
    from ...task.definition import load_task
    from ...task.prompt import input_lead, render_messages
    from ..workload import ticket_records

    task = load_task(task_name)
    head, lead = render_messages(task)[:-1], input_lead(task)
    texts = [record.fields["text"] for record in ticket_records(count)]
    classify = [head + [{"role": "user", "content": lead + text}] for text in texts]
    extract = [[{"role": "system", "content": EXTRACT_SYSTEM}, {"role": "user", "content": text}] for text in texts]
    return Chats(classify, extract, list(task.labels))


def drive(base_url: str, key: str, messages: list[list[dict]], clients: int, workload: tuple[str, dict, object]):
    """Send every chat once from ``clients`` closed-loop clients, with ``workload``'s extra fields and validity
    check; (seconds, latencies, errors, valid answers, each answer's completion tokens)."""
    import openai

    _, extra, valid = workload
    work: queue.SimpleQueue = queue.SimpleQueue()
    for chat in messages:
        work.put(chat)
    latencies, errors, ok, tokens, lock = [], [], [0], [], threading.Lock()

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
                tokens.append(answer.usage.completion_tokens if answer.usage else 0)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, latencies, errors, ok[0], tokens


def is_json_answer(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(SCHEMA["properties"])


def workloads(labels: list[str], peer: bool) -> list[tuple[str, dict, object]]:
    """(name, the request's extra fields, the validity check) per workload, for prefixcache or the peer."""
    if peer:
        grammar = "root ::= " + " | ".join(json.dumps(label) for label in labels)
        choose = {"max_tokens": 16, "extra_body": {"grammar": grammar}}
    else:
        choose = {"extra_body": {"guided_choice": labels}}
    schema = {"max_tokens": 80, "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "ticket", "schema": SCHEMA}}}
    return [("classification", choose, lambda text: text in labels), ("extraction", schema, is_json_answer)]


def run_server(name: str, start, options: PeerOptions, chats: Chats, peer: bool) -> list[Result]:
    """Start one server (``start(key)``), warm up and time both workloads on it, stop it."""
    key = secrets.token_urlsafe(16)
    print(f"[{name}] starting", flush=True)
    server = start(key)
    base_url = f"http://{HOST}:{server.port}/v1"
    results = []
    try:
        for workload, messages in zip(workloads(chats.labels, peer), (chats.classify, chats.extract)):
            drive(base_url, key, messages[: options.clients], options.clients, workload)  # warm-up
            seconds, latencies, errors, ok, tokens = drive(base_url, key, messages, options.clients, workload)
            result = Result(name, workload[0], seconds, latencies, ok, errors, tokens)
            results.append(result)
            print(f"[{name}] {workload[0]}: {result.rate:.2f} req/s, p99 {result.percentile(0.99):.2f} s, "
                  f"{ok}/{len(messages)} valid, {len(errors)} errors, {result.tokens_per_answer:.1f} tokens an answer",
                  flush=True)
    finally:
        server.stop()
    return results


def embedded_gguf() -> str:
    from ...model.load import embedded_gguf

    return str(embedded_gguf(DEFAULT_MODEL))


def run_peer(options: PeerOptions) -> bool:
    """prefixcache, then llama-server (when there is one), on the same chats; the table; True when no request
    failed."""
    gguf = options.gguf or embedded_gguf()
    chosen = chats(options.task, options.requests)
    served = ServedModel(gguf if options.gguf else DEFAULT_MODEL, options.dtype, options.threads)
    results = []
    for backend in options.backends:
        ours = Launch(served, (options.task,), 32, queue_for(options.clients, 1),
                      extra=("--max-queue-per-client", "512", "--backend", backend))
        results += run_server(ours_name(backend), lambda key: Server(ours, key), options, chosen, peer=False)
    binary = found_binary(options.llama_server)
    if binary:
        results += run_server("llama-server", lambda key: LlamaServer(binary, gguf, options.clients, options.threads, key),
                              options, chosen, peer=True)
    elif options.llama_server:
        print(f"llama-server lane skipped: {options.llama_server} does not exist (build llama.cpp's llama-server there, "
              f"or pass another --llama-server)")
    else:
        print("llama-server lane skipped: no llama-server binary (pass --llama-server or set LLAMA_SERVER)")
    from ...model.machine import machine_info

    machine = machine_info(options.dtype, options.threads)
    print_table(results, options, machine)
    if options.json_path:
        document = {"machine": machine,
                    "results": [r.__dict__ | {"rate": r.rate, "tokens_per_answer": r.tokens_per_answer} for r in results]}
        Path(options.json_path).write_text(json.dumps(document, indent=1))
    return all(not r.errors for r in results)


def print_table(results: list[Result], options: PeerOptions, machine: dict) -> None:
    from ...model.machine import machine_name

    print(f"\n{machine_name(machine)}; {options.requests} requests per workload, "
          f"{options.clients} clients, dtype {options.dtype}")
    print("| workload | prefixcache (--backend) | prefixcache req/s | llama-server req/s | ratio "
          "| p99 prefixcache / llama-server | tokens an answer | valid |")
    print("|---|---|---|---|---|---|---|---|")
    by = {(r.server, r.workload): r for r in results}
    for workload in ("classification", "extraction"):
        for backend in options.backends:
            a, b = by[(ours_name(backend), workload)], by.get(("llama-server", workload))
            ratio = f"**{a.rate / b.rate:.2f}x**" if b and b.rate else "-"
            peer = f"{b.rate:.2f}" if b else "skipped"
            p99 = f"{a.percentile(0.99):.2f} s / {b.percentile(0.99):.2f} s" if b else f"{a.percentile(0.99):.2f} s / -"
            valid = f"{a.valid}/{options.requests}" + (f", {b.valid}/{options.requests}" if b else "")
            tokens = f"{a.tokens_per_answer:.1f}" + (f" / {b.tokens_per_answer:.1f}" if b else "")
            print(f"| {workload} | {backend} | {a.rate:.2f} | {peer} | {ratio} | {p99} | {tokens} | {valid} |")


def ours_name(backend: str) -> str:
    """The result name of prefixcache served with ``--backend backend`` (plain ``prefixcache`` for ``auto``)."""
    return "prefixcache" if backend == "auto" else f"prefixcache --backend {backend}"
