"""The cost of one greedy decode step, alone: rows continue a stored prefix, one token per row per step, as the
engine loop runs them (:func:`~prefixcache.engine.slot_pass.forward_slots` over a slot store, the output head,
an argmax), without stop strings, detokenizing or a grammar, so decoders and dtypes compare on the step alone.

* :func:`time_decode`: ms per step and tokens/s at a batch size, after a prefill and a warm-up step;
* :func:`profile_step`: one step under ``torch.profiler``, split into the weight matmuls (``aten::mm``,
  ``aten::addmm``, ``aten::_weight_int8pack_mm`` ...) and everything else.

This module knows nothing about tasks or files; ``studies/lean_decode_bench.py`` drives it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..cache.kv import KVShape, PrefixKV
from ..cache.slots import Feed, SlotStore
from ..engine.slot_pass import forward_slots

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu")


@dataclass(frozen=True)
class DecodeTiming:
    """``steps`` greedy decode steps of ``batch`` rows: ``ms_per_step`` and ``tokens_per_s`` (all rows), from wall
    time; ``cpu_seconds`` is the process's CPU time over the same steps (on a shared machine, with one thread,
    the steadier figure: time spent waiting for a core is not in it)."""

    batch: int
    steps: int
    seconds: float
    cpu_seconds: float = 0.0

    @property
    def cpu_ms_per_step(self) -> float:
        return 1000 * self.cpu_seconds / self.steps

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / self.steps

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.steps / self.seconds


class _Decoder:
    """Greedy decoding state of ``rows`` after ``prefix``: each row's slot in a store and its own tokens so far."""

    def __init__(self, model: torch.nn.Module, prefix: PrefixKV, rows: list[list[int]], spare_tokens: int = 256):
        self.model, self.prefix = model, prefix
        param = next(model.parameters())
        longest = max(len(r) for r in rows) + spare_tokens
        self.store = SlotStore(KVShape.of(model.config), len(rows), longest, param.dtype, param.device)
        self.slots = [self.store.take() for _ in rows]
        self.written = [0] * len(rows)
        self.tokens: list[torch.Tensor] = []
        self._feed([list(r) for r in rows])

    def _feed(self, rows: list[list[int]]) -> None:
        feeds = [Feed(slot, start, tuple(ids)) for slot, start, ids in zip(self.slots, self.written, rows)]
        hidden = forward_slots(self.model, self.prefix, self.store, feeds)  # [B, H]
        self.written = [start + len(ids) for start, ids in zip(self.written, rows)]
        self.next_ids = self.model.get_output_embeddings()(hidden).argmax(-1)  # [B]
        self.tokens.append(self.next_ids)

    def step(self) -> None:
        self._feed([[t] for t in self.next_ids.tolist()])

    def generated(self) -> list[list[int]]:
        """Every row's greedy tokens so far."""
        return torch.stack(self.tokens, dim=1).tolist()  # [B, steps + 1]


@torch.inference_mode()
def time_decode(
    model: torch.nn.Module, prefix: PrefixKV, rows: list[list[int]], steps: int
) -> tuple[DecodeTiming, list[list[int]]]:
    """Prefill ``rows`` after ``prefix``, run one warm-up step, then time ``steps`` greedy steps.

    Returns the timing and every row's greedy tokens (for agreement between decoders and dtypes).
    """
    decoder = _Decoder(model, prefix, rows)
    decoder.step()  # warm-up
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(steps):
        decoder.step()
    timing = DecodeTiming(len(rows), steps, time.perf_counter() - started, time.process_time() - cpu_started)
    return timing, decoder.generated()


@dataclass(frozen=True)
class StepProfile:
    """One profiled decode step: ``total_ms`` (wall), ``matmul_ms`` (self time of the weight matmuls) and the
    profiler's top operators by self time (``table``, as ``torch.profiler`` prints it)."""

    total_ms: float
    matmul_ms: float
    table: str

    @property
    def outside_share(self) -> float:
        """The share of the step spent outside the weight matmuls."""
        return 1 - self.matmul_ms / self.total_ms if self.total_ms else 0.0


@torch.inference_mode()
def profile_step(
    model: torch.nn.Module, prefix: PrefixKV, row: list[int], steps: int = 5, top: int = 12
) -> StepProfile:
    """Profile ``steps`` B=1 decode steps after a prefill and a warm-up; figures are per step."""
    from torch.profiler import ProfilerActivity, profile

    decoder = _Decoder(model, prefix, [row])
    decoder.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            decoder.step()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    matmul_us = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    table = events.table(sort_by="self_cpu_time_total", row_limit=top)
    return StepProfile(1000 * wall / steps, matmul_us / 1000 / steps, table)
