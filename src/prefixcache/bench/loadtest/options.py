"""What each lane of ``prefixcache loadtest`` runs, without torch: the CLI reads its defaults here."""

from __future__ import annotations

from dataclasses import dataclass

from ...model.catalog import DEFAULT_MODEL

CLASSIFY_TASK, EXTRACT_TASK = "support-tickets", "ticket-fields"


@dataclass(frozen=True)
class ServedModel:
    """The model a lane's servers run: ``serve --model --dtype --threads`` (threads None: all cores)."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    threads: int | None = None


@dataclass(frozen=True)
class LoadTestOptions:
    """The plain lane: micro-batched (``max_batch``) against one item per pass, on the same requests.

    Attributes:
        served: the model, in both servers and in the sequential in-process reference.
        task: a bundled task name or a YAML path (snapshotted, so every reader sees the same bytes).
        clients, requests, items_per_request: concurrent clients; measured requests per lane; items in each.
        distinct: distinct tickets, cycled over the requests (each item keeps a unique id).
        max_batch, max_step_tokens: the micro-batched server's ``--max-batch`` and ``--max-step-tokens``
            (None: serve's).
        rounds: alternating rounds per lane (A B, B A, ...), against load drift.
        tolerance: largest |probability difference| counted as equal (None: 1e-4 in float32, 0.1 otherwise).
        near_tie: a reference margin at or below this is a near tie (None: twice the lane's measured drift).
        target: the required throughput ratio, micro-batched / one at a time.
        openai, openai_target: instead compare ``/v1/classify`` with the chat route (``guided_choice``, the
            official client), both micro-batched; the target then becomes ``openai_target``.
        json_path: also write the figures as JSON here.
    """

    served: ServedModel = ServedModel()
    task: str = CLASSIFY_TASK
    clients: int = 32
    requests: int = 320
    items_per_request: int = 1
    distinct: int = 96
    max_batch: int = 32
    max_step_tokens: int | None = None
    rounds: int = 2
    tolerance: float | None = None
    near_tie: float | None = None
    target: float = 4.0
    openai: bool = False
    openai_target: float = 0.8
    json_path: str | None = None


@dataclass(frozen=True)
class MixedOptions:
    """Extraction clients and one-item classification clients on one server at once.

    Attributes:
        baseline_src: another checkout's ``src/`` folder, run as a second (baseline) lane; None: this one only.
        extract_clients, classify_clients: closed-loop clients of each kind in the mixed phase.
        seconds: length of the mixed phase per lane.
        idle: one-item classifications timed on the idle server first.
        json_path: write every lane's samples here.
    """

    served: ServedModel = ServedModel()
    baseline_src: str | None = None
    extract_clients: int = 8
    classify_clients: int = 8
    seconds: float = 60.0
    idle: int = 30
    json_path: str | None = None


@dataclass(frozen=True)
class PeerOptions:
    """`prefixcache serve` against llama.cpp's ``llama-server`` on the same ``.gguf``, one after the other.

    Attributes:
        llama_server: the ``llama-server`` binary; None, or a path that does not exist: that lane is skipped.
        gguf: the ``.gguf`` both servers run (None: the embedded model's).
        task: the classification task (labels, prompt, examples).
        dtype, threads: prefixcache's dtype; threads for both servers (None: all cores).
        requests, clients: chats per workload; closed-loop clients.
        json_path: also write the figures as JSON here.
        backends: prefixcache's generation backends (``serve --backend``), one server each, one after the other.
    """

    llama_server: str | None = None
    gguf: str | None = None
    task: str = CLASSIFY_TASK
    dtype: str = "auto"
    threads: int | None = None
    requests: int = 64
    clients: int = 8
    json_path: str | None = None
    backends: tuple[str, ...] = ("auto",)


@dataclass(frozen=True)
class FairnessOptions:
    """One client floods the server; another client's one-item requests are timed, idle and under the flood.

    Attributes:
        max_batches: one server per ``--max-batch`` value (and per ``step_tokens`` value).
        step_tokens: ``--max-step-tokens`` values (None: the server's own).
        requests: the victim's requests per lane.
        flood_connections, flood_items: the flooding client's concurrent requests and items per request.
        flood_lead: seconds the flood runs before the victim starts.
        ratio: the bar: victim p99 under the flood / idle p99.
    """

    served: ServedModel = ServedModel()
    max_batches: tuple[int, ...] = (32, 8)
    step_tokens: tuple[int | None, ...] = (None,)
    requests: int = 20
    flood_connections: int = 4
    flood_items: int = 256
    flood_lead: float = 2.0
    ratio: float = 3.0
