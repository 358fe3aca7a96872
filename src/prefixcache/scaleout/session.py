"""Ray plumbing for a run: the connection, Ray Data's settings, and errors coming back from workers.

Needs Ray. This module knows nothing about models or records.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import ray
import ray.data

from ..errors import PrefixCacheError

RAY_NOTE = "\nFailed to apply UDF transform"  # what Ray Data appends to a worker error's message


@contextmanager
def ray_session(address: str | None, log: Callable[[str], None]) -> Iterator[None]:
    """Ray as it is when already initialized; else a connection to ``address``, or a local Ray.

    Shuts down only a Ray it started. A local Ray uses every core of this machine and runs
    no dashboard.
    """
    if ray.is_initialized():
        yield
        return
    started = time.perf_counter()
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(include_dashboard=False, logging_level=logging.WARNING)
    resources = ray.cluster_resources()
    log(f"ray: {'connected to ' + address if address else 'started a local Ray'} in "
        f"{time.perf_counter() - started:.1f} s ({resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs)")
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def data_context(start_timeout_s: int, max_block_bytes: int | None) -> Iterator[None]:
    """Ray Data set up for a run, restored afterwards.

    * ``preserve_order``: rows come out in input order (so ids can be row numbers);
    * ``wait_for_min_actors_s``: work starts once every worker has loaded its model and
      prefix (so all share it), and a cluster too small for the pool fails after
      ``start_timeout_s`` with Ray's "Timed out while starting actors" instead of waiting forever;
    * ``raise_original_map_exception``: a worker's error reaches the driver as itself (so an
      InputError or ModelNotFoundError is reported as one), not as Ray's UserCodeException text;
    * ``target_max_block_size`` lowered to ``max_block_bytes`` when given
      (see :func:`prefixcache.scaleout.inputs.block_bytes`);
    * Ray Data's own progress bars off (the driver shows one bar of records).
    """
    ctx = ray.data.DataContext.get_current()
    settings = {"wait_for_min_actors_s": start_timeout_s, "raise_original_map_exception": True, "enable_progress_bars": False}
    if max_block_bytes is not None and (ctx.target_max_block_size is None or max_block_bytes < ctx.target_max_block_size):
        settings["target_max_block_size"] = max_block_bytes
    saved = {name: getattr(ctx, name) for name in settings}
    saved_order = ctx.execution_options.preserve_order
    for name, value in settings.items():
        setattr(ctx, name, value)
    ctx.execution_options.preserve_order = True
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ctx, name, value)
        ctx.execution_options.preserve_order = saved_order


def domain_error(exc: BaseException) -> PrefixCacheError | None:
    """The PrefixCacheError a Ray error wraps (a worker's bad input, a missing model), if any.

    Returns the innermost one as a plain instance of its own class, with the retry note Ray
    Data appends to its message removed, so the CLI prints the one line the worker raised.
    """
    found: PrefixCacheError | None = None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PrefixCacheError):
            found = current
        cause = getattr(current, "cause", None)
        current = cause if isinstance(cause, BaseException) else (current.__cause__ or current.__context__)
    if found is None:
        return None
    message = str(found.args[0]) if found.args else str(found)
    own_class = next(k for k in type(found).__mro__ if issubclass(k, PrefixCacheError) and k.__module__ != "ray.exceptions")
    if RAY_NOTE not in message and own_class is type(found):
        return found
    return own_class(message.split(RAY_NOTE)[0])
