"""A task upload's body turned into a task, within the server's upload limits.

:func:`parse_upload` runs in a child process (:class:`UploadParser`), never in the server's own: parsing holds
the GIL (libyaml composes a whole document in one C call, and the constructors are Python), so parses on a
thread of the server starve its event loop and model thread (``studies/hostile_uploads.py``: `/healthz` p99
926 ms with 20 parses at once on threads). Uploads take turns in the one child. Its limits are checked as early
as each can be, so a hostile body costs little:

* ``max_task_bytes``: before anything is decoded or parsed (413);
* ``max_labels`` (a classification task's labels, an extraction task's fields) and ``max_examples``
  (``examples`` and ``example_pool`` together): on the parsed YAML, before the task is validated (422);
* the first 20 problems of an invalid task are named, the rest counted (:func:`~prefixcache.task.definition.parse_task`).

This module knows nothing about HTTP beyond the media types a task may be sent as.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Sequence

from ..errors import TaskTooLargeError, TaskUploadError
from ..task.definition import ExtractTask, Task, parse_task
from .settings import ServerSettings

TASK_MEDIA_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "application/json", "text/plain")
COUNTED = ((("labels",), "labels", "max_labels"), (("fields",), "fields", "max_labels"),
           (("examples", "example_pool"), "examples", "max_examples"))
"""(the task's keys, what they hold, the setting that caps how many)."""


def parse_upload(
    name: str, content_type: str, body: bytes, settings: ServerSettings, kinds: Sequence[str]
) -> Task | ExtractTask:
    """The uploaded task, validated; ``kinds`` are the task kinds the server runs.

    Raises:
        TaskTooLargeError: the body is over ``settings.max_task_bytes`` (nothing of it is read).
        TaskUploadError: an unsupported media type, a body that is not UTF-8, more labels or examples than
            the settings allow, a name that differs from the URL's, a ``head:`` or ``calibration:`` file, or a
            ``chat_template:``.
        TaskError: the task itself is invalid (naming the line and the field).
    """
    if len(body) > settings.max_task_bytes:
        raise TaskTooLargeError(
            f"the task body has {len(body)} bytes, more than max_task_bytes={settings.max_task_bytes}; "
            "shorten its instruction, labels or examples"
        )
    media_type = content_type.split(";")[0].strip().lower()
    if media_type not in TASK_MEDIA_TYPES:
        raise TaskUploadError(f"send the task as YAML or JSON (Content-Type one of {', '.join(TASK_MEDIA_TYPES)})")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskUploadError(f"the task body is not UTF-8 (byte {exc.start})") from None
    counts = lambda data: check_counts(name, data, settings)  # noqa: E731
    task = parse_task(text, source=f"upload:{name}", kinds=tuple(kinds), check=counts)
    if task.name != name:
        raise TaskUploadError(f"the task body names {task.name!r} but the URL names {name!r}; make them match")
    if getattr(task, "head", None) is not None:
        raise TaskUploadError("an uploaded task cannot name a head file (head:): the server reads no file a request "
                              "names; start the server with a task file that names its head")
    if task.chat_template is not None:
        raise TaskUploadError("an uploaded task cannot carry a chat template (chat_template:): the server renders no "
                              "template a request sends; start the server with a task file that has it")
    if getattr(task, "calibration", None) is not None:
        raise TaskUploadError("an uploaded task cannot name a calibration file (calibration:): the server reads no file "
                              "a request names; start the server with a task file that names it")
    return task


def check_counts(name: str, data: dict, settings: ServerSettings) -> None:
    """Raise TaskUploadError when the parsed task ``data`` has more labels (or fields) or examples than the
    settings allow. Values of the wrong type are left to the task's validation, which names them."""
    for keys, what, limit_name in COUNTED:
        count = sum(len(data[key]) for key in keys if isinstance(data.get(key), (dict, list)))
        limit = getattr(settings, limit_name)
        if count > limit:
            raise TaskUploadError(
                f"task {name!r} has {count} {what}, more than {limit_name}={limit}; an uploaded task may have at "
                f"most {limit} {what}"
            )


class UploadParser:
    """Parses uploads with :func:`parse_upload` in one child process (started with ``spawn``: a fresh interpreter
    that imports the task parser only, never torch or the model), one upload at a time, at a lower CPU priority
    than the server (``nice`` 10), so a stream of uploads takes CPU from the model only where it would idle.

    What :func:`parse_upload` raises is raised by :meth:`parse` (exceptions cross the process boundary by pickling).
    Call :meth:`close` when the server stops.
    """

    def __init__(self):
        self._pool: ProcessPoolExecutor | None = None
        self._turn = asyncio.Semaphore(1)  # queued uploads wait here, on the event loop, costing nothing

    async def parse(
        self, name: str, content_type: str, body: bytes, settings: ServerSettings, kinds: Sequence[str]
    ) -> Task | ExtractTask:
        """:func:`parse_upload` in the child process; see it for what it raises."""
        async with self._turn:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_yield_cpu)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, parse_upload, name, content_type, body, settings, tuple(kinds))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _yield_cpu() -> None:
    """In the parser's process: lower its CPU priority (where the OS has ``nice``)."""
    import os

    if hasattr(os, "nice"):
        os.nice(10)
