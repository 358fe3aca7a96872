#!/usr/bin/env python3
"""Write a named architecture with seeded random weights as a local Hugging Face model folder.

For speed figures where the real weights cannot be fetched (no model hub): the folder
loads like any model, so ``prefixcache serve --model DIR`` and ``scripts/loadtest.py
--model DIR`` run the published architecture end to end. Labels from it mean nothing;
equality between the server and the sequential reference still does.

    python scripts/save_random_model.py qwen2.5-0.5b --tokenizer smollm2-135m --out /tmp/qwen-shape
"""

from __future__ import annotations

import argparse

from transformers import AutoConfig

from prefixcache.model.load import DEFAULT_MODEL, MODEL_CONFIGS, build_random_model, load_model_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--tokenizer", default=DEFAULT_MODEL, help="model spec whose tokenizer is paired (ids must fit the vocabulary)")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    params = dict(MODEL_CONFIGS[args.config])
    config = AutoConfig.for_model(params.pop("model_type"), **params)
    build_random_model(config, seed=args.seed).save_pretrained(args.out)
    load_model_tokenizer(args.tokenizer).save_pretrained(args.out)
    print(f"wrote {args.config} (random weights, seed {args.seed}) with the {args.tokenizer} tokenizer to {args.out}")


if __name__ == "__main__":
    main()
