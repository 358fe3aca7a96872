"""How far a lane is from what the machine can do: matmul peaks (square, and at the model's own shapes) and
the decoding floor (memory read bandwidth over weight bytes).

* :func:`matmul_peak_gflops`: the best sustained GFLOP/s of large square matmuls, the usual roofline peak.
* :func:`shape_peak`: GFLOP/s of ``torch.nn.functional.linear`` at the shapes one decoder layer runs in a
  batched pass (M rows of one pass x each projection's ``[N, K]`` weight). Small K and N reach less of the
  square peak, so this is the peak a lane could reach with nothing but its own matmuls.
* :func:`decode_floor`: a greedy decoding step at batch size 1 reads every weight once, so no B=1 decoder can
  generate more than ``memory read bandwidth / weight bytes`` tokens per second.

Every timing runs at the current thread count on the given device; GPU work is asynchronous, so each timing
ends with a synchronize. Nothing here asserts a speed: the figures are measured, best of a few tries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

MEMORY_PROBE_BYTES = 512 * 2**20  # the bandwidth probe's tensor: far larger than any CPU's last-level cache


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for queued work on ``device`` (a no-op on a CPU)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def matmul_peak_gflops(
    dtype: torch.dtype, device: torch.device | str = "cpu", seconds: float = 0.6, sizes: Sequence[int] | None = None
) -> float:
    """Best sustained GFLOP/s of square matmuls at ``dtype`` on ``device`` (CPU: the current thread count).

    Default sizes are 1024 and 2048 on a CPU, 4096 and 8192 on a GPU (smaller ones leave a GPU idle).
    """
    device = torch.device(device)
    sync = synchronizer(device)
    best = 0.0
    for n in sizes or ((4096, 8192) if device.type == "cuda" else (1024, 2048)):
        a = torch.randn(n, n, device=device).to(dtype)  # [n, n]
        b = torch.randn(n, n, device=device).to(dtype)  # [n, n]
        a @ b  # warm-up
        sync()
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            a @ b
            count += 1
            sync()
        best = max(best, 2 * n**3 * count / (time.perf_counter() - started) / 1e9)
    return best


@dataclass(frozen=True)
class ProjectionTiming:
    """One projection timed alone: ``linear(x [M, K], W [N, K]) -> [M, N]``; ``seconds``: the best time of one call."""

    name: str  # the module's path inside the decoder layer, e.g. "self_attn.q_proj"
    m: int
    n: int
    k: int
    seconds: float

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def to_json(self) -> dict:
        return {"name": self.name, "m": self.m, "n": self.n, "k": self.k,
                "gflops": self.flops / self.seconds / 1e9 if self.seconds else 0.0}


@dataclass(frozen=True)
class ShapePeak:
    """The layer's projections at one dtype; ``gflops`` is FLOP-weighted: total FLOPs / total best time."""

    dtype: str
    rows: int  # M: the rows of one batched pass
    projections: tuple[ProjectionTiming, ...]

    @property
    def gflops(self) -> float:
        seconds = sum(p.seconds for p in self.projections)
        return sum(p.flops for p in self.projections) / seconds / 1e9 if seconds else 0.0


def decoder_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The model's first decoder layer: element 0 of the first ``ModuleList`` holding one module per hidden layer.

    Raises:
        ValueError: the model has no such list.
    """
    config = model.config.get_text_config(decoder=True)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == config.num_hidden_layers:
            return module[0]
    raise ValueError(f"no list of {config.num_hidden_layers} decoder layers in {type(model).__name__}")


def layer_projections(model: torch.nn.Module) -> list[tuple[str, int, int]]:
    """``(name, N, K)`` of every ``nn.Linear`` in one decoder layer, in module order (N = out, K = in features)."""
    layer = decoder_layer(model)
    return [(name, m.out_features, m.in_features) for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]


def time_linear(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seconds: float, rounds: int = 3
) -> float:
    """Best per-call time of ``linear(x [m, k], W [n, k])`` over ``rounds`` windows of ``seconds / rounds`` each
    (at least one call per window), after a warm-up call."""
    sync = synchronizer(device)
    x = torch.randn(m, k, device=device).to(dtype)  # [M, K]
    weight = torch.randn(n, k, device=device).to(dtype)  # [N, K]
    torch.nn.functional.linear(x, weight)  # warm-up; [M, N]
    sync()
    best = float("inf")
    for _ in range(rounds):
        count, started = 0, time.perf_counter()
        while count == 0 or time.perf_counter() - started < seconds / rounds:
            torch.nn.functional.linear(x, weight)  # [M, N]
            count += 1
            sync()
        best = min(best, (time.perf_counter() - started) / count)
    return best


def shape_peak(
    model: torch.nn.Module, rows: int, dtype: torch.dtype, device: torch.device | str = "cpu", seconds: float = 0.6
) -> ShapePeak:
    """Time each projection of one decoder layer of ``model`` at ``rows`` (M) rows and ``dtype`` on ``device``.

    Weights and inputs are random tensors of the projections' shapes (the model's own weights are not touched,
    so this works at any dtype); biases are left out. ``seconds`` is the budget shared by the projections.

    Raises:
        ValueError: ``rows`` < 1, or the model has no decoder layers (:func:`decoder_layer`).
    """
    if rows < 1:
        raise ValueError(f"rows must be at least 1, not {rows}")
    device = torch.device(device)
    shapes = layer_projections(model)
    budget = seconds / max(len(shapes), 1)
    timings = tuple(
        ProjectionTiming(name, rows, n, k, time_linear(rows, n, k, dtype, device, budget)) for name, n, k in shapes
    )
    return ShapePeak(str(dtype).removeprefix("torch."), rows, timings)


def memory_read_gb_s(
    device: torch.device | str = "cpu", nbytes: int = MEMORY_PROBE_BYTES, repeats: int = 5
) -> float:
    """Memory read bandwidth in GB/s (1e9 bytes): ``nbytes`` / the best time of ``t.sum()`` over a float32
    tensor of ``nbytes``, best of ``repeats`` after a warm-up (CPU: the current thread count)."""
    device = torch.device(device)
    sync = synchronizer(device)
    probe = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # [nbytes / 4]; ones: every page touched
    probe.sum()
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        probe.sum()
        sync()
        best = min(best, time.perf_counter() - started)
    return probe.numel() * probe.element_size() / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each stored tensor once (a tied embedding and head count once)."""
    seen, total = set(), 0
    for p in model.parameters():  # already one entry per Parameter object
        key = (p.data_ptr(), p.numel())  # and one per stored tensor, should two Parameters share one
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


@dataclass(frozen=True)
class DecodeFloor:
    """The B=1 decoding floor: ``tokens_per_s`` = memory read bandwidth / weight bytes.

    An upper bound on a batch-size-1 greedy decoder's tokens/s (each step reads every weight once); the
    input embedding counts whole though a step gathers one row of it, which only matters when it is untied.
    """

    memory_read_gb_s: float
    weight_bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.memory_read_gb_s * 1e9 / self.weight_bytes if self.weight_bytes else 0.0

    def pct(self, tokens_per_s: float) -> float | None:
        """``tokens_per_s`` as a percentage of the floor (None without a floor)."""
        return 100 * tokens_per_s / self.tokens_per_s if self.tokens_per_s else None

    def to_json(self) -> dict:
        return {"memory_read_gb_s": self.memory_read_gb_s, "weight_bytes": self.weight_bytes,
                "decode_floor_tokens_per_s": self.tokens_per_s}


def decode_floor(model: torch.nn.Module, device: torch.device | str = "cpu") -> DecodeFloor:
    """Measure the memory read bandwidth on ``device`` now and count ``model``'s weight bytes."""
    return DecodeFloor(memory_read_gb_s(device), weight_bytes(model))
