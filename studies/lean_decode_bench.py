# Study behind docs/benchmarks.md, "Lean decoder" (its decode-step tables).
"""Lean decoder vs transformers: greedy decode steps on the embedded model after the ticket-fields prefix.

For each dtype, both decoders side by side in one run: B=1 and B=8 tokens/s and ms per step, the share of the
B=1 weight-read floor (memory bandwidth measured in the same run / weight bytes), greedy agreement with the
transformers decoder, and a torch.profiler split of one B=1 step: the weight matmuls' time, and the share of the
unprofiled step outside them.
Optional levers: ``--int8`` (weight-only int8, per-channel scales, ``torch._weight_int8pack_mm``) and
``--compile`` (``torch.compile`` of the lean decoder stack).

    PYTHONPATH=src python studies/lean_decode_bench.py --steps 32 --int8 > lean.md
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch

from prefixcache.bench.decode_step import profile_step, time_decode
from prefixcache.bench.roofline import decode_floor
from prefixcache.bench.workload import ticket_records
from prefixcache.cache.kv import PrefixKV
from prefixcache.model.load import load_model
from prefixcache.task.definition import load_any_task
from prefixcache.task.extract_prompt import build_extract_prompt


class Int8Linear(torch.nn.Module):
    """A weight-only int8 linear layer: per-output-channel symmetric scales, activations kept in their dtype."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [N, K]
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127  # [N]
        self.register_buffer("weight_int8", torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, K]
        out = torch._weight_int8pack_mm(flat, self.weight_int8, self.scales)  # [M, N]
        out = out.view(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias


class Int4Linear(torch.nn.Module):
    """A weight-only int4 linear layer: groups of 32 input columns with a min/max scale and offset (the Q4_1
    scheme, so a checkpoint dequantized from Q4_1 weights is recovered exactly), ``_weight_int4pack_mm_for_cpu``."""

    GROUP = 32

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [N, K]
        groups = weight.view(weight.shape[0], -1, self.GROUP)  # [N, K/G, G]
        low, high = groups.amin(-1), groups.amax(-1)  # [N, K/G]
        step = ((high - low) / 15).clamp(min=1e-10)
        q = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).view_as(weight)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # w = (q - 8) * scale + zero, so zero = low + 8 * step: [K/G, N, 2]
        self.register_buffer("scales_zeros", torch.stack([step.T, (low + 8 * step).T], -1).to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, K]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.GROUP, self.scales_zeros)
        out = out.view(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias


def to_int4(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every linear layer of the decoder stack (not the output head) for :class:`Int4Linear`, in place."""
    for layer in model.base_model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Int4Linear(child))
    return model


def to_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every linear layer of the decoder stack (not the output head) for :class:`Int8Linear`, in place."""
    for layer in model.base_model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Int8Linear(child))
    return model


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a step reads: parameters and buffers (an int8 layer keeps its weights in buffers),
    each stored tensor once."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if (t.data_ptr(), t.numel()) not in seen:
            seen.add((t.data_ptr(), t.numel()))
            total += t.numel() * t.element_size()
    return total


def rows_and_prefix(tokenizer, items: int):
    task = load_any_task("ticket-fields")
    prompt = build_extract_prompt(task, tokenizer)
    rows = [tokenizer(f"Ticket: {r.fields['text']}\n", add_special_tokens=False)["input_ids"] for r in ticket_records(items)]
    return list(prompt.prefix_ids), rows


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of rows whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def lanes(args, dtype: str) -> list[tuple[str, torch.nn.Module, object]]:
    """Every lane of ``dtype`` as (name, model, tokenizer): transformers first (the reference)."""
    out = []
    for decoder in ("transformers", "lean"):
        loaded = load_model("smollm2-135m", dtype, args.threads, decoder=decoder)
        out.append((decoder, loaded.model, loaded.tokenizer))
    if args.int8:
        loaded = load_model("smollm2-135m", dtype, args.threads, decoder="lean")
        out.append(("lean int8", to_int8(loaded.model), loaded.tokenizer))
    if args.int4:
        # quantized from the float32 weights (the Q4_1 values exactly), then scales and the rest cast to the dtype
        loaded = load_model("smollm2-135m", "float32", args.threads, decoder="lean")
        out.append(("lean int4", to_int4(loaded.model).to(getattr(torch, dtype)), loaded.tokenizer))
    if args.compile:
        loaded = load_model("smollm2-135m", dtype, args.threads, decoder="lean")
        loaded.model.model.forward = torch.compile(loaded.model.model.forward, dynamic=True)
        out.append(("lean compiled", loaded.model, loaded.tokenizer))
    return out


def measure(args, dtype: str) -> list[tuple]:
    """Time every lane of ``dtype`` at B=1 and B=8, interleaved over ``args.rounds`` rounds (best round kept, so
    a lane is not penalized for the moment another process took the cores), and profile one B=1 step each."""
    models = lanes(args, dtype)
    prefix_ids, rows = rows_and_prefix(models[0][2], 8)
    prefixes = [PrefixKV.build(model, prefix_ids) for _, model, _ in models]
    floor = max((decode_floor(models[0][1]) for _ in range(3)), key=lambda f: f.memory_read_gb_s)
    best, tokens = {}, {}
    for round_ in range(args.rounds):
        print(f"{dtype}: round {round_ + 1} of {args.rounds}", file=sys.stderr, flush=True)
        for (name, model, _), prefix in zip(models, prefixes):
            for batch in (1, 8):
                timing, generated = time_decode(model, prefix, rows[:batch], args.steps)
                if (name, batch) not in best or timing.cpu_seconds < best[name, batch].cpu_seconds:
                    best[name, batch] = timing
                tokens[name, batch] = generated
    profiles = {name: profile_step(model, prefix, rows[0], steps=3) for (name, model, _), prefix in zip(models, prefixes)}
    table = []
    for name, model, _ in models:
        floor_of = replace(floor, weight_bytes=model_bytes(model))
        for batch in (1, 8):
            timing = best[name, batch]
            table.append((dtype, name, batch, timing, floor_of, agreement(tokens[name, batch], tokens[models[0][0], batch]),
                          profiles[name]))
    return table, len(prefix_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--int4", action="store_true")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    print(f"{args.steps} steps per timing, best of {args.rounds} interleaved rounds by CPU time\n")
    print("| dtype | decoder | B | ms/step | tokens/s | % of B=1 floor | CPU ms/step | greedy rows = transformers | "
          "B=1 weight matmuls ms/step | B=1 outside matmuls |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    tables = []
    for dtype in args.dtypes:
        measured, prefix_len = measure(args, dtype)
        for _, name, batch, timing, floor, agree, prof in measured:
            pct = f"{floor.pct(timing.tokens_per_s):.0f}%" if batch == 1 else "–"
            # the share outside the weight matmuls, of the unprofiled step (the profiler's own cost is not the step's)
            split = f"{prof.matmul_ms:.1f} | {1 - prof.matmul_ms / timing.ms_per_step:.0%}" if batch == 1 else "– | –"
            print(f"| {dtype} | {name} | {batch} | {timing.ms_per_step:.1f} | {timing.tokens_per_s:.1f} | {pct} | "
                  f"{timing.cpu_ms_per_step:.1f} | {agree:.0%} | {split} |", flush=True)
            if batch == 1:
                tables.append((dtype, name, prof, floor, prefix_len))
    for dtype, name, prof, floor, prefix_len in tables:
        print(f"\n#### {dtype}, {name}: one B=1 step after the {prefix_len}-token prefix (profiled {prof.total_ms:.1f} ms,"
              f" weight matmuls {prof.matmul_ms:.1f} ms; floor {floor.tokens_per_s:.0f} tokens/s = "
              f"{floor.memory_read_gb_s:.1f} GB/s / {floor.weight_bytes / 1e6:.0f} MB)\n\n```\n{prof.table}```")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"\n(whole run {time.perf_counter() - started:.0f} s)")
