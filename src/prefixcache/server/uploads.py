"""A task upload's body turned into a task, within the server's upload limits.

:func:`parse_upload` runs on a worker thread (never the event loop). Its limits are checked as early as
each can be, so a hostile body costs little:

* ``max_task_bytes``: before anything is decoded or parsed (413);
* ``max_labels`` (a classification task's labels, an extraction task's fields) and ``max_examples``
  (``examples`` and ``example_pool`` together): on the parsed YAML, before the task is validated (422);
* the first 20 problems of an invalid task are named, the rest counted (:func:`~prefixcache.spec.task.parse_task`).

This module knows nothing about HTTP beyond the media types a task may be sent as.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import TaskTooLargeError, TaskUploadError
from ..spec.task import ExtractTask, Task, parse_task
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
            the settings allow, a name that differs from the URL's, or a ``head:`` file.
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
