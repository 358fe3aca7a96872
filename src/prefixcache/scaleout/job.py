"""What a Ray classification job runs and where: the two settings objects of
:func:`~prefixcache.scaleout.ray.run_ray_classify`, built once by its caller (``classify --ray``, the Ray bench
lane, a Python caller) and passed down to the workers and the cluster.

* :class:`WorkerSpec`: what every worker builds once (task, model, how it classifies, which columns it reads,
  the prefix's disk tier); shipped to the actors by value.
* :class:`RayCluster`: where the workers run and how Ray treats them (address, workers, GPUs, rows per call,
  restarts and retries, the start timeout).

Importing this module imports no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..model.catalog import DEFAULT_MODEL
from ..task.definition import Task, load_task
from ..types import DEFAULT_WORKERS, TEXT_FIELD, RunConfig
from .inputs import absolute


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker builds once, shipped to the actors by value.

    Attributes:
        task: a task name or path, or a loaded Task; :meth:`resolved` loads it on the driver, so a task YAML
            needs to exist only there (the workers get the validated Task).
        model: a ``--model`` spec, resolved on each worker: an embedded name (the package must be
            installed on every node), a ``.gguf`` or folder path that exists on every node, or a
            Hugging Face id in every node's cache.
        threads: torch threads per worker (None: 1); also the CPUs Ray reserves for it.
        config: how the worker's classifier runs each batch it is handed (mode, batch size, overflow policy).
        text_field, id_field: the input columns a record's text and id come from (no id field: row numbers).
        cache_dir: the prefix disk tier, a folder every worker can reach; None computes the
            prefix once per worker.
    """

    task: Task | str
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    threads: int | None = 1
    method: str = "auto"
    config: RunConfig = field(default_factory=RunConfig)
    text_field: str = TEXT_FIELD
    id_field: str | None = None
    cache_dir: str | Path | None = None

    def resolved(self) -> WorkerSpec:
        """This spec as the workers get it: the task loaded, the model and cache folder made absolute when they
        are local paths (workers do not share the driver's working folder), at least one thread.

        Raises:
            TaskError: the task cannot be loaded.
        """
        return replace(
            self, task=self.task if isinstance(self.task, Task) else load_task(self.task), model=absolute(self.model),
            threads=self.threads or 1, cache_dir=absolute(str(self.cache_dir)) if self.cache_dir else None,
        )


@dataclass(frozen=True)
class RayCluster:
    """Where the workers run and how Ray treats them.

    Attributes:
        address: a running cluster (``auto``, ``HOST:6379``, ``ray://HOST:10001``); None starts a local Ray (or
            uses one already initialized) and checks the model and GPUs on this machine first.
        workers: worker processes (actors), each with its own model and prefix.
        num_gpus: GPUs per worker (a fraction shares one).
        rows_per_call: rows handed to a worker per call (None: 4 x the batch size, which it sorts by length).
        max_restarts, max_task_retries: bounds on restarting a dead worker and retrying its lost call (None:
            Ray Data's defaults, without limit).
        start_timeout_s: how long the job waits for its workers to start.
    """

    address: str | None = None
    workers: int = DEFAULT_WORKERS
    num_gpus: float = 0
    rows_per_call: int | None = None
    max_restarts: int | None = None
    max_task_retries: int | None = None
    start_timeout_s: int = 900
