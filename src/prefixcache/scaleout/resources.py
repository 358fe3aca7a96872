"""What a Ray job may reserve: CPUs per worker and GPUs, checked before any worker starts. Imports no Ray."""

from __future__ import annotations

from ..errors import ResourceError, setting


def cpus_per_worker(threads: int, workers: int, cluster_cpus: float) -> float:
    """CPUs Ray reserves per worker: ``threads``, or less so that one CPU of the cluster stays free.

    Ray Data runs small tasks of its own (listing files, reading) that each wait for a whole
    CPU; if the workers held every CPU, those would never run and the job would hang. A
    worker still runs ``threads`` torch threads whatever Ray reserves.
    """
    if cluster_cpus <= 0:
        return float(threads)
    return min(float(threads), max(0.0, cluster_cpus - 1) / workers)


def check_gpus(num_gpus: float, workers: int, cluster_gpus: float, local: bool) -> None:
    """Refuse at once a local run whose workers ask for more GPUs than the machine has.

    A local Ray cannot grow, so such workers would never start and the run would only end at
    ``--start-timeout``. A remote cluster may autoscale, so there the wait is left to Ray.

    Raises:
        ResourceError: naming what was asked for and what there is.
    """
    wanted = num_gpus * workers
    if local and num_gpus > 0 and wanted > cluster_gpus:
        raise ResourceError(
            f"{setting('num_gpus', f'{num_gpus:g}')} for {workers} worker(s) needs {wanted:g} GPU(s), and this "
            f"machine's Ray has {cluster_gpus:g}; drop {setting('num_gpus')}, lower it or {setting('workers')}, or give "
            f"{setting('ray_address')} of a cluster with GPUs"
        )
