"""The disk tier's own byte budget (LRU by last use, recorded in the folder manifest) and its safety when
several processes use one folder at once (issue 18, item 3).

The hammer test runs real processes (forked from a fresh fork server) for ``PREFIXCACHE_HAMMER_SECONDS`` (default 60): two writers,
a reader and a clearer on one folder; then every file must load and verify, no temporary file may be
left, and no save reported after the last clear may be missing unless an eviction came after it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import random
import time

import pytest
from typer.testing import CliRunner

from tests.cache import disk_hammer
from tests.support.models import save_tiny_model
from tests.support.tasks import TASK_YAML, TEXTS
from prefixcache.cache import manifest
from prefixcache.cache.config import PoolConfig
from prefixcache.cache.disk import DiskRead, DiskStore, Expected
from prefixcache.cache.kv import PrefixKV
from prefixcache.cache.layouts import STORAGES
from prefixcache.cache.manifest import FOLDER_MANIFEST, STALE_TEMP_SECONDS, TEMP_GLOB, DiskFolder
from prefixcache.cache.pool import PrefixPool
from prefixcache.cli.app import app

HAMMER_SECONDS = float(os.environ.get("PREFIXCACHE_HAMMER_SECONDS", "60"))
FLOAT = STORAGES["float"]()


def entry(loaded, length: int, seed: int, with_tensors: bool = True) -> disk_hammer.Entry:
    """A prefix of ``length`` random tokens computed by the tiny model, as the hammer's processes get it."""
    token_ids = tuple(random.Random(seed).randrange(10, 390) for _ in range(length))
    digest = hashlib.sha256(f"{seed}:{token_ids}".encode()).hexdigest()[:40]
    expected = Expected(loaded.identity, "float32", "float", token_ids)
    tensors = PrefixKV.build(loaded.model, token_ids).to_tensors() if with_tensors else None
    return disk_hammer.Entry(digest, expected, tensors)


def save(store: DiskStore, e: disk_hammer.Entry):
    return store.write(e.digest, "float", FLOAT.from_tensors(e.tensors), e.expected, "t")


def read(store: DiskStore, e: disk_hammer.Entry) -> DiskRead:
    return store.read(e.digest, FLOAT, e.expected)


# --- the budget ------------------------------------------------------------------------------


def test_budget_evicts_the_least_recently_used_not_the_first_written(tiny_llama, tmp_path):
    a, b, c = (entry(tiny_llama, 40, seed) for seed in range(3))
    store = DiskStore(tmp_path)  # no budget of its own: it honours the one recorded later
    size = save(store, a).bytes
    assert save(store, b).bytes == size
    assert read(store, a).packed is not None  # a is used after b was written: b is now the least recently used
    DiskStore(tmp_path, budget_bytes=2 * size + size // 2)  # another process records a budget that holds two
    saved = save(store, c)
    assert [p.name for p in saved.evicted] == [f"{b.digest}.float.safetensors"], "LRU is by last use, not by write"
    assert sorted(f.path.name for f in store.files()) == sorted(f"{e.digest}.float.safetensors" for e in (a, c))
    record = json.loads((tmp_path / FOLDER_MANIFEST).read_text())
    assert record["budget_bytes"] == 2 * size + size // 2 == store.budget_bytes
    lowered = DiskFolder(tmp_path).set_budget(size)  # lowering the budget evicts at once; a file of exactly it stays
    assert [p.name for p in lowered] == [f"{a.digest}.float.safetensors"] and len(store.files()) == 1


def test_a_pool_hit_in_memory_marks_the_file_used(tiny_llama, tmp_path):
    pool = PrefixPool(store=DiskStore(tmp_path))
    pool.get(tiny_llama, range(5, 30))
    (path,) = tmp_path.glob("*.safetensors")
    os.utime(path, ns=(1, 1))
    assert pool.get(tiny_llama, range(5, 30)).source == "memory"
    assert path.stat().st_mtime_ns > 1, "a hit in memory is a use: the file's LRU clock must move"


def test_a_prefix_larger_than_the_whole_budget_is_not_saved(tiny_llama, tmp_path, caplog):
    pool = PrefixPool(PoolConfig(), DiskStore(tmp_path, budget_bytes=1000))
    with caplog.at_level(logging.WARNING, logger="prefixcache.cache.pool"):
        lookup = pool.get(tiny_llama, range(5, 30))
    assert lookup.source == "computed" and pool.stats().disk_writes == 0
    assert "more than the cache folder" in caplog.text and "not saved" in caplog.text, caplog.text
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob(TEMP_GLOB))


def test_cli_cache_dir_budget_is_recorded_and_listed(tiny_llama, tmp_path_factory, tmp_path):
    model_dir = save_tiny_model(tmp_path_factory, "qwen2")
    (tmp_path / "task.yaml").write_text(TASK_YAML)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:2]))
    store, runner = tmp_path / "kv", CliRunner()
    run = ["classify", str(tmp_path / "in.jsonl"), "--task", str(tmp_path / "task.yaml"), "--model", model_dir,
           "--dtype", "float32", "--cache-dir", str(store), "--cache-dir-budget", "10MB"]
    assert runner.invoke(app, run, catch_exceptions=False).exit_code == 0
    assert json.loads((store / FOLDER_MANIFEST).read_text())["budget_bytes"] == 10_000_000
    listed = runner.invoke(app, ["cache", "ls", "--cache-dir", str(store), "--json"], catch_exceptions=False)
    assert [json.loads(line)["budget_bytes"] for line in listed.stdout.splitlines()] == [10_000_000]
    table = runner.invoke(app, ["cache", "ls", "--cache-dir", str(store)], catch_exceptions=False)
    assert "budget 9.5 MiB" in table.stdout, table.stdout
    cleared = runner.invoke(app, ["cache", "clear", "--cache-dir", str(store)], catch_exceptions=False)
    assert cleared.exit_code == 0 and DiskFolder(store).budget_bytes == 10_000_000, "clear keeps the folder's budget"
    alone = runner.invoke(app, run[:-4] + ["--cache-dir-budget", "10MB"])
    assert alone.exit_code == 2 and "limits the --cache-dir folder" in alone.output, alone.output


# --- concurrency, in one process ------------------------------------------------------------


def test_clear_removes_a_killed_writers_temp_file_but_not_a_save_in_progress(tmp_path):
    folder = DiskFolder(tmp_path, budget_bytes=10**6)
    (tmp_path / "a.float.safetensors").write_bytes(b"x" * 10)
    stale, live = tmp_path / ".a.float.safetensors.tmp1-dead", tmp_path / ".b.float.safetensors.tmp2-live"
    for temp in (stale, live):
        temp.write_bytes(b"y" * 5)
    old = time.time_ns() - int((STALE_TEMP_SECONDS + 60) * 1e9)
    os.utime(stale, ns=(old, old))
    assert [f.path.name for f in folder.files()] == ["a.float.safetensors"], "temporary files are not listed"
    cleared = folder.clear()
    assert (cleared.files, cleared.bytes) == (2, 15)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".lock", FOLDER_MANIFEST, live.name])


def test_a_file_deleted_by_another_process_is_a_miss_and_is_not_listed(tiny_llama, tmp_path, monkeypatch):
    e = entry(tiny_llama, 20, 7)
    store = DiskStore(tmp_path)
    path = save(store, e).path
    real_open = manifest.safe_open

    def evicted_meanwhile(name, **kw):
        os.unlink(name)  # another process evicts or clears it between the listing and the opening
        return real_open(name, **kw)

    monkeypatch.setattr(manifest, "safe_open", evicted_meanwhile)
    assert store.files() == [], "a file gone since the listing is left out, not an error"
    assert read(store, e) == DiskRead(path), "a file gone is a miss, not a problem"


# --- the hammer: real processes on one folder ----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)  # about a minute of real processes; the mutation runs' 60 s per test is too short
def test_four_processes_hammering_one_folder_lose_and_tear_nothing(tiny_llama, tmp_path):
    entries = [entry(tiny_llama, 100 + 25 * i, 100 + i) for i in range(9)]
    root = tmp_path / "kv"
    budget = sum(sum(t.nbytes for t in e.tensors.values()) for e in entries) // 2  # about four of the nine
    DiskStore(root, budget_bytes=budget)
    stale = root / ".old.float.safetensors.tmp999-dead"  # left by a killed writer
    stale.write_bytes(b"z")
    old = time.time_ns() - int((STALE_TEMP_SECONDS + 60) * 1e9)
    os.utime(stale, ns=(old, old))
    logs = {name: str(tmp_path / f"{name}.json") for name in ("writer0", "writer1", "reader", "clearer")}
    light = [disk_hammer.Entry(e.digest, e.expected) for e in entries]
    ctx = multiprocessing.get_context("forkserver")  # fresh processes, as with spawn, but torch is imported once:
    ctx.set_forkserver_preload(["prefixcache.cache.disk"])  # four spawned imports took 30 s on two busy cores
    barrier = ctx.Barrier(4)
    jobs = [
        ctx.Process(target=disk_hammer.writer, args=(str(root), entries[:6], HAMMER_SECONDS, logs["writer0"], barrier)),
        ctx.Process(target=disk_hammer.writer, args=(str(root), entries[3:], HAMMER_SECONDS, logs["writer1"], barrier)),
        ctx.Process(target=disk_hammer.reader, args=(str(root), light, HAMMER_SECONDS, logs["reader"], barrier)),
        ctx.Process(target=disk_hammer.clearer, args=(str(root), HAMMER_SECONDS, logs["clearer"], barrier)),
    ]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=HAMMER_SECONDS + 150)
    assert [job.exitcode for job in jobs] == [0] * 4, "a hammering process failed (its traceback is above)"
    got = {name: json.loads(open(path).read()) for name, path in logs.items()}
    _check_the_folder(root, entries, budget, got)


def _check_the_folder(root, entries, budget, got) -> None:
    saves = got["writer0"]["saves"] + got["writer1"]["saves"]
    clears, reads = got["clearer"]["clears"], got["reader"]
    assert not reads["problems"], f"the reader saw torn or bad files: {reads['problems'][:5]}"
    assert reads["loads"] > 0 and len(clears) >= 2 and any(s["evicted"] for s in saves), (
        f"the hammer did not exercise the folder: {reads['loads']} loads, {len(clears)} clears, {len(saves)} saves"
    )
    store, by_name = DiskStore(root), {e.file_name: e for e in entries}
    present = {p.name for p in root.glob("*.safetensors")}
    for name in present:
        assert read(store, by_name[name]).packed is not None, f"{name} does not load and verify"
    assert not list(root.glob(TEMP_GLOB)), f"temporary files left behind: {list(root.glob(TEMP_GLOB))}"
    assert sum(p.stat().st_size for p in root.glob("*.safetensors")) <= budget, "the folder is over its budget"
    last_clear = max(c["t1"] for c in clears)
    evictions = [(s["t1"], name) for s in saves for name in s["evicted"]]
    checked = [s for s in saves if s["saved"] and s["t0"] > last_clear]
    lost = [s["file"] for s in checked
            if s["file"] not in present and not any(t1 > s["t0"] and name == s["file"] for t1, name in evictions)]
    assert checked and not lost, f"{len(lost)} of {len(checked)} saves after the last clear are missing: {lost[:5]}"
    print(f"hammer, {HAMMER_SECONDS:.0f} s: {sum(1 for s in saves if s['saved'])} saves ({len(evictions)} evictions), "
          f"{reads['loads']} verified loads, {len(clears)} clears, 0 torn or bad reads; {len(present)} files at the end, "
          f"all verified; {len(checked)} saves after the last clear, none lost")
