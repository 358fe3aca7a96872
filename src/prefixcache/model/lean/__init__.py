"""A lean decoder of our own for the Llama family, in plain torch: no transformers import anywhere here.

:func:`~prefixcache.model.lean.weights.load_lean` builds a :class:`~prefixcache.model.lean.decoder.LeanForCausalLM`
from a folder's ``config.json`` and safetensors weights; :func:`~prefixcache.model.lean.config.lean_reason`
says why a config is not covered (then transformers serves it, as the fallback).
"""
