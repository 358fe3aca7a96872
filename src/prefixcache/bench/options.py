"""What ``prefixcache bench`` runs (:class:`BenchOptions`), without torch: the CLI reads its defaults here."""

from __future__ import annotations

from dataclasses import dataclass

from ..model.catalog import DEFAULT_MODEL
from ..types import LABEL_FIELD

SWEEP_TARGETS = (150, 300, 600, 1000, 1500, 2000)  # prefix lengths (tokens) of ``bench --sweep-prefix``


@dataclass(frozen=True)
class BenchOptions:
    """What ``prefixcache bench`` runs. Defaults reproduce the published workload's shape.

    Attributes:
        task: the task whose prefix is cached (a classification or an extraction task).
        items: synthetic tickets (20-35 tokens each) run in every lane.
        model, model_config, dtype, threads: the model (``model_config``: random weights of that architecture).
        batch_size: records per forward pass in the batched lanes.
        llama_cpp: add the llama.cpp lane when llama-cpp-python is installed.
        backend: for an extraction task, which generation backends get lanes: ``auto`` (torch's, and llama.cpp's
            where it can run), ``torch``, or ``llama.cpp`` (torch's and llama.cpp's; an error where it cannot run).
        sweep_targets: prefix lengths of the prefix sweep (empty: no sweep).
        sweep_full_items, sweep_items: records per sweep step in the full and the batched lane.
        head: a fitted head file for the head lanes, or ``"fit"``: fit one on the bench's records first
            (for timing only). None: the task file's ``head:``, if any (see :mod:`prefixcache.bench.head_lanes`).
    """

    task: str = "tickets-compact"
    items: int = 600
    model: str = DEFAULT_MODEL
    model_config: str | None = None
    dtype: str = "auto"
    threads: int | None = None
    batch_size: int = 32
    llama_cpp: bool = True
    backend: str = "auto"
    sweep_targets: tuple[int, ...] = ()
    sweep_full_items: int = 16
    sweep_items: int = 128
    head: str | None = None
    records: str | None = None
    label_field: str = LABEL_FIELD
    full_items: int = 8
    before_batch_size: int = 4
