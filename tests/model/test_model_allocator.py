"""The allocator tuning (prefixcache.model.allocator): freed tensor memory is reused, not faulted in again.

Each case runs in a fresh interpreter, since the tuning is process-wide and once per process. The
measure is the kernel's count of minor page faults over 20 rounds that each make four 16 MiB tensors
and free them all, as a pass does with its activations. Kept, only the first round faults its pages
in. For the comparison the untuned case pins glibc's classic 128 KiB mmap threshold, under which every
round gets fresh pages: glibc's default threshold moves with the process's allocation history, so the
untuned default faults anywhere from a little to every round (which is why the tuning exists).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, json, os, resource, torch
from prefixcache.model.allocator import M_MMAP_THRESHOLD, keep_freed_memory
if os.environ["PREFIXCACHE_KEEP_FREED_MEMORY"] == "0":
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # glibc's classic, history-free setting
from prefixcache.model.load import set_threads
set_threads(1)  # what load_model does first
def one_round():
    activations = [torch.ones(4 << 20) for _ in range(4)]  # 4 x 16 MiB alive at once, then all freed
    del activations
one_round()  # the first round grows the heap (or the thresholds) either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    one_round()
print(json.dumps({"tuned": keep_freed_memory(), "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def probe(keep: str) -> dict:
    env = {**os.environ, "PREFIXCACHE_KEEP_FREED_MEMORY": keep}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="only glibc's allocator is tuned")
def test_loading_keeps_freed_memory_for_reuse():
    kept, handed_back = probe("1"), probe("0")
    assert kept["tuned"] and not handed_back["tuned"]
    pages = 20 * 4 * (16 << 20) // 4096  # what 20 rounds of fresh memory fault in
    assert handed_back["faults"] > pages // 2, f"untuned, every round should fault in fresh pages: {handed_back}"
    assert kept["faults"] < pages // 10, f"tuned, the freed tensor should be reused: {kept}"


RELEASE_PROBE = """
import json, resource
from prefixcache.model.allocator import keep_freed_memory, release_freed_memory
def rss_kb():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS:')).split()[1])
keep_freed_memory()
blocks = [bytearray(8 << 20) for _ in range(40)]  # 320 MiB from the heap (blocks under the raised threshold)
peak = rss_kb()
del blocks
kept = rss_kb()
released = release_freed_memory()
print(json.dumps(dict(peak=peak, kept=kept, after=rss_kb(), released=released)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="only glibc's allocator is tuned")
def test_releasing_freed_memory_gives_the_kept_heap_back():
    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, check=True, timeout=300)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["released"]
    assert m["kept"] > m["peak"] - (64 << 10), f"the tuned heap should keep freed memory until released: {m}"
    assert m["after"] < m["kept"] - (200 << 10), f"release_freed_memory should give most of 320 MiB back: {m}"
