"""Options several commands share. Every default is read from the settings object that owns it
(:class:`~prefixcache.types.RunConfig`, :class:`~prefixcache.cache.config.PoolConfig`, the model
catalog), never typed twice. Imports nothing heavy: ``--help`` must not load torch.
"""

from __future__ import annotations

import typer

from ..cache.config import STORAGE_NAMES, PoolConfig, format_bytes
from ..cache.eviction import POLICIES
from ..eval.tune_config import RefitConfig, TuneConfig
from ..model.catalog import DEFAULT_MODEL, DTYPE_CHOICES
from ..types import BACKENDS, DEFAULT_FEATURE, DEFAULT_TASK, LABEL_FIELD, METHODS, MODES, TEXT_FIELD, RunConfig

RUN = RunConfig()
POOL = PoolConfig()

TaskOpt = typer.Option(DEFAULT_TASK, "--task", help="A bundled task name or a path to a task YAML.")
ModelOpt = typer.Option(DEFAULT_MODEL, "--model", help="Embedded name, .gguf path, HF id, local folder, or random:ARCH[@TOKENIZER] "
                        "(seeded random weights of a known architecture; the embedded model's tokenizer unless named).")
DtypeOpt = typer.Option(DTYPE_CHOICES[0], "--dtype", help=f"One of {', '.join(DTYPE_CHOICES)}.")
ThreadsOpt = typer.Option(None, "--threads", min=1, help="Torch threads (default: all cores).")
BackendOpt = typer.Option(
    BACKENDS[0], "--backend",
    help="What runs generation: auto (llama.cpp where torch's generation measures slower: float32 weights, or one row "
    "at a time; when it is built and the model is a .gguf), torch, or llama.cpp (reads the .gguf's own 4-bit blocks). "
    "Scoring always runs on torch.",
)
MethodOpt = typer.Option(METHODS[0], "--method", help=f"Label scoring: {', '.join(METHODS)}.")
ModeOpt = typer.Option(RUN.mode.value, "--mode", help=f"One of {', '.join(MODES)}.")
BatchOpt = typer.Option(RUN.batch_size, "--batch-size", min=1, help="Records per forward pass (batched mode).")
TextFieldOpt = typer.Option(TEXT_FIELD, "--text-field", help="Field holding the record's text.")
IdFieldOpt = typer.Option(None, "--id-field", help="Field holding the record id (default: 0-based row number).")
CacheBudgetOpt = typer.Option(
    None, "--cache-budget",
    help=f"Prefix pool byte budget such as 256MB (setting any cache option makes a pool; default {format_bytes(POOL.budget_bytes)}).",
)
CacheDirOpt = typer.Option(
    None, "--cache-dir", envvar="PREFIXCACHE_CACHE_DIR",
    help="Disk tier: prefixes are loaded from and saved to this folder (default: $PREFIXCACHE_CACHE_DIR; none without it).",
)
CacheDirBudgetOpt = typer.Option(
    None, "--cache-dir-budget",
    help="Byte budget of the --cache-dir folder such as 2GB: after each save the least recently used files are deleted "
    "until it fits. Recorded in the folder, so every later run and process keeps it (default: the folder's recorded "
    "budget, else no limit).",
)
KVStorageOpt = typer.Option(POOL.storage, "--kv-storage", help=f"How the pool stores prefixes: {', '.join(STORAGE_NAMES)}.")
EvictionOpt = typer.Option(POOL.eviction, "--eviction", help=f"Pool eviction policy: {', '.join(POLICIES)}.")
InputArg = typer.Argument(..., help="Input .csv, .jsonl, .parquet, or - for JSONL on stdin.")
HeadOpt = typer.Option(
    None, "--head", help="A fitted label head (prefixcache fit); overrides the task file's head:. Scores are the head's. "
    "For an extraction task: its tuned prefix (fit --task T --tune prefix)."
)
CalibrationOpt = typer.Option(
    None, "--calibration", help="A prompt-only calibration file (prefixcache fit --prompt-only); overrides the task's calibration:."
)
MinConfidenceOpt = typer.Option(
    None, "--min-confidence", min=0.0, max=1.0, help="Abstain (label null, best guess kept) under this calibrated confidence."
)
TargetAccuracyOpt = typer.Option(
    None, "--target-accuracy", min=0.0, max=1.0,
    help="Abstain under the threshold whose accepted out-of-fold rows (the head's, or the calibration file's) reach this accuracy.",
)
ReviewOutOpt = typer.Option(
    None, "--review-out", help="Write the abstained records' whole input rows here (JSON Lines), with the best guess."
)
KeepFieldsOpt = typer.Option(None, "--keep-fields", help="Input fields (a,b) to write beside each label.")
KeepInputOpt = typer.Option(False, "--keep-input", help="Write every input field beside each label.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of a table.")
LabelFieldOpt = typer.Option(LABEL_FIELD, "--label-field", help="Field holding each row's gold label.")
FieldHeadOpt = typer.Option(
    None, "--head", help="FIELD=FILE: a head fitted for a choice field (prefixcache fit --field FIELD); repeatable. "
    "A bare FILE: the task's tuned prefix (prefixcache fit --task T --tune prefix)."
)
FieldMinConfidenceOpt = typer.Option(
    None, "--min-confidence", help="FIELD=P: leave FIELD null and flag the record when its confidence is under P; repeatable."
)

TUNE = TuneConfig()  # fit --tune prefix's defaults
TuneOpt = typer.Option("head", "--tune", help="What to fit: head (a linear head over the prompt's states) or prefix (the "
                       "prompt's cached keys/values, tuned with a head; docs/accuracy.md).")
EpochsOpt = typer.Option(TUNE.epochs, "--epochs", min=1, help="--tune prefix: at most this many epochs.")
TuneLrOpt = typer.Option(TUNE.lr, "--lr", min=0.0, help="--tune prefix: the prefix's learning rate.")
VirtualTokensOpt = typer.Option(None, "--virtual-tokens", min=2,
                                help="--tune prefix: a shorter tuned prefix of K tokens (default: the prompt's).")
FeatureOpt = typer.Option(
    DEFAULT_FEATURE, "--feature",
    help="Features: last, mean, last@K, mean@K, last@P/Q (a fraction of the depth), joined by + (docs/accuracy.md).",
)
REFIT = RefitConfig()  # the head fit --tune prefix writes with its prefix
RefitHeadOpt = typer.Option(
    REFIT.enabled, "--refit-head/--no-refit-head",
    help="--tune prefix: write the tuned prefix with a head refitted on its states (--feature, --folds, --on-prompt as "
    "for a head; measured more accurate, docs/accuracy.md), or keep the head trained with it.")
