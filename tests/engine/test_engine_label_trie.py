"""The label trie (issue 16): whole-label scoring whose work follows the trie, not labels x records.

* the trie's bookkeeping: fed nodes, edges and paths of a label set with shared leading tokens and a
  label that is a prefix of another; parts closed under ancestry that compute every edge once;
* the property: on random tiny Llama/Qwen2 models, random label sets (shared prefixes, one label a
  prefix of another, single-token and long labels), random rows, prefixes and budgets, the trie pass
  gives the per-label reference's log-probs (float32: within 1e-5 plus float32 rounding of the
  magnitude);
* memory stays bounded: every forward pass holds at most the token budget and every normalizer
  chunk at most its rows, however many labels and rows, and the answer does not change.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefixcache.cache.kv import PrefixKV
from prefixcache.engine import label_pass, scoring
from prefixcache.engine.label_trie import LabelTrie
from prefixcache.engine.per_label import score_per_label
from prefixcache.engine.rows import empty_prefix
from prefixcache.engine.scoring import LabelScorer
from prefixcache.model.load import build_random_model
from prefixcache.task.prompt import build_prompt
from prefixcache.task.definition import parse_task

from tests.support.models import make_tokenizer, tiny_config
from tests.support.tasks import TASK_YAML

ATOL, RTOL = 1e-5, 1e-6  # float32 sums of log-probs of magnitude ~30 round at a few 1e-6
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# a, ab, abc, abd share leading tokens; x is single-token; 7 8 9 10 11 is long and shares nothing
LABELS = {"a": (1,), "ab": (1, 2), "abc": (1, 2, 3), "abd": (1, 2, 4), "x": (5,), "long": (7, 8, 9, 10, 11)}


def test_trie_feeds_each_inner_node_once_and_sums_each_labels_path():
    trie = LabelTrie.build(list(LABELS.values()))
    whole = trie.whole
    # fed: the inner nodes (1), (1 2), (7), (7 8), (7 8 9), (7 8 9 10); leaves are never fed
    assert whole.tokens == (1, 2, 7, 8, 9, 10)
    assert whole.depths == (1, 2, 1, 2, 3, 4)
    assert whole.parents == (-1, 0, -1, 2, 3, 4)
    edges = list(zip(whole.edge_sources, whole.edge_tokens))
    assert len(edges) == len(set(edges)) == 10  # every trie node but the root has one incoming edge
    for label, ids in LABELS.items():  # a path walks the label's tokens from the root
        path = trie.paths[list(LABELS).index(label)]
        assert [whole.edge_tokens[e] for e in path] == list(ids)
        assert whole.edge_sources[path[0]] == 0
    sees = whole.sees()
    assert sees[1].tolist() == [True, True, False, False, False, False]  # (1 2) sees (1) and itself only
    assert sees[5].tolist() == [False, False, True, True, True, True]
    assert whole.sees("meta").device.type == "meta"  # built on the CPU, handed over on the device asked for
    sums = trie.label_sums(torch.arange(10, dtype=torch.float32)[None])  # edge e has log-prob e
    assert sums[0].tolist() == [sum(trie.paths[i]) for i in range(len(LABELS))]


@pytest.mark.parametrize("max_fed", [4, 5, 6])
def test_parts_are_closed_under_ancestry_and_compute_every_edge_once(max_fed):
    trie = LabelTrie.build([*LABELS.values(), (12, 13, 14), (12, 15)])
    parts = trie.parts(max_fed)
    assert len(parts) > 1
    owned = [e for part in parts for e in part.edge_ids]
    assert sorted(owned) == list(range(trie.edges))
    for part in parts:
        assert len(part) <= max_fed
        for k, parent in enumerate(part.parents):
            assert parent < k and (parent == -1) == (part.depths[k] == 1)
            if parent >= 0:
                assert part.depths[parent] == part.depths[k] - 1
        for e, source in zip(part.edge_ids, part.edge_sources):
            assert trie.whole.edge_tokens[e] == part.edge_tokens[part.edge_ids.index(e)]
            assert source == 0 or part.tokens[source - 1] == trie.whole.tokens[trie.whole.edge_sources[e] - 1]
    with pytest.raises(ValueError, match="label path"):
        trie.parts(3)  # the long label's path needs 4 fed nodes


@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    fed=st.integers(0, 20),
    budget=st.integers(1, 200),
)
@example(lengths=[3, 3], fed=1, budget=8)  # an exact fit, in the first group
@example(lengths=[5, 3, 3], fed=1, budget=8)  # an exact fit, in a later group
def test_rows_are_grouped_greedily_in_order_within_the_token_budget(lengths, fed, budget):
    """Each group is consecutive rows whose tokens plus ``fed`` nodes each fit the budget (a lone row
    always runs), and a group ends only where the next row would not fit: as few passes as in-order allows."""
    groups = label_pass._groups(lengths, fed, budget)
    assert [i for group in groups for i in group] == list(range(len(lengths)))
    sizes = [sum(lengths[i] + fed for i in group) for group in groups]
    for group, size in zip(groups, sizes):
        assert group and (size <= budget or len(group) == 1)
    for size, following in zip(sizes, groups[1:]):
        assert size + lengths[following[0]] + fed > budget


def test_parts_are_filled_in_depth_first_order_and_start_a_new_part_only_when_full():
    """Fed nodes 1, 1-2, 1-5 at two per part: the first part takes 1 and 1-2; 1-5 would make three, so it
    starts a second part that repeats its ancestor 1. The root's edges are in the first part only."""
    trie = LabelTrie.build([(1, 2, 3), (1, 2, 4), (1, 5, 6), (1, 5, 7)])
    first, second = trie.parts(2)
    assert (first.tokens, first.parents, second.tokens, second.parents) == ((1, 2), (-1, 0), (1, 5), (-1, 0))
    assert first.edge_tokens == (1, 2, 5, 3, 4) and first.edge_sources == (0, 1, 1, 2, 2)
    assert second.edge_tokens == (6, 7) and second.edge_sources == (2, 2)
    assert trie.parts(3) == [trie.whole]


def test_a_part_too_small_for_the_longest_path_is_refused_naming_both_sizes():
    trie = LabelTrie.build([(1, 2, 3, 4), (5, 6)])
    with pytest.raises(ValueError) as refused:
        trie.parts(2)
    assert str(refused.value) == "a part of 2 fed nodes cannot hold a label path of 3"


def test_a_label_with_no_tokens_is_refused():
    with pytest.raises(ValueError) as refused:
        LabelTrie.build([(1,), (), (2,)])
    assert str(refused.value) == "every label needs at least one token; label 1 (0-based) has none"


@functools.lru_cache(maxsize=1)
def _prompt():
    return build_prompt(parse_task(TASK_YAML, "tiny.yaml"), make_tokenizer())


@functools.lru_cache(maxsize=8)
def _model(arch: str, layers: int, kv_heads: int, seed: int) -> torch.nn.Module:
    base = tiny_config(arch, len(make_tokenizer()))
    config = base.to_dict() | dict(num_hidden_layers=layers, num_key_value_heads=kv_heads)
    config.pop("layer_types", None)
    return build_random_model(type(base).from_dict(config), seed=seed)


def _head(model, label_ids: dict, label_pass: str = "trie") -> LabelScorer:
    return LabelScorer(model, dataclasses.replace(_prompt(), label_ids=label_ids), "full", label_pass)


@st.composite
def label_sets(draw) -> dict:
    """1-9 distinct labels over a 4-token alphabet, so leading tokens are shared often and one label
    is often a prefix of another; lengths 1-6."""
    alphabet = draw(st.lists(st.integers(3, 390), min_size=4, max_size=4, unique=True))
    sequences = draw(st.lists(st.lists(st.sampled_from(alphabet), min_size=1, max_size=6).map(tuple), min_size=1, max_size=9, unique=True))
    return {f"label{i}": ids for i, ids in enumerate(sequences)}


@SETTINGS
@given(
    arch=st.sampled_from(["llama", "qwen2"]),
    layers=st.integers(1, 2),
    kv_heads=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
    labels=label_sets(),
    prefix=st.lists(st.integers(0, 390), max_size=12),
    rows=st.lists(st.lists(st.integers(0, 390), min_size=1, max_size=10), min_size=1, max_size=5),
    token_budget=st.sampled_from([1, 7, 16, 4096]),
)
def test_trie_pass_equals_the_per_label_reference(arch, layers, kv_heads, seed, labels, prefix, rows, token_budget):
    model = _model(arch, layers, kv_heads, seed)
    stored = PrefixKV.build(model, prefix) if prefix else empty_prefix(model)
    reference = score_per_label(model, stored, rows, _head(model, labels, "per-label"))  # [B, L]
    got = label_pass.score_whole_labels(model, stored, rows, _head(model, labels), token_budget=token_budget)
    torch.testing.assert_close(got, reference, atol=ATOL, rtol=RTOL)


def test_many_labels_and_rows_stay_within_the_token_budget_and_the_normalizer_chunk(monkeypatch):
    """200 labels x 12 rows: every forward pass holds at most the token budget, every full-vocabulary
    logits tensor at most the normalizer's rows, and the answer equals the unsplit pass's."""
    model = _model("qwen2", 2, 2, 0)
    generator = torch.Generator().manual_seed(0)
    sequences = {tuple(int(t) for t in torch.randint(3, 60, (int(n),), generator=generator)) for n in torch.randint(1, 7, (260,), generator=generator)}
    labels = {f"label{i}": ids for i, ids in enumerate(sorted(sequences)[:200])}
    rows = [[int(t) for t in torch.randint(0, 390, (int(n),), generator=generator)] for n in torch.randint(1, 12, (12,), generator=generator)]
    stored = PrefixKV.build(model, list(range(10, 30)))
    unsplit = label_pass.score_whole_labels(model, stored, rows, _head(model, labels), token_budget=10**6)

    seen_tokens, seen_rows = [], []  # real tokens per forward pass: the rows' (a 2-D mask), then the fed nodes'
    forward = model.model.forward

    def counted(*a, **k):
        ids, mask = k["input_ids"], k["attention_mask"]
        seen_tokens.append(int(mask[:, -ids.shape[1] :].sum()) if mask.dim() == 2 else ids.numel())
        return forward(*a, **k)

    monkeypatch.setattr(model.model, "forward", counted)
    vocab = LabelScorer.vocab_logprobs
    monkeypatch.setattr(LabelScorer, "vocab_logprobs", lambda self, h: seen_rows.append(h.shape[:-1].numel()) or vocab(self, h))
    monkeypatch.setattr(scoring, "LOGIT_BYTES", 4 * len(make_tokenizer()) * 48)  # 48 rows of logits at a time
    head = _head(model, labels)
    assert head.normalizer_rows == 48 and len(head.trie.whole) > 48
    split = label_pass.score_whole_labels(model, stored, rows, head, token_budget=64)

    assert len(seen_tokens) > 2 * len(head.trie.parts(47)) > 2
    per_group = [rows_pass + fed_pass for rows_pass, fed_pass in zip(seen_tokens[::2], seen_tokens[1::2])]
    assert max(per_group) <= 64
    assert max(seen_rows) <= 48
    torch.testing.assert_close(split, unsplit, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("rows_at_once", [2, 1])
def test_edge_logprobs_hold_whole_rows_of_logits_up_to_the_normalizer_and_at_least_one(monkeypatch, rows_at_once):
    """hidden ``[7, 1 + N, H]`` with N = 6 fed nodes: at a normalizer of 2 rows' positions (14) the
    logits come 2 rows at a time; at a normalizer smaller than one row's positions, one row at a time.
    Either way the edges' log-probs equal the unchunked ones (to float32 rounding)."""
    model = _model("llama", 1, 2, 0)
    head = _head(model, LABELS)
    part = head.trie.whole
    hidden = torch.randn(7, 1 + len(part), model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert len(part) == 6 and hidden.shape[-1] != 1 + len(part)
    whole = head.edge_logprobs(hidden, part)  # the default normalizer holds every row at once

    chunks = []
    vocab = LabelScorer.vocab_logprobs
    monkeypatch.setattr(LabelScorer, "vocab_logprobs", lambda self, h: chunks.append(h.shape[0]) or vocab(self, h))
    positions = 2 * (1 + len(part)) if rows_at_once == 2 else 1
    monkeypatch.setattr(scoring, "LOGIT_BYTES", 4 * head._weight.shape[0] * positions)
    assert head.normalizer_rows == positions
    torch.testing.assert_close(head.edge_logprobs(hidden, part), whole, atol=ATOL, rtol=RTOL)  # matmul blocking may differ by chunk
    assert chunks == [2, 2, 2, 1] if rows_at_once == 2 else chunks == [1] * 7


def test_each_part_is_as_large_as_the_budget_allows_and_never_smaller_than_a_path(monkeypatch):
    """A pass holds one row token and the fed nodes, so a part takes ``min(token budget, normalizer rows) - 1``
    nodes, but never fewer than the deepest label's path (``max_depth - 1`` fed nodes). Too small a part costs
    passes, too large one memory: the answers are the same either way, so only the parts fed can tell."""
    model = _model("llama", 1, 2, 0)
    head = _head(model, LABELS)
    whole, path = len(head.trie.whole), head.trie.max_depth - 1  # 6 fed nodes; the longest path feeds 4
    stored = PrefixKV.build(model, list(range(10, 20)))
    fed: list[int] = []
    real = label_pass._part_hidden
    monkeypatch.setattr(label_pass, "_part_hidden", lambda m, p, rows, part: fed.append(len(part)) or real(m, p, rows, part))
    for budget, max_fed in [(1, path), (path + 1, path), (whole, whole - 1), (whole + 1, whole)]:
        fed.clear()
        label_pass.score_whole_labels(model, stored, [[5, 6, 7]], head, token_budget=budget)
        assert fed == [len(part) for part in head.trie.parts(max_fed)], (budget, fed)
    assert fed == [whole]
