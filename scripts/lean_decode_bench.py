"""Lean decoder vs transformers: greedy decode steps on the embedded model after the ticket-fields prefix.

For each dtype, both decoders side by side in one run: B=1 and B=8 tokens/s and ms per step, the share of the
B=1 weight-read floor (memory bandwidth measured in the same run / weight bytes), greedy agreement with the
transformers decoder, and a torch.profiler split of one B=1 step (weight matmuls vs everything else).
Optional levers: ``--int8`` (weight-only int8, per-channel scales, ``torch._weight_int8pack_mm``) and
``--compile`` (``torch.compile`` of the lean decoder stack).

    PYTHONPATH=src python scripts/lean_decode_bench.py --steps 32 --int8 > lean.md
"""

from __future__ import annotations

import argparse
import time

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


def to_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every linear layer of the decoder stack (not the output head) for :class:`Int8Linear`, in place."""
    for layer in model.base_model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Int8Linear(child))
    return model


def rows_and_prefix(tokenizer, items: int):
    task = load_any_task("ticket-fields")
    prompt = build_extract_prompt(task, tokenizer)
    rows = [tokenizer(f"Ticket: {r.fields['text']}\n", add_special_tokens=False)["input_ids"] for r in ticket_records(items)]
    return list(prompt.prefix_ids), rows


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of rows whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def lanes(args, dtype: str):
    """Yield (name, model, tokenizer) for every lane of ``dtype``: transformers first (the reference)."""
    for decoder in ("transformers", "lean"):
        loaded = load_model("smollm2-135m", dtype, args.threads, decoder=decoder)
        yield decoder, loaded.model, loaded.tokenizer
        if decoder == "lean" and args.int8 and dtype == "bfloat16":
            yield "lean int8", to_int8(loaded.model), loaded.tokenizer
        if decoder == "lean" and args.compile:
            loaded.model.model.forward = torch.compile(loaded.model.model.forward, dynamic=True)
            yield "lean compiled", loaded.model, loaded.tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    print("| dtype | decoder | B | ms/step | tokens/s | % of B=1 floor | greedy rows = transformers | "
          "B=1 matmul ms/step | outside matmuls |")
    print("|---|---|---|---|---|---|---|---|---|")
    profiles = []
    for dtype in args.dtypes:
        reference = {}
        for name, model, tokenizer in lanes(args, dtype):
            prefix_ids, rows = rows_and_prefix(tokenizer, 8)
            prefix = PrefixKV.build(model, prefix_ids)
            floor = decode_floor(model)
            prof = profile_step(model, prefix, rows[0])
            for batch in (1, 8):
                timing, tokens = time_decode(model, prefix, rows[:batch], args.steps)
                reference.setdefault(batch, tokens)
                pct = f"{floor.pct(timing.tokens_per_s):.0f}%" if batch == 1 else "–"
                split = (f"{prof.matmul_ms:.1f} | {1 - prof.matmul_ms / timing.ms_per_step:.0%}" if batch == 1 else "– | –")
                print(f"| {dtype} | {name} | {batch} | {timing.ms_per_step:.1f} | {timing.tokens_per_s:.1f} | {pct} | "
                      f"{agreement(tokens, reference[batch]):.0%} | {split} |", flush=True)
            profiles.append((dtype, name, prof, len(prefix_ids), floor))
    for dtype, name, prof, prefix_len, floor in profiles:
        print(f"\n#### {dtype}, {name}: one B=1 step after a {prefix_len}-token prefix (profiled: {prof.total_ms:.1f} ms,"
              f" weight matmuls {prof.matmul_ms:.1f} ms; floor {floor.tokens_per_s:.0f} tokens/s at "
              f"{floor.memory_read_gb_s:.1f} GB/s)\n\n```\n{prof.table}```")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"\n(whole run {time.perf_counter() - started:.0f} s)")
