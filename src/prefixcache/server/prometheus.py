"""Prometheus metrics: the series for ``/metrics`` and a small JSON summary for the web page.

Every :class:`Metrics` owns its own ``CollectorRegistry``, so several apps in
one process (tests) never share counters.

Two families describe prefixes:

* per task (``task`` label): ``prefixcache_prefix_bytes`` / ``..._tokens``,
  ``..._builds_total`` (registrations), ``..._hits_total`` (items run over the
  stored prefix), ``..._misses_total`` (items re-encoded in full at a token
  boundary) and ``..._evictions_total`` (the task's prefix replaced by a new version);
* the prefix pool's own counters, read from ``PrefixPool.stats()`` at each
  scrape (:meth:`Metrics.watch_pool`): ``prefixcache_pool_hits_total`` (lookups
  answered from memory), ``..._misses_total`` (lookups that built the prefix),
  ``..._evictions_total``, ``prefixcache_pool_bytes`` (the prefixes held),
  ``..._reserved_bytes`` (the engine loop's slot store, counted in the same budget), ``..._budget_bytes``,
  ``..._entries``, ``..._pinned`` and the prefill tokens saved and computed.

A task's labelled series (those above, ``prefixcache_items_total`` and the per-task pass histograms) exist
exactly while it is registered: :meth:`Metrics.record_removed` removes every one of them, counters included,
so the series do not grow with every task ever registered. A replaced task keeps its series (the name is
still served), except those labelled with a kind the new version no longer has. A pass that finishes
after its task was deleted (requests accepted before the DELETE still finish), or that ran a replaced
version of another kind, counts in the totals and the unlabelled series only. Passes under a name that
was never registered as a task (the OpenAI-compatible routes' ``openai``) are labelled as they come.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATE_WINDOW_S = 10.0
DELETED_KEPT = 4096
"""Deleted task names remembered (oldest forgotten first), so a pass that finishes after its task's DELETE
recreates no series. Only a task deleted while its pass ran needs remembering, and forgetting one would take
4,096 other deletions during that pass (of tasks registered before it: a registration waits for the model)."""


class Metrics:
    """The server's counters. Methods are safe to call from any thread."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "prefixcache_http_requests", "HTTP requests by route and status code.", ["method", "route", "code"], registry=r
        )
        self.request_seconds = Histogram(
            "prefixcache_http_request_seconds", "HTTP request latency.", ["method", "route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.items = Counter("prefixcache_items", "Items answered, by task and kind.", ["task", "kind"], registry=r)
        self.batch_size = Histogram(
            "prefixcache_batch_size", "Sequences (items, requests) per step of the engine loop.", ["task"], buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_seconds = Histogram(
            "prefixcache_batch_seconds", "Time of one step of the engine loop.", ["task"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_wait_seconds = Histogram(
            "prefixcache_queue_wait_seconds", "Time an item waited before its first step.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge("prefixcache_queue_depth", "Items waiting for the model.", registry=r)
        self.in_progress = Gauge(
            "prefixcache_in_progress", "Items admitted and not yet answered (bounded by --max-queue).", registry=r
        )
        self.queue_rejections = Counter("prefixcache_queue_rejections", "Requests refused with 429.", registry=r)
        self.server_errors = Counter(
            "prefixcache_server_errors", "Server faults: answers of 500 or 503 (and error events of a stream that had "
            "already begun), by route and status; each is logged with its request id.", ["route", "code"], registry=r,
        )
        self.abandoned = Counter(
            "prefixcache_requests_abandoned", "Requests whose client went away before their answer (their sequences "
            "are cancelled: one not yet admitted to a step never runs).", registry=r,
        )
        self.prefix_bytes = Gauge("prefixcache_prefix_bytes", "Bytes of each task's stored prefix.", ["task"], registry=r)
        self.prefix_tokens = Gauge("prefixcache_prefix_tokens", "Tokens of each task's stored prefix.", ["task"], registry=r)
        self.prefix_builds = Counter("prefixcache_prefix_builds", "Prefix computations.", ["task"], registry=r)
        self.prefix_hits = Counter("prefixcache_prefix_hits", "Items scored over a stored prefix.", ["task"], registry=r)
        self.prefix_misses = Counter(
            "prefixcache_prefix_misses", "Items re-encoded in full (token boundary fallback).", ["task"], registry=r
        )
        self.prefix_evictions = Counter(
            "prefixcache_prefix_evictions", "Prefixes dropped by replacing the task.", ["task"], registry=r
        )
        self.tasks = Gauge("prefixcache_tasks", "Registered tasks.", registry=r)
        self.abstentions = Counter(
            "prefixcache_abstentions", "Items answered with no label (confidence under the task's threshold), by task "
            "and best-guess label.", ["task", "best_guess"], registry=r,
        )
        self._abstained: dict[str, set[str]] = {}  # per task, the best-guess labels it has abstention series for
        self._lock = threading.Lock()
        self._done: deque[tuple[float, int]] = deque()  # (monotonic time, items) of recent passes
        self._totals = {"items": 0, "hits": 0, "misses": 0, "batches": 0, "requests": 0, "fed": 0}
        self._kinds: dict[str, str] = {}  # each registered task's kind
        self._deleted: OrderedDict[str, None] = OrderedDict()  # deleted, not registered since (DELETED_KEPT)
        self._per_task = (  # every metric labelled by task alone
            self.batch_size, self.batch_seconds, self.prefix_bytes, self.prefix_tokens, self.prefix_builds,
            self.prefix_hits, self.prefix_misses, self.prefix_evictions,
        )

    def watch_pool(self, pool) -> None:
        """Expose ``pool``'s counters (a :class:`~prefixcache.cache.pool.PrefixPool`), read at every scrape.

        A scrape takes the pool's lock, so it waits while a prefix is being built: serve
        ``exposition`` from a worker thread, not from the event loop.
        """
        self.registry.register(_PoolCollector(pool))

    # --- recording -------------------------------------------------------------------------------

    def record_request(self, method: str, route: str, code: int, seconds: float) -> None:
        self.requests.labels(method, route, str(code)).inc()
        self.request_seconds.labels(method, route).observe(seconds)
        with self._lock:
            self._totals["requests"] += 1

    def record_batch(self, task: str, kind: str, size: int, hits: int, seconds: float, new: int | None = None) -> None:
        """One step of ``size`` sequences of ``task``, ``new`` of them (default: all) fed for the first time (items
        counted once each, when first fed), ``hits`` of those over the stored prefix.

        The task's labelled series count it unless ``task`` was deleted, or is now registered with
        another kind (:meth:`record_prefix`); the totals and unlabelled series always do.
        """
        now = time.monotonic()
        with self._lock:  # held across the labelled updates, so a concurrent record_removed cannot be undone
            new = size if new is None else new
            if task not in self._deleted and self._kinds.get(task, kind) == kind:
                if new:
                    self.items.labels(task, kind).inc(new)
                self.batch_size.labels(task).observe(size)
                self.batch_seconds.labels(task).observe(seconds)
                self.prefix_hits.labels(task).inc(hits)
                if new - hits:
                    self.prefix_misses.labels(task).inc(new - hits)
            self._done.append((now, new))
            self._trim(now)
            self._totals["items"] += new
            self._totals["hits"] += hits
            self._totals["misses"] += new - hits
            self._totals["batches"] += 1
            self._totals["fed"] += size

    def record_answers(self, task: str, results) -> None:
        """Count the abstentions among a request's answered ``results`` (their JSON documents), per best guess."""
        guesses = [r.get("best_guess") for r in results if isinstance(r, dict) and r.get("abstained")]
        if not guesses:
            return
        with self._lock:
            if task in self._deleted:
                return
            for guess in guesses:
                self.abstentions.labels(task, str(guess)).inc()
                self._abstained.setdefault(task, set()).add(str(guess))

    def record_prefix(self, task: str, kind: str, tokens: int, nbytes: int, replaced: bool) -> None:
        """Task ``task`` of ``kind`` was registered and its prefix built (``replaced``: it took the place of an
        older version, whose series of another kind are removed)."""
        with self._lock:
            old_kind = self._kinds.get(task)
            self._kinds[task] = kind
            self._deleted.pop(task, None)
            if old_kind is not None and old_kind != kind:
                self.items.remove(task, old_kind)
            for counter in (self.prefix_hits, self.prefix_misses, self.prefix_evictions):
                counter.labels(task)  # expose the series at 0 from the start
            self.prefix_builds.labels(task).inc()
            self.prefix_tokens.labels(task).set(tokens)
            self.prefix_bytes.labels(task).set(nbytes)
            if replaced:
                self.prefix_evictions.labels(task).inc()

    def record_removed(self, task: str) -> None:
        """Task ``task`` was deleted: remove every series labelled with it, from every metric (counters too)."""
        with self._lock:
            kind = self._kinds.pop(task, None)
            self._deleted[task] = None
            self._deleted.move_to_end(task)
            if len(self._deleted) > DELETED_KEPT:
                self._deleted.popitem(last=False)
            for metric in self._per_task:
                metric.remove(task)
            for guess in self._abstained.pop(task, ()):
                self.abstentions.remove(task, guess)
            if kind is not None:
                self.items.remove(task, kind)

    # --- reading ---------------------------------------------------------------------------------

    def items_per_second(self) -> float:
        """Items answered per second over the last :data:`RATE_WINDOW_S` seconds."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._done) / RATE_WINDOW_S

    def summary(self, queue_depth: int, in_progress: int, tasks: int) -> dict:
        """The figures the web page shows (JSON)."""
        rate = self.items_per_second()
        with self._lock:
            totals = dict(self._totals)
        scored = totals["hits"] + totals["misses"]
        return {
            "items_total": totals["items"],
            "items_per_second": round(rate, 2),
            "requests_total": totals["requests"],
            "batches_total": totals["batches"],
            "mean_batch_size": round(totals["fed"] / totals["batches"], 2) if totals["batches"] else None,
            "prefix_hit_rate": round(totals["hits"] / scored, 4) if scored else None,
            "queue_depth": queue_depth,
            "in_progress": in_progress,
            "tasks": tasks,
        }

    def exposition(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)

    def _trim(self, now: float) -> None:
        while self._done and self._done[0][0] < now - RATE_WINDOW_S:
            self._done.popleft()


class _PoolCollector(Collector):
    """The prefix pool's counters as Prometheus series, from one ``stats()`` snapshot per scrape."""

    def __init__(self, pool):
        self._pool = pool

    def collect(self):
        s = self._pool.stats()
        counters = (
            ("hits", "Prefix lookups answered from the pool's memory.", s.hits),
            ("misses", "Prefix lookups the pool could not answer from memory (the prefix was built).", s.misses),
            ("evictions", "Prefixes evicted to stay within the pool's byte budget.", s.evictions),
            ("prefill_tokens_saved", "Prefix tokens the pool spared from computing.", s.prefill_tokens_saved),
            ("prefill_tokens_computed", "Prefix tokens computed for the pool.", s.prefill_tokens_computed),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"prefixcache_pool_{name}", doc, value=value)
        gauges = (
            ("bytes", "Bytes of the prefixes the pool holds.", s.bytes_held),
            ("reserved_bytes", "Bytes of running sequences' slots, counted in the pool's budget beside the prefixes.",
             s.reserved_bytes),
            ("budget_bytes", "The pool's byte budget (cache_budget_bytes): prefixes and reserved bytes together.",
             s.budget_bytes),
            ("entries", "Prefixes the pool holds.", s.entries),
            ("pinned", "Pinned prefixes (never evicted).", s.pinned),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"prefixcache_pool_{name}", doc, value=value)
