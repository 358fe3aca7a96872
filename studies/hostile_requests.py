#!/usr/bin/env python3
"""Hostile requests from a key holder against a live `prefixcache serve`, timed, in one run.

For each request of the list (a chat of about 7,800 tokens with ``max_tokens: 1``, as long as
``max_prefix_tokens`` lets a prompt's reusable part be, a ``stop`` list nested
995 deep, recursive and enormous JSON schemas, ``{"$ref": "#"}``, guided choice over thousands of long
choices) it sends the request from one thread and, while it is in flight, a one-item ``POST /v1/classify``
from another, and records the hostile request's status and time and the classify's time. Then it reads the
server's RSS before and after the long chat, and opens 20 streams, reads each to its first event and drops it,
and times a 4-token chat after them.

The bars it prints a verdict on: a one-item classify answers within 2 s with each request in flight; RSS after
the long chat is within 200 MB of before; the 4-token chat after the dropped streams answers within 5 s; no
request gets a 5xx. Exit code 0 when every bar holds.

    python studies/hostile_requests.py                 # the embedded model, serve's default dtype
"""

from __future__ import annotations

import argparse
import http.client
import json
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

from prefixcache.bench.loadtest.options import ServedModel
from prefixcache.bench.loadtest.served import HOST, TICKET, Launch, Server


def post(port: int, key: str, path: str, body: dict | bytes, timeout: float = 600) -> tuple[int, float, str]:
    """(status, seconds, the body's first 160 characters)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    started = time.perf_counter()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    text = response.read().decode(errors="replace")
    conn.close()
    return response.status, time.perf_counter() - started, text[:160]


def chat(model: str, content: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def served_model(port: int, key: str) -> str:
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def hostile(model: str) -> dict[str, dict | bytes]:
    """Name -> request body (to ``/v1/chat/completions``)."""
    long_text = " ".join(f"word{i % 97} ticket" for i in range(2000))  # about 7,800 tokens
    long_chat = {"model": model, "max_tokens": 1, "messages": [{"role": "system", "content": long_text},
                                                              {"role": "user", "content": "hi"}]}
    nested = (json.dumps(chat(model, "hi"))[:-1] + ', "stop": ' + "[" * 995 + '"x"' + "]" * 995 + "}").encode()
    many = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4500)}}
    recursive = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    schema = lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}  # noqa: E731
    choices = [f"choice number {i} " + "with a long tail of words " * 4 for i in range(3000)]
    return {
        "chat of ~7,800 tokens (a system prompt), max_tokens 1": long_chat,
        "stop nested 995 deep": nested,
        "schema with 4,500 optional properties": chat(model, "hi", max_tokens=40, **schema(many)),
        "recursive required $ref": chat(model, "hi", max_tokens=40, **schema(recursive)),
        '{"$ref": "#"}': chat(model, "hi", max_tokens=40, **schema({"$ref": "#"})),
        "guided_choice of 3,000 long choices": chat(model, "route this", guided_choice=choices),
    }


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def classify(port: int, key: str) -> tuple[int, float, str]:
    return post(port, key, "/v1/classify", {"task": "support-tickets", "items": [{"id": 1, "text": TICKET}]})


def while_in_flight(port: int, key: str, body) -> dict:
    """The hostile request on a thread; a one-item classify 0.3 s after it started."""
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(zip(("status", "seconds", "text"),
                                                            post(port, key, "/v1/chat/completions", body))))
    worker.start()
    time.sleep(0.3)
    status, seconds, _ = classify(port, key)
    out["in_flight"] = worker.is_alive()
    worker.join()
    return dict(out, classify_status=status, classify_seconds=seconds)


def drop_streams(port: int, key: str, model: str, count: int) -> None:
    body = json.dumps(chat(model, "Write a long story about a ticket.", max_tokens=200, stream=True)).encode()
    for _ in range(count):
        with socket.create_connection((HOST, port), timeout=60) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            received = b""
            while b"data:" not in received:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                received += chunk


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the server (default: all cores)")
    args = p.parse_args()
    key = secrets.token_urlsafe(16)
    server = Server(Launch(ServedModel(args.model, args.dtype, args.threads), ("support-tickets",), 32), key)
    rows, verdicts = [], []
    try:
        classify(server.port, key)
        idle = sorted(classify(server.port, key)[1] for _ in range(10))
        model = served_model(server.port, key)
        post(server.port, key, "/v1/chat/completions", chat(model, "hi", max_tokens=4))
        for name, body in hostile(model).items():
            before = rss_mb(server.proc.pid)
            row = while_in_flight(server.port, key, body)
            row.update(name=name, rss_before=before, rss_after=rss_mb(server.proc.pid))
            rows.append(row)
            print(f"{name}: {row['status']} {row['text'][:100]!r} in {row['seconds']:.2f} s; classify {row['classify_seconds']:.2f} s "
                  f"(in flight: {row['in_flight']}); RSS {before:.0f} -> {row['rss_after']:.0f} MB", flush=True)
        drop_streams(server.port, key, model, 20)
        status, after_drops, _ = post(server.port, key, "/v1/chat/completions", chat(model, "hi", max_tokens=4))
    finally:
        server.stop()
    from prefixcache.model.machine import machine_info, machine_name

    print(f"\n{machine_name(machine_info(args.dtype))}; dtype {args.dtype}; idle one-item classify p50 "
          f"{1000 * idle[len(idle) // 2]:.0f} ms")
    print("| request | status | seconds | one-item classify meanwhile, s | RSS before -> after, MB |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['name']} | {row['status']} | {row['seconds']:.2f} | {row['classify_seconds']:.2f} | "
              f"{row['rss_before']:.0f} -> {row['rss_after']:.0f} |")
    print(f"| 4-token chat after 20 dropped streams | {status} | {after_drops:.2f} | – | – |")
    longest = rows[0]
    verdicts += [(f"classify within 2 s with each request in flight (slowest {max(r['classify_seconds'] for r in rows):.2f} s)",
                  all(r["classify_seconds"] <= 2 for r in rows)),
                 (f"RSS after the long chat within 200 MB of before ({longest['rss_after'] - longest['rss_before']:+.0f} MB)",
                  longest["rss_after"] - longest["rss_before"] <= 200),
                 (f"4-token chat after 20 dropped streams within 5 s ({after_drops:.2f} s)", after_drops <= 5 and status == 200),
                 ("no 5xx", all(r["status"] < 500 and r["classify_status"] < 500 for r in rows))]
    print("\n" + "\n".join(f"* {'PASS' if ok else 'FAIL'}: {text}" for text, ok in verdicts))
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
