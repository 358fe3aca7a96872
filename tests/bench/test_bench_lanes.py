"""bench: it runs on a tiny model, its JSON has every key, and agreement/ratios are computed correctly.

No timed assertions: only structure and arithmetic.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from prefixcache.bench.lanes import Lane, near_tie_ids, nonembedding_params, run_lanes
from prefixcache.bench.roofline import decode_floor, matmul_peak_gflops, shape_peak, weight_bytes
from prefixcache.cli.app import app
from prefixcache.scheduler.classify import Prediction, Record, RunStats
from prefixcache.engine.scoring import LabelScores
from prefixcache.eval.verify import compare

from tests.support.models import tiny_loaded, save_tiny_model
from tests.bench.json_keys import MODE_KEYS

TOP_KEYS = {"dtype", "threads", "peak_gflops", "prefix_tokens", "mean_suffix_tokens", "modes", "shape_peaks_gflops",
            "shape_peak_gflops", "shape_peak_rows", "shape_peak_projections"}
# one decoder layer of conftest's tiny models (hidden 64, 4 heads of 16, 2 KV heads, MLP 128) on the lean decoder,
# whose q/k/v and gate/up projections are fused: (name, N, K)
TINY_PROJECTIONS = [("self_attn.qkv_proj", 64 + 32 + 32, 64), ("self_attn.o_proj", 64, 64),
                    ("mlp.gate_up_proj", 2 * 128, 64), ("mlp.down_proj", 64, 128)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, "llama")


@pytest.mark.slow
def test_bench_runs_on_tiny_model_and_json_has_every_key(model_dir, tmp_path):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(
        app,
        ["bench", "--items", "8", "--model", model_dir, "--batch-size", "4", "--json", str(out), "--plot", str(plot)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert TOP_KEYS <= set(document), f"missing {TOP_KEYS - set(document)}"
    names = [m["mode"] for m in document["modes"]]
    assert names[:3] == ["full", "cached", "batched"]
    for mode in document["modes"]:
        assert MODE_KEYS <= set(mode), f"{mode['mode']} lacks {MODE_KEYS - set(mode)}"
    first = document["modes"][0]
    assert first["speedup_vs_full"] == pytest.approx(1.0)
    assert first["label_agreement"] == 1.0 and first["max_abs_logprob_diff"] == 0.0
    float32_lanes = {m["mode"]: m for m in document["modes"] if m["dtype"] == "float32"}
    assert set(float32_lanes) == {"full", "cached", "batched"}, "the float32 reference lanes"
    for name in ("cached", "batched"):
        lane = float32_lanes[name]
        assert lane["label_agreement"] == 1.0, f"float32 {name} must give full re-encoding's labels: {lane}"
        assert lane["max_abs_logprob_diff"] <= 1e-4, f"float32 {name} log-probs drift from full re-encoding: {lane}"
        assert lane["disagreements_outside_ties"] == 0, f"float32 {name} flips a label that is not a near tie: {lane}"
    for lane in document["modes"]:
        assert lane["disagreements_outside_ties"] == 0, f"{lane['mode']} ({lane['dtype']}) flips a label that is not a near tie"
    assert document["peak_gflops"] > 0
    assert document["mean_suffix_tokens"] > 0
    assert document["shape_peak_gflops"] > 0 and document["shape_peaks_gflops"]["float32"] > 0
    rows = round(4 * document["mean_suffix_tokens"])  # --batch-size 4 x mean suffix tokens: one batched pass
    assert document["shape_peak_rows"] == rows
    timed = [(p["name"], p["m"], p["n"], p["k"]) for p in document["shape_peak_projections"]["float32"]]
    assert timed == [(name, rows, n, k) for name, n, k in TINY_PROJECTIONS]
    for lane in float32_lanes.values():
        assert lane["pct_of_shape_peak"] > 0 and lane["pct_of_peak"] > 0
    assert "%shape" in result.output and "%peak" in result.output
    assert plot.stat().st_size > 10_000, "the plot should be a real PNG"
    assert "llama.cpp" in result.output  # either a lane or its one-line skip message


def _pred(i, logprobs):
    return Prediction(i, LabelScores(("a", "b"), logprobs))


def test_agreement_counts_disagreements_and_max_drift():
    reference = [_pred(0, (-0.1, -2.0)), _pred(1, (-2.0, -0.1)), _pred(2, (-0.5, -0.9))]
    candidate = [_pred(0, (-0.1, -2.0)), _pred(1, (-0.1, -2.0)), _pred(2, (-0.5, -0.95))]
    agreement = compare(reference, candidate)
    assert agreement.records == 3 and agreement.agree == 2
    assert agreement.disagreeing_ids == [1]
    assert agreement.max_abs_logprob_diff == pytest.approx(1.9)
    assert agreement.rate == pytest.approx(2 / 3)


def test_run_lanes_ratios_and_near_ties():
    records = [Record(i, {"text": "x"}) for i in range(4)]

    def lane(name, logprobs, tokens):
        def run(recs):
            stats = RunStats(tokens_computed=tokens)
            return [_pred(r.id, logprobs) for r in recs], stats

        return Lane(name, "float32", 1, run, gflop_per_token=1.0)

    report = run_lanes([lane("full", (-0.1, -2.0), 100), lane("tie", (-0.6931, -0.6932), 10)], records, {"float32": 1e9})
    full, tie = report.results
    assert full.speedup_vs_full == pytest.approx(1.0)
    assert tie.label_agreement == 1.0 and full.near_ties == 0
    # drift 1.3 >= half the reference margin 1.9: every record is within noise
    assert tie.near_ties == 4 and tie.disagreements_outside_ties == 0
    assert tie.gflop == pytest.approx(10.0) and full.gflop == pytest.approx(100.0)
    assert tie.pct_of_peak is not None and tie.pct_of_peak > 0
    assert tie.pct_of_shape_peak is None, "no shape peak given"
    shaped = run_lanes([lane("full", (-0.1, -2.0), 100)], records, {"float32": 1e9}, shape_peaks={"float32": 5e8})
    assert shaped.shape_peaks == {"float32": 5e8}
    assert shaped.results[0].pct_of_shape_peak == pytest.approx(2 * shaped.results[0].pct_of_peak)


def test_near_ties_scale_with_the_lanes_measured_drift():
    records = [Record(i, {"text": "x"}) for i in range(3)]
    margins = {0: 0.01, 1: 0.3, 2: 5.0}  # reference log-prob gaps

    def lane(name, shift):
        def run(recs):
            return [_pred(r.id, (0.0, -margins[r.id])) if shift is None else _pred(r.id, shift(r.id)) for r in recs], RunStats()

        return Lane(name, "bfloat16", 1, run)

    # the candidate drifts by 0.02 everywhere and flips record 0 (margin 0.01 <= 2 * 0.02): a near tie
    flips = lambda i: (-0.015, 0.0) if i == 0 else (-0.02, -margins[i])
    quiet, = run_lanes([lane("full", None), lane("quiet", flips)], records).results[1:]
    assert quiet.max_abs_logprob_diff == pytest.approx(0.02)
    assert quiet.label_agreement == pytest.approx(2 / 3)
    assert quiet.near_ties == 1 and quiet.disagreements_outside_ties == 0
    # a lane that flips record 2 (margin 5.0) with drift 5.5: now every record is within its noise
    wild = lambda i: (-5.5, 0.0) if i == 2 else (0.0, -margins[i])
    bad, = run_lanes([lane("full", None), lane("wild", wild)], records).results[1:]
    assert bad.near_ties == 3 and bad.disagreements_outside_ties == 0
    assert near_tie_ids([_pred(0, (0.0, -0.5))], 0.0) == set()


def test_nonembedding_params_excludes_tied_embedding():
    model = tiny_loaded("qwen2").model
    total = sum(p.numel() for p in model.parameters())
    assert nonembedding_params(model) == total - model.get_input_embeddings().weight.numel()


def test_matmul_peak_is_positive():
    assert matmul_peak_gflops(torch.float32, sizes=(128,), seconds=0.05) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shape_peak_times_the_layers_own_projections(arch):
    model = tiny_loaded(arch).model
    layer = model.model.layers[0]
    linears = [(name, *m.weight.shape) for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    assert [(name, n, k) for name, n, k in linears] == TINY_PROJECTIONS
    peak = shape_peak(model, rows=37, dtype=torch.float32, seconds=0.05)
    assert [(p.name, p.m, p.n, p.k) for p in peak.projections] == [(name, 37, n, k) for name, n, k in linears]
    assert peak.rows == 37 and peak.dtype == "float32"
    assert all(p.seconds > 0 for p in peak.projections) and peak.gflops > 0
    total_flops = sum(2 * 37 * n * k for _, n, k in linears)
    assert peak.gflops == pytest.approx(total_flops / sum(p.seconds for p in peak.projections) / 1e9)
    with pytest.raises(ValueError):
        shape_peak(model, rows=0, dtype=torch.float32)


def test_weight_bytes_counts_a_tied_tensor_once_and_the_floor_divides_by_it():
    model = tiny_loaded("qwen2", dtype=torch.bfloat16).model
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    every = sum(p.numel() * p.element_size() for _, p in model.named_parameters(remove_duplicate=False))
    embedding = model.get_input_embeddings().weight
    assert weight_bytes(model) == every - embedding.numel() * 2 == sum(p.numel() * 2 for p in model.parameters())
    floor = decode_floor(model)
    assert floor.weight_bytes == weight_bytes(model) and floor.memory_read_gb_s > 0
    assert floor.tokens_per_s == pytest.approx(floor.memory_read_gb_s * 1e9 / floor.weight_bytes)
    assert floor.pct(floor.tokens_per_s / 2) == pytest.approx(50.0)
