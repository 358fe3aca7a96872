"""A classification sent while a long extraction decodes, against the same classification on an idle server.

Issue 19 measured one ``/v1/extract`` request (4 items) holding the model for its whole decoding while a
classify request sent meanwhile waited behind it. The batcher now runs short passes between decoding steps
(``engine/steps.py``). This script starts one ``prefixcache serve`` with the bundled ``support-tickets`` and
``ticket-fields`` tasks, times a one-item classify on the idle server, then sends a 4-item extraction and,
once it is decoding, the same classify, and prints both latencies, their ratio and the extraction's time.

    python scripts/step_scheduling.py --dtype float32
"""

from __future__ import annotations

import argparse
import http.client
import json
import secrets
import threading
import time

from loadtest import HOST, Server

ITEMS = [
    "My card was charged twice for the same order last week and I would like one of the charges refunded.",
    "The app crashes whenever I open the settings page on my phone after the latest update.",
    "I cannot log in to my account since I changed my email address yesterday.",
    "Please cancel my subscription and tell me whether I get money back for this month.",
]


def post(port: int, key: str, path: str, body: dict) -> tuple[int, float]:
    conn = http.client.HTTPConnection(HOST, port, timeout=1800)
    started = time.perf_counter()
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    response.read()
    return response.status, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    args.max_wait_ms = args.arrival_gap_ms = None
    args.clients, args.items_per_request = 1, 4
    key = secrets.token_urlsafe(24)
    server = Server(args, 32, key, ("support-tickets", "ticket-fields"))
    classify = {"task": "support-tickets", "items": [{"id": "c", "text": ITEMS[0]}]}
    try:
        post(server.port, key, "/v1/classify", classify)  # warm-up
        idle = min(post(server.port, key, "/v1/classify", classify)[1] for _ in range(3))
        outcome: dict = {}
        extract = {"task": "ticket-fields", "items": [{"id": f"e{i}", "text": t} for i, t in enumerate(ITEMS)]}
        thread = threading.Thread(target=lambda: outcome.update(extract=post(server.port, key, "/v1/extract", extract)))
        sent = time.perf_counter()
        thread.start()
        time.sleep(3.0)  # the extraction's prefill is done and it is decoding
        status, during = post(server.port, key, "/v1/classify", classify)
        answered = time.perf_counter() - sent
        thread.join()
        extract_status, extract_s = outcome["extract"]
    finally:
        server.stop()
    print("| measurement | seconds |\n| --- | --- |")
    print(f"| classify, idle server (best of 3) | {idle:.2f} |")
    print(f"| classify sent 3 s into a 4-item extraction | {during:.2f} (status {status}) |")
    print(f"| the extraction, whole | {extract_s:.2f} (status {extract_status}) |")
    print(f"\nclassify during extraction / idle: {during / idle:.1f}x; answered {answered:.1f} s after the extraction was "
          f"sent, {'before' if answered < extract_s else 'after'} it finished")
    return 0 if status == 200 and extract_status == 200 and answered < extract_s else 1


if __name__ == "__main__":
    raise SystemExit(main())
