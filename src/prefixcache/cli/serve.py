"""``prefixcache serve``: tasks over HTTP. Every default is :class:`~prefixcache.server.settings.ServerSettings`'."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..cache.config import parse_bytes
from ..errors import ExtraNotInstalledError
from ..server.settings import DEFAULT_LOG_LEVEL, LOG_LEVELS, ServerSettings
from ..server.settings import DEFAULTS as SERVER
from ..types import BACKENDS, DEFAULT_TASK, METHODS
from .errors import reported, choice, parsed
from .loading import load
from .options import BackendOpt, DtypeOpt, MethodOpt, ModelOpt, ThreadsOpt


@reported
def serve(
    task: list[str] = typer.Option([DEFAULT_TASK], "--task", help="A bundled task name or a YAML path; repeat for more."),
    model: str = ModelOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    method: str = MethodOpt,
    host: str = typer.Option(SERVER.host, "--host", help="Interface to listen on (loopback by default)."),
    port: int = typer.Option(SERVER.port, "--port", min=0, max=65535, help="Port (0 picks a free one)."),
    max_batch: int = typer.Option(SERVER.max_batch, "--max-batch", min=1, help="Most sequences in one step of the engine loop."),
    max_step_tokens: int = typer.Option(
        SERVER.max_step_tokens, "--max-step-tokens", min=1,
        help="Most tokens one step feeds (a longer prompt is fed in chunks, so other requests keep their turn).",
    ),
    max_queue: int = typer.Option(
        SERVER.max_queue, "--max-queue", min=1, help="Most items in progress at once (all requests); more gets 429."
    ),
    max_queue_per_client: Optional[int] = typer.Option(
        None, "--max-queue-per-client", min=1,
        help="Most items in progress for one client (its key's role and address); more gets 429. "
        "Default: half of --max-queue, at least --max-items.",
    ),
    max_items: int = typer.Option(SERVER.max_items, "--max-items", min=1, help="Most items per request (422 above)."),
    max_item_tokens: int = typer.Option(SERVER.max_item_tokens, "--max-item-tokens", min=1, help="Most tokens per item (422 above)."),
    max_body_bytes: int = typer.Option(SERVER.max_body_bytes, "--max-body-bytes", min=1, help="Largest request body (413 above)."),
    max_prefix_tokens: int = typer.Option(
        SERVER.max_prefix_tokens, "--max-prefix-tokens", min=1, help="Largest prefix of an uploaded task."
    ),
    max_task_bytes: int = typer.Option(SERVER.max_task_bytes, "--max-task-bytes", min=1, help="Largest task upload (413 above)."),
    max_labels: int = typer.Option(SERVER.max_labels, "--max-labels", min=1, help="Most labels (or fields) of an uploaded task."),
    max_examples: int = typer.Option(SERVER.max_examples, "--max-examples", min=1, help="Most examples of an uploaded task."),
    max_tasks: int = typer.Option(SERVER.max_tasks, "--max-tasks", min=1, help="Most tasks registered at once (start-up tasks too)."),
    max_choice_chars: int = typer.Option(SERVER.max_choice_chars, "--max-choice-chars", min=1, help="Longest guided choice (400 above)."),
    max_choice_tokens: int = typer.Option(SERVER.max_choice_tokens, "--max-choice-tokens", min=1, help="Most tokens of a request's choices (400 above)."),
    cache_budget: Optional[str] = typer.Option(None, "--cache-budget", help="Byte budget of the server's prefix pool, such as 256MB."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Run a model repository's own code (only for models you trust)."),
    log_level: str = typer.Option(DEFAULT_LOG_LEVEL, "--log-level", help=f"uvicorn log level: {', '.join(LOG_LEVELS)}."),
    head: Optional[Path] = typer.Option(
        None, "--head", help="A fitted label head (prefixcache fit) for the one --task served; overrides its head:."
    ),
    backend: str = BackendOpt,
):
    """Serve tasks over HTTP with continuous batching (FastAPI on uvicorn, one engine loop). Set PREFIXCACHE_API_KEY to require a key,
    and PREFIXCACHE_ADMIN_KEY to keep task changes and /metrics to the operator (start-up tasks are read-only to clients).

    Needs the 'serve' extra: pip install 'prefixcache[serve]'.
    """
    run_server = server_runner()
    log_level = choice(log_level, LOG_LEVELS, "--log-level")
    settings = ServerSettings.from_env(
        host=host, port=port, max_batch=max_batch, max_step_tokens=max_step_tokens,
        max_queue=max_queue, max_queue_per_client=max_queue_per_client, max_items=max_items,
        max_item_tokens=max_item_tokens, max_body_bytes=max_body_bytes, max_prefix_tokens=max_prefix_tokens,
        max_task_bytes=max_task_bytes, max_labels=max_labels, max_examples=max_examples, max_tasks=max_tasks,
        max_choice_chars=max_choice_chars, max_choice_tokens=max_choice_tokens, method=choice(method, METHODS, "--method"),
        cache_budget_bytes=parsed(parse_bytes, cache_budget, "--cache-budget") if cache_budget else None,
        backend=choice(backend, BACKENDS, "--backend"),
    )
    run_server(load(model, dtype, threads, trust_remote_code), served_specs(task, head), settings, log_level)


def served_specs(names: list[str], head: Optional[Path]) -> list:
    """The ``--task`` names or paths, loaded; with ``--head``, the one task scoring through it."""
    from ..task.definition import load_any_task

    specs = [load_any_task(name) for name in names]
    return specs if head is None else [served_with_head(specs, head)]


def served_with_head(specs: list, head: Path):
    """The one classification task of ``specs`` with ``head:`` set to ``head``'s absolute path (read here first,
    so a bad file is refused before the model loads).

    Raises:
        typer.BadParameter: more than one task, or an extraction task.
    """
    from ..engine.head_file import load_head
    from ..task.definition import ExtractTask

    if len(specs) != 1 or isinstance(specs[0], ExtractTask):
        raise typer.BadParameter("--head goes with exactly one classification --task", param_hint="--head")
    load_head(head)
    return specs[0].model_copy(update={"head": str(Path(head).resolve())})


def server_runner():
    """:func:`prefixcache.server.launch.run_server`, or a clear error when the 'serve' extra is not installed."""
    try:
        from ..server import launch
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in ("fastapi", "uvicorn", "starlette", "prometheus_client"):
            raise
        raise ExtraNotInstalledError(
            f"serve needs the 'serve' extra ({exc.name} is missing): pip install 'prefixcache[serve]'"
        ) from None
    return launch.run_server
