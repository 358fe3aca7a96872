"""llama.cpp's own ``llama-server`` on a free loopback port, for the peer lane (:mod:`.peer`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from .served import HOST


def found_binary(given: str | None) -> str | None:
    """The ``llama-server`` to run: ``given``, else ``$LLAMA_SERVER``, else one on ``PATH``; None when that names no
    file here (the peer's lane is then skipped)."""
    binary = given or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    return binary if binary and Path(binary).exists() else None


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
