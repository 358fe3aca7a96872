"""Scale-out integrations.

* :mod:`prefixcache.scaleout.ray`: a Ray Data stage (needs the ``ray`` extra:
  ``pip install 'prefixcache[ray]'``).

Importing this package imports no Ray; :mod:`.inputs`, :mod:`.blocks`, :mod:`.sink`
and :mod:`.summary` need none either, so they are tested and used without a
cluster. :func:`run_ray_classify` here imports Ray only when called; its two settings
objects, :class:`~prefixcache.scaleout.job.WorkerSpec` (what each worker runs) and
:class:`~prefixcache.scaleout.job.RayCluster` (where), are importable from here without it.
"""

from __future__ import annotations

from ..errors import RayNotInstalledError, setting
from .job import RayCluster, WorkerSpec

__all__ = ["RayCluster", "RayNotInstalledError", "WorkerSpec", "run_ray_classify"]


def run_ray_classify(*args, **kwargs):
    """:func:`prefixcache.scaleout.ray.run_ray_classify`; see there for arguments, result and errors.

    Raises:
        RayNotInstalledError: Ray (or Ray Data) is not installed; the message says how to install it.
    """
    try:
        from .ray import run_ray_classify as run
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "ray":
            raise
        raise RayNotInstalledError(
            f"{setting('ray')} needs Ray Data ({exc.name} is missing): pip install 'prefixcache[ray]' here and on every "
            "node of the cluster"
        ) from None
    return run(*args, **kwargs)
