"""PrefixPool: eviction order per policy, pins, the byte budget, identity, partial reuse, disk tier, int8 storage.

All on the tiny in-process models of conftest.py.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from prefixcache.cli.app import app
from prefixcache.errors import CacheStoreError, PoolBudgetError
from prefixcache.cache.kv import KVShape, PrefixKV
from prefixcache.cache.config import PoolConfig, parse_bytes
from prefixcache.cache.eviction import POLICIES, LFUPolicy, LRUPolicy
from prefixcache.cache.pool import PrefixKey, PrefixPool
from prefixcache.cache.layouts import STORAGES, Int8Storage
from prefixcache.eval.verify_storage import storage_agreement
from prefixcache.scheduler.classify import Classifier, RunConfig, records_from_texts
from prefixcache.cache.disk import DiskStore
from prefixcache.eval.verify import compare

from tests.support.models import tiny_loaded, save_tiny_model
from tests.support.tasks import TASK_YAML, TEXTS

TOL = 1e-4


def ids(first: int, length: int = 6) -> tuple[int, ...]:
    """A token row that shares no leading token with rows of another ``first``."""
    return (first,) + tuple(10 + (first * 7 + i) % 300 for i in range(length - 1))


def pool_for(loaded, entries: float, policy: str = "lru", length: int = 6, **kw) -> PrefixPool:
    """A pool whose budget holds ``entries`` prefixes of ``length`` tokens."""
    size = PrefixPool().size_of(loaded, length)
    return PrefixPool(PoolConfig(int(size * entries), policy, min_shared_tokens=10**6, **kw))


def held(pool, loaded, firsts) -> list[bool]:
    return [PrefixKey.of(loaded, ids(f)) in pool for f in firsts]


def test_a_prefix_the_caller_computed_is_held_as_get_would_hold_it():
    """``hold`` of a prefix computed elsewhere (in chunks, say): ``holds`` says so, a later ``get`` is a hit on
    that very prefix, and holding it again changes nothing."""
    loaded = tiny_loaded("llama")
    pool = pool_for(loaded, 3)
    prefix = PrefixKV.build(loaded.model, ids(1))
    assert not pool.holds(loaded, ids(1))
    assert pool.fits(loaded, len(ids(1))) and not pool.fits(loaded, 4 * len(ids(1))), "the budget holds 3 prefixes"
    pool.hold(loaded, prefix, name="chunked")
    pool.hold(loaded, prefix, name="chunked")
    assert pool.holds(loaded, ids(1)) and not pool.holds(loaded, ids(2))
    lookup = pool.get(loaded, ids(1))
    assert lookup.source == "memory" and lookup.prefix is prefix
    stats = pool.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.prefill_tokens_computed) == (1, 1, 1, len(ids(1)))


# --- policies -------------------------------------------------------------------------------


def test_policies_registry_feeds_the_cli():
    assert set(POLICIES) == {"lru", "lfu"} and set(STORAGES) == {"float", "int8"}
    from prefixcache.cache.config import STORAGE_NAMES
    from prefixcache.cli import options as cli

    assert tuple(STORAGES) == STORAGE_NAMES, "the torch-free storage names the CLI offers are the registry's"
    assert set(POLICIES) <= set(cli.EvictionOpt.help.replace(",", " ").replace(".", " ").split())
    assert set(STORAGES) <= set(cli.KVStorageOpt.help.replace(",", " ").replace(".", " ").split())


def test_lru_and_lfu_order_on_their_own():
    lru, lfu = LRUPolicy(), LFUPolicy()
    for policy in (lru, lfu):
        for key in "abc":
            policy.insert(key)
    for key in "aab":
        lru.access(key)
        lfu.access(key)
    assert lru.order() == ["c", "a", "b"], "LRU evicts the least recently used first"
    assert lfu.order() == ["c", "b", "a"], "LFU evicts the least used first (c 1 use, b 2, a 3)"
    lfu.remove("c")
    lfu.insert("c")
    assert lfu.order()[0] == "c", "a re-inserted key starts again at one use"


def test_lru_eviction_order(tiny_llama):
    pool = pool_for(tiny_llama, 2.5, "lru")
    for f in (1, 2):
        pool.get(tiny_llama, ids(f))
    pool.get(tiny_llama, ids(1))
    pool.get(tiny_llama, ids(1))
    pool.get(tiny_llama, ids(2))  # 2 is now the most recently used
    pool.get(tiny_llama, ids(3))
    assert held(pool, tiny_llama, (1, 2, 3)) == [False, True, True], "LRU must evict 1, used least recently"
    assert pool.stats().evictions == 1


def test_lfu_eviction_order(tiny_llama):
    pool = pool_for(tiny_llama, 2.5, "lfu")
    for f in (1, 2):
        pool.get(tiny_llama, ids(f))
    pool.get(tiny_llama, ids(1))
    pool.get(tiny_llama, ids(1))
    pool.get(tiny_llama, ids(2))  # 1: 3 uses, 2: 2 uses (but most recent)
    pool.get(tiny_llama, ids(3))
    assert held(pool, tiny_llama, (1, 2, 3)) == [True, False, True], "LFU must evict 2, used least often"


# --- pins and the budget --------------------------------------------------------------------


def test_pins_survive_pressure(tiny_llama):
    pool = pool_for(tiny_llama, 3.5)
    pool.get(tiny_llama, ids(1), pin=True)
    for f in range(2, 12):
        pool.get(tiny_llama, ids(f))
        assert PrefixKey.of(tiny_llama, ids(1)) in pool, f"the pinned prefix was evicted when prefix {f} came in"
        assert pool.bytes_held <= pool.config.budget_bytes
    assert pool.stats().pinned == 1 and pool.stats().evictions == 8


def test_prefix_larger_than_budget_raises_before_computing(tiny_llama, monkeypatch):
    pool = pool_for(tiny_llama, 2.5)

    def no_build(*a, **k):
        raise AssertionError("the prefix was computed although it cannot fit")

    monkeypatch.setattr(PrefixKV, "build", no_build)
    with pytest.raises(PoolBudgetError, match="raise cache_budget"):
        pool.get(tiny_llama, ids(1, length=20))
    assert pool.stats().entries == 0


def test_pins_leave_no_room_is_a_clear_error(tiny_llama):
    pool = pool_for(tiny_llama, 2.5)
    pool.get(tiny_llama, ids(1), pin=True)
    pool.get(tiny_llama, ids(2), pin=True)
    with pytest.raises(PoolBudgetError, match="pinned prefixes hold"):
        pool.get(tiny_llama, ids(3))
    assert held(pool, tiny_llama, (1, 2)) == [True, True]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    budget_entries=st.floats(min_value=0.5, max_value=6.0),
    policy=st.sampled_from(sorted(POLICIES)),
    storage=st.sampled_from(sorted(STORAGES)),
    ops=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 24), st.booleans()), min_size=1, max_size=14),
)
def test_budget_is_never_exceeded(tiny_llama, budget_entries, policy, storage, ops):
    """Random budgets, sizes and access sequences (with pins): held bytes never pass the budget,
    pinned entries are never evicted, and a get fails exactly when the prefix cannot fit."""
    budget = int(PrefixPool().size_of(tiny_llama, 12) * budget_entries)
    pool = PrefixPool(PoolConfig(budget, policy, storage, min_shared_tokens=4))
    pinned: set[PrefixKey] = set()
    for first, length, pin in ops:
        row = ids(first, length)
        key = PrefixKey.of(tiny_llama, row)
        need = pool.size_of(tiny_llama, length)
        pinned_bytes = sum(pool.size_of(tiny_llama, k.length) for k in pinned)
        fits = key in pool or pinned_bytes + need <= budget
        try:
            lookup = pool.get(tiny_llama, row, pin=pin)
        except PoolBudgetError:
            assert not fits, f"a {need}-byte prefix was refused with {pinned_bytes} pinned of {budget}"
        else:
            assert fits, "a prefix that cannot fit was accepted"
            assert lookup.prefix.token_ids == row
            if pin:
                pinned.add(key)
        stats = pool.stats()
        assert stats.bytes_held <= budget, f"held {stats.bytes_held} > budget {budget}"
        assert stats.bytes_held == sum(pool.size_of(tiny_llama, k.length) for k in pool.keys())
        assert all(k in pool for k in pinned), "a pinned prefix was evicted"


# --- identity and partial reuse -------------------------------------------------------------


def test_identity_is_model_dtype_and_tokens_not_text(tiny_llama, task):
    pool = PrefixPool()
    renamed = task.model_copy(update={"name": "another-name"})
    first = Classifier(tiny_llama, task, pool=pool)
    second = Classifier(tiny_llama, renamed, pool=pool)
    _ = first.prefix, second.prefix
    assert second.last_lookup.source == "memory", "two tasks whose prefixes tokenize the same must share an entry"
    assert pool.stats().entries == 1 and pool.stats().hits == 1
    other_model = tiny_loaded("llama", seed=1)
    assert PrefixKey.of(other_model, (1, 2, 3)) != PrefixKey.of(tiny_llama, (1, 2, 3))


def test_shared_leading_part_is_reused_and_labels_stay_exact(tiny, task):
    pool = PrefixPool()
    Classifier(tiny, task, pool=pool).prefix
    changed = list(task.examples[:2]) + [task.examples[2].model_copy(update={"text": "My invoice shows the wrong address"})]
    variant = task.model_copy(update={"examples": changed})
    classifier = Classifier(tiny, variant, "full", pool=pool)
    records = records_from_texts(TEXTS)
    candidate = classifier.classify_all(records, RunConfig("batched", 4))
    lookup = classifier.last_lookup
    assert lookup.source == "extended" and 0 < lookup.tokens_computed < len(classifier.prompt.prefix_ids)
    assert pool.stats().partial_reuses == 1 and pool.stats().prefill_tokens_saved == lookup.tokens_reused
    reference = classifier.classify_all(records, RunConfig("full", 1))
    agreement = compare(reference, candidate)
    assert agreement.ok and agreement.max_abs_logprob_diff < TOL, f"extended prefix drifts: {agreement}"


def test_extend_does_not_touch_the_stored_prefix(tiny_llama):
    base = PrefixKV.build(tiny_llama.model, ids(1, 8))
    before = base.checksum()
    longer = base.extend(tiny_llama.model, ids(2, 5))
    whole = PrefixKV.build(tiny_llama.model, ids(1, 8) + ids(2, 5))
    assert base.checksum() == before
    for a, b in zip(longer.keys + longer.values, whole.keys + whole.values):
        assert torch.allclose(a, b, atol=1e-5), "extend must equal building the whole prefix"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksum_sees_values_permuted_in_place(dtype):
    """A sum would keep its value when the stored values are only reordered; the checksum must not."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 5, 4, generator=generator).to(dtype)  # [1, kv_heads, P, head_dim]
    values = torch.randn(1, 2, 5, 4, generator=generator).to(dtype)
    prefix = PrefixKV((1, 2, 3, 4, 5), (keys,), (values,))
    before, total = prefix.checksum(), float(keys.double().sum())
    assert prefix.checksum() == before, "the checksum of unchanged tensors must be stable"
    keys.copy_(keys.flip(-2))  # the same values, positions reversed, in place
    assert float(keys.double().sum()) == pytest.approx(total), "the permutation must keep the sum (the point of the test)"
    assert prefix.checksum() != before, "values permuted in place kept the checksum"
    keys.copy_(keys.flip(-2))
    assert prefix.checksum() == before, "restoring the values must restore the checksum"
    values[0, 0, 0, 0], values[0, 1, 0, 0] = values[0, 1, 0, 0].clone(), values[0, 0, 0, 0].clone()
    assert prefix.checksum() != before, "two values swapped between heads kept the checksum"


# --- disk tier ------------------------------------------------------------------------------


def test_disk_round_trip_gives_identical_labels(tiny_llama, task, tmp_path):
    records = records_from_texts(TEXTS)
    first = Classifier(tiny_llama, task, "full", pool=PrefixPool(store=DiskStore(tmp_path)))
    before = first.classify_all(records, RunConfig("batched", 4))
    assert first.last_lookup.source == "computed" and first.pool.stats().disk_writes == 1
    restarted = Classifier(tiny_llama, task, "full", pool=PrefixPool(store=DiskStore(tmp_path)))
    after = restarted.classify_all(records, RunConfig("batched", 4))
    assert restarted.last_lookup.source == "disk", "a restart must load the prefix, not recompute it"
    assert restarted.pool.stats().prefill_tokens_computed == 0
    assert [p.scores.logprobs for p in before] == [p.scores.logprobs for p in after], "disk round trip changed scores"


def _corrupt_data(path):
    raw = bytearray(path.read_bytes())
    for i in range(len(raw) - 64, len(raw) - 8):  # inside the tensor data, past the header
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage, problem",
    [
        (_corrupt_data, "checksum"),
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), "unreadable"),
        (lambda p: p.write_bytes(b"not a safetensors file"), "unreadable"),
    ],
)
def test_corrupt_file_is_detected_and_recomputed(tiny_llama, task, tmp_path, caplog, damage, problem):
    records = records_from_texts(TEXTS)
    first = Classifier(tiny_llama, task, pool=PrefixPool(store=DiskStore(tmp_path)))
    expected = first.classify_all(records, RunConfig("batched", 4))
    (path,) = tmp_path.glob("*.safetensors")
    damage(path)
    again = Classifier(tiny_llama, task, pool=PrefixPool(store=DiskStore(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="prefixcache.cache.pool"):
        recomputed = again.classify_all(records, RunConfig("batched", 4))
    assert again.last_lookup.source == "computed", "a damaged file must never be used"
    assert again.pool.stats().disk_rejected == 1
    assert problem in caplog.text and "recomputing" in caplog.text, caplog.text
    assert [p.scores.logprobs for p in recomputed] == [p.scores.logprobs for p in expected], "recomputing changed scores"
    third = Classifier(tiny_llama, task, pool=PrefixPool(store=DiskStore(tmp_path)))
    _ = third.prefix
    assert third.last_lookup.source == "disk", "the recomputed prefix must replace the damaged file"


def test_mismatched_manifest_is_not_used(tiny_llama, task, tmp_path, caplog, monkeypatch):
    Classifier(tiny_llama, task, pool=PrefixPool(store=DiskStore(tmp_path))).prefix
    monkeypatch.setattr("prefixcache.cache.disk.transformers_version", lambda: "99.0.0")
    again = Classifier(tiny_llama, task, pool=PrefixPool(store=DiskStore(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="prefixcache.cache.pool"):
        _ = again.prefix
    assert again.last_lookup.source == "computed"
    assert "mismatched (transformers" in caplog.text


def test_store_rejects_a_file_as_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheStoreError, match="is a file"):
        DiskStore(tmp_path / "file")
    with pytest.raises(CacheStoreError, match="no such cache folder"):
        DiskStore(tmp_path / "missing", create=False)


# --- int8 storage ---------------------------------------------------------------------------


def test_int8_round_trip_is_close_and_small(tiny_llama):
    prefix = PrefixKV.build(tiny_llama.model, ids(1, 40))
    storage = Int8Storage()
    packed = storage.pack(prefix)
    back = storage.unpack(packed, torch.float32)
    assert packed.nbytes == storage.estimate(KVShape.of(tiny_llama.model.config), 40, 4)
    assert packed.nbytes < 0.35 * prefix.nbytes, f"int8 holds {packed.nbytes} of float32's {prefix.nbytes} bytes"
    for a, b in zip(prefix.keys + prefix.values, back.keys + back.values):
        scale = a.abs().amax()
        assert (a - b).abs().max() <= scale / 127 + 1e-6


def test_int8_storage_agreement_is_reported(tiny, task, record_property, capsys):
    pool = PrefixPool(PoolConfig(storage="int8"))
    classifier = Classifier(tiny, task, "full", pool=pool)
    result = storage_agreement(classifier, records_from_texts(TEXTS), RunConfig("batched", 4))
    record_property("int8_label_agreement", result.rate)
    record_property("int8_bytes_saved_fraction", result.saved_fraction)
    with capsys.disabled():
        print(
            f"\n[int8 storage, {tiny.spec}] labels agree with float storage on {result.agree}/{result.records} "
            f"({100 * result.rate:.1f}%), max |Δ log-prob| {result.max_abs_logprob_diff:.3f}, "
            f"memory {result.stored_bytes} vs {result.float_bytes} bytes ({100 * result.saved_fraction:.0f}% saved)"
        )
    assert result.saved_fraction > 0.65
    assert result.rate >= 0.75, f"int8 storage changed {result.records - result.agree} of {result.records} labels"


# --- sizes and the CLI ----------------------------------------------------------------------


def test_parse_bytes():
    assert parse_bytes("256MB") == 256_000_000
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30)
    assert parse_bytes("4096") == 4096
    for bad in ("", "MB", "12 parsecs", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, "qwen2")


def test_cli_classify_with_cache_dir_then_ls_and_clear(model_dir, tmp_path):
    runner = CliRunner()
    task_file = tmp_path / "task.yaml"
    task_file.write_text(TASK_YAML)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    store = tmp_path / "kv"
    common = ["classify", str(data), "--task", str(task_file), "--model", model_dir, "--dtype", "float32", "--cache-dir", str(store)]
    first = runner.invoke(app, common, catch_exceptions=False)
    second = runner.invoke(app, common + ["--cache-budget", "64MB", "--eviction", "lfu"], catch_exceptions=False)
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    assert "0 loaded from disk" in first.stderr and "1 loaded from disk" in second.stderr, second.stderr
    rows = lambda r: [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]  # noqa: E731
    computed, loaded = rows(first), rows(second)
    assert [r["label"] for r in loaded] == [r["label"] for r in computed], "the stored prefix changed labels"
    for want, got in zip(computed, loaded):
        for label, p in want["scores"].items():
            drift = abs(math.log(got["scores"][label]) - math.log(p))
            assert drift <= 1e-4, f"record {want['id']}: the prefix loaded from disk moved log P({label}) by {drift:.2e}"

    listed = runner.invoke(app, ["cache", "ls", "--cache-dir", str(store), "--json"], catch_exceptions=False)
    assert listed.exit_code == 0
    (entry,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert entry["manifest"]["name"] == "tiny-tickets" and entry["manifest"]["dtype"] == "float32"
    assert set(entry["manifest"]) >= {"model", "dtype", "token_hash", "transformers", "checksum", "storage"}

    cleared = runner.invoke(app, ["cache", "clear", "--cache-dir", str(store)], catch_exceptions=False)
    assert cleared.exit_code == 0 and "removed 1 stored prefixes" in cleared.stderr
    assert not list(store.glob("*.safetensors"))
    missing = runner.invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no such cache folder" in missing.output


def test_cli_budget_too_small_is_a_clean_error(model_dir, tmp_path):
    task_file = tmp_path / "task.yaml"
    task_file.write_text(TASK_YAML)
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"text": "refund"}) + "\n")
    result = CliRunner().invoke(
        app, ["classify", str(data), "--task", str(task_file), "--model", model_dir, "--cache-budget", "1KB"]
    )
    assert result.exit_code == 2 and "--cache-budget" in result.output and "Traceback" not in result.output


def test_cli_verify_int8_reports_agreement_against_float(model_dir, tmp_path):
    """A known outcome: scoring whole labels (``--method full``), every tiny-model margin is above 10 nats
    (checked below), while int8 storage moves log-probs by about 0.1. No label can flip, so verify exits 0."""
    task_file = tmp_path / "task.yaml"
    task_file.write_text(TASK_YAML)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = [str(data), "--task", str(task_file), "--model", model_dir, "--dtype", "float32", "--method", "full"]
    plain = CliRunner().invoke(app, ["classify", *common], catch_exceptions=False)
    assert plain.exit_code == 0, plain.output
    margins = [json.loads(line)["margin"] for line in plain.stdout.splitlines() if line.startswith("{")]
    assert len(margins) == len(TEXTS) and min(margins) > 10, f"the premise: wide margins in float storage, {margins}"
    result = CliRunner().invoke(app, ["verify", *common, "--kv-storage", "int8", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, f"no label can flip, so verify must pass: {result.output}"
    report = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert report["records"] == report["agree"] == len(TEXTS) and report["disagreeing_ids"] == [], report
    drift = report["max_abs_logprob_diff"]
    assert 1e-4 < drift < min(margins) / 2, f"int8 storage is lossy but small: full vs int8-cached drift {drift}"
    assert f"int8 storage vs float storage: labels agree on {len(TEXTS)}/{len(TEXTS)}" in result.stderr, result.stderr
    assert "saved" in result.stderr
