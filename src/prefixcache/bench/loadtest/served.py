"""`prefixcache serve` in a subprocess on a free loopback port, and the figures read from its ``/metrics``."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ...model.catalog import MODEL_CONFIGS, RANDOM_PREFIX
from .options import ServedModel

HOST = "127.0.0.1"
TICKET = "My card was charged twice for the same order last week and I would like one of the charges refunded."
MIN_QUEUE = 1024


@dataclass(frozen=True)
class Launch:
    """One ``prefixcache serve``: its model, tasks, batching and queue, and anything else on its command line.

    Attributes:
        served: ``--model``, ``--dtype`` and ``--threads``.
        tasks: one ``--task`` each.
        max_batch, max_queue: ``--max-batch`` and ``--max-queue``.
        max_step_tokens: ``--max-step-tokens`` (None: serve's).
        extra: more arguments, as given.
        pythonpath: a checkout's ``src/`` put first on the server's PYTHONPATH (None: the installed package).
    """

    served: ServedModel
    tasks: tuple[str, ...]
    max_batch: int
    max_queue: int = MIN_QUEUE
    max_step_tokens: int | None = None
    extra: tuple[str, ...] = ()
    pythonpath: str | None = None


def queue_for(clients: int, items_per_request: int) -> int:
    """A ``--max-queue`` that never refuses the load test's own clients: twice what they can have in flight."""
    return max(MIN_QUEUE, clients * items_per_request * 2)


def serve_command(launch: Launch) -> list[str]:
    """The server's command line."""
    task_flags = [flag for task in launch.tasks for flag in ("--task", task)]
    served = launch.served
    cmd = [sys.executable, "-m", "prefixcache", "serve", *task_flags, *launch.extra, "--model", served.model,
           "--dtype", served.dtype, "--host", HOST, "--port", "0", "--max-batch", str(launch.max_batch),
           "--max-queue", str(launch.max_queue), "--log-level", "warning"]
    if served.threads:
        cmd += ["--threads", str(served.threads)]
    if launch.max_step_tokens is not None:
        cmd += ["--max-step-tokens", str(launch.max_step_tokens)]
    return cmd


def serve_environment(launch: Launch, key: str) -> dict[str, str]:
    """This process's environment, the API key, and ``launch.pythonpath`` first on PYTHONPATH."""
    env = {**os.environ, "PREFIXCACHE_API_KEY": key, "PYTHONUNBUFFERED": "1"}
    if launch.pythonpath:
        saved = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = launch.pythonpath + (os.pathsep + saved if saved else "")
    return env


class Server:
    """`prefixcache serve` in a subprocess on a free loopback port; stopped with SIGINT (graceful)."""

    def __init__(self, launch: Launch, key: str):
        self.proc = subprocess.Popen(serve_command(launch), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=serve_environment(launch, key))
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


def metric_totals(port: int, key: str, *series: str) -> tuple[float, ...]:
    """The sum of every ``/metrics`` line that starts with each of ``series``, in order."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"})
    lines = conn.getresponse().read().decode().splitlines()
    return tuple(sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)) for name in series)


def pass_figures(port: int, key: str) -> tuple[float, float, float]:
    """(forward passes, items in them, seconds spent in them) from the server's /metrics."""
    return metric_totals(port, key, "prefixcache_batch_size_count", "prefixcache_batch_size_sum",
                         "prefixcache_batch_seconds_sum")


def pool_figures(port: int, key: str) -> tuple[float, float]:
    """(pool hits, pool evictions) from the server's /metrics."""
    return metric_totals(port, key, "prefixcache_pool_hits_total", "prefixcache_pool_evictions_total")


def check_model(spec: str) -> None:
    """Raise :class:`~prefixcache.errors.ModelNotFoundError` (with what to do) unless ``spec`` names a model this
    machine can load, before any server is started with it (a server that cannot load it would only exit)."""
    from ...model.load import load_random_model, local_source

    if not spec.startswith(RANDOM_PREFIX):
        local_source(spec)
    elif (arch := spec.removeprefix(RANDOM_PREFIX).partition("@")[0]) not in MODEL_CONFIGS:
        load_random_model(arch)  # refuses it before building anything, naming the known architectures
