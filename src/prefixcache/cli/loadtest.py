"""``prefixcache loadtest``: `prefixcache serve` started on loopback and driven by concurrent clients.

The command itself runs the plain lane (micro-batched against ``--max-batch 1``; ``--openai``: the classify route
against the OpenAI-compatible chat route; ``--soak SECONDS``: one server, three tasks, for that long); ``mixed``,
``peer`` and ``fairness`` are its subcommands. Every default is :mod:`prefixcache.bench.loadtest.options`'.
Exit code 0 when the lane passes, 1 when it fails, 2 for a usage error (found before any server starts).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import typer

from ..bench.loadtest.options import FairnessOptions, LoadTestOptions, MixedOptions, PeerOptions, ServedModel
from ..errors import ExtraNotInstalledError
from ..model.catalog import DEFAULT_MODEL, DTYPE_CHOICES
from ..types import BACKENDS
from .errors import choice, output_path, parsed, reported
from .options import DtypeOpt, ModelOpt, ThreadsOpt

PLAIN, MIXED, PEER, FAIR = LoadTestOptions(), MixedOptions(), PeerOptions(), FairnessOptions()

loadtest_app = typer.Typer(
    no_args_is_help=False,
    subcommand_metavar="[mixed|peer|fairness] [OPTIONS]...",
    help="Load tests of `prefixcache serve` on loopback ports, checked and timed: micro-batched against --max-batch 1 "
    "(or --openai, or --soak SECONDS); the other lanes are mixed, peer and fairness.",
)
LANES, OTHER_LANES = "Lanes (instead of micro-batched against --max-batch 1)", "Other lanes"

TaskOpt = typer.Option(PLAIN.task, "--task", help="A bundled task name or a YAML path.")
JsonOpt = typer.Option(None, "--json", help="Also write the figures as JSON here.")
ServerThreadsOpt = typer.Option(None, "--threads", min=1, help="Torch threads in the server (default: all cores).")
CLIENTS = typer.Option(PLAIN.clients, "--clients", min=1, help="Concurrent clients, one keep-alive connection each.")
REQUESTS = typer.Option(PLAIN.requests, "--requests", min=1, help="Measured requests per lane.")
ITEMS = typer.Option(PLAIN.items_per_request, "--items-per-request", min=1, help="Items in each request.")
DISTINCT = typer.Option(PLAIN.distinct, "--distinct", min=1, help="Distinct tickets, cycled over the requests "
                        "(each item keeps a unique id).")
MAX_BATCH = typer.Option(PLAIN.max_batch, "--max-batch", min=1, help="The micro-batched server's --max-batch.")
STEP_TOKENS = typer.Option(None, "--max-step-tokens", min=1, help="The servers' --max-step-tokens (default: serve's).")
ROUNDS = typer.Option(PLAIN.rounds, "--rounds", min=1,
                      help="Alternating rounds per lane (A B, B A, ...), against load drift.")
TOLERANCE = typer.Option(
    None, "--tolerance", min=0.0, help="Largest |probability difference| counted as equal (default: 1e-4 in float32; "
    "0.1 in bfloat16, whose rounding differs with the rows in a pass)."
)
NEAR_TIE = typer.Option(
    None, "--near-tie", min=0.0, help="A reference margin (log-prob) at or below this is a near tie: a changed label "
    "there is flagged, not failed (default: twice the lane's max |log-prob difference| over the responses whose "
    "label did not change: its numerical noise)."
)
TARGET = typer.Option(PLAIN.target, "--target", min=0.0, help="Required throughput ratio, micro-batched / one at a time.")
OPENAI = typer.Option(
    False, "--openai", help="Lane: POST /v1/classify against the OpenAI-compatible chat route (guided_choice, the "
    "official openai client) on the same task, both micro-batched; the target becomes --openai-target.",
    rich_help_panel=LANES,
)
OPENAI_TARGET = typer.Option(PLAIN.openai_target, "--openai-target", min=0.0,
                             help="Required ratio, openai items/s / classify items/s.")
SOAK = typer.Option(
    None, "--soak", min=1.0, metavar="SECONDS", help="Lane: a soak of this many seconds instead: --clients clients "
    "over three tasks, with a pool budget that holds two of their prefixes; RSS, errors and latency per minute.",
    rich_help_panel=LANES,
)


def needs(modules: tuple[str, ...], extra: str, what: str) -> None:
    """A clear error, before any server starts, when ``what`` needs an extra that is not installed here."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ExtraNotInstalledError(f"{what} needs the '{extra}' extra ({missing[0]} is missing): "
                                     f"pip install 'prefixcache[{extra}]'")


def served_model(model: str, dtype: str, threads: Optional[int], task: Optional[str] = None) -> ServedModel:
    """The model (and task) every lane's servers run, checked here, before any server starts."""
    from ..bench.loadtest.served import check_model
    from ..task.definition import load_task

    needs(("fastapi", "uvicorn"), "serve", "a load test's server")
    served = ServedModel(model, choice(dtype, DTYPE_CHOICES, "--dtype"), threads)
    if task is not None:
        load_task(task)
    check_model(model)
    return served


def outcome(ok: bool) -> None:
    raise typer.Exit(0 if ok else 1)


@loadtest_app.callback(invoke_without_command=True)
@reported
def loadtest(
    ctx: typer.Context,
    model: str = ModelOpt,
    task: str = TaskOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ServerThreadsOpt,
    clients: int = CLIENTS,
    requests: int = REQUESTS,
    items_per_request: int = ITEMS,
    distinct: int = DISTINCT,
    max_batch: int = MAX_BATCH,
    max_step_tokens: Optional[int] = STEP_TOKENS,
    rounds: int = ROUNDS,
    tolerance: Optional[float] = TOLERANCE,
    near_tie: Optional[float] = NEAR_TIE,
    target: float = TARGET,
    openai: bool = OPENAI,
    openai_target: float = OPENAI_TARGET,
    soak: Optional[float] = SOAK,
    json_path: Optional[Path] = JsonOpt,
):
    """Micro-batched against one item per pass (or --openai, or --soak), every answer checked against the
    sequential in-process result; passes with no errors and the throughput ratio at --target."""
    if ctx.invoked_subcommand is not None:
        return
    if openai and soak is not None:
        raise typer.BadParameter("--openai and --soak are two lanes: choose one", param_hint="--soak")
    output_path(json_path, "--json")
    if openai:
        needs(("openai",), "test", "--openai")
    options = LoadTestOptions(
        served_model(model, dtype, threads, task), task, clients, requests, items_per_request, distinct, max_batch,
        max_step_tokens, rounds, tolerance, near_tie, target, openai, openai_target, str(json_path) if json_path else None,
    )
    if soak is not None:
        from ..bench.loadtest.soak import run_soak

        outcome(run_soak(options, soak))
    from ..bench.loadtest.batching import run_loadtest

    outcome(run_loadtest(options))


@loadtest_app.command(rich_help_panel=OTHER_LANES)
@reported
def mixed(
    model: str = ModelOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ServerThreadsOpt,
    baseline_src: Optional[Path] = typer.Option(
        None, "--baseline-src", help="Another checkout's src/ folder, run as a baseline lane after this one."
    ),
    extract_clients: int = typer.Option(MIXED.extract_clients, "--extract-clients", min=1,
                                        help="Closed-loop extraction clients."),
    classify_clients: int = typer.Option(MIXED.classify_clients, "--classify-clients", min=1,
                                         help="Closed-loop classification clients."),
    seconds: float = typer.Option(MIXED.seconds, "--seconds", min=1.0, help="Length of the mixed phase per lane."),
    idle: int = typer.Option(MIXED.idle, "--idle", min=1, help="One-item classifications timed on the idle server first."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every lane's samples here."),
):
    """Extraction and one-item classification clients on one server at once: extraction requests/s, and the
    classification p99 under that load against its idle p99 (with --baseline-src, beside another checkout)."""
    from ..bench.loadtest.mixed import run_mixed

    if baseline_src is not None and not baseline_src.is_dir():
        raise typer.BadParameter(f"{baseline_src} is not a folder; pass a checkout's src/", param_hint="--baseline-src")
    output_path(json_path, "--json")
    served = served_model(model, dtype, threads)
    outcome(run_mixed(MixedOptions(served, str(baseline_src) if baseline_src else None, extract_clients,
                                   classify_clients, seconds, idle, str(json_path) if json_path else None)))


@loadtest_app.command(rich_help_panel=OTHER_LANES)
@reported
def peer(
    llama_server: Optional[str] = typer.Option(
        None, "--llama-server", help="llama.cpp's llama-server binary (default: $LLAMA_SERVER, else one on PATH); "
        "without one here, its lane is skipped and says so."
    ),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="The .gguf both servers run (default: the embedded model's)."),
    task: str = typer.Option(PEER.task, "--task", help="The classification task (labels, prompt, examples)."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threads for both servers (default: all cores)."),
    requests: int = typer.Option(PEER.requests, "--requests", min=1, help="Chats per workload."),
    clients: int = typer.Option(PEER.clients, "--clients", min=1,
                                help="Closed-loop clients (the official openai client each)."),
    json_path: Optional[Path] = JsonOpt,
    backend: list[str] = typer.Option(list(PEER.backends), "--backend",
                                      help="prefixcache's generation backend (serve --backend); repeat for one server "
                                      "each: --backend torch --backend llama.cpp."),
):
    """`prefixcache serve` against llama.cpp's llama-server on the same .gguf, one after the other, over the OpenAI
    chat API: classification (guided_choice / a GBNF grammar) and extraction (a json_schema response_format)."""
    from ..bench.loadtest.peer import run_peer

    output_path(json_path, "--json")
    needs(("openai",), "test", "the peer lane")
    if gguf is not None and not gguf.is_file():
        raise typer.BadParameter(f"{gguf}: no such .gguf file", param_hint="--gguf")
    served_model(str(gguf) if gguf else DEFAULT_MODEL, dtype, threads, task)
    backends = tuple(choice(name, BACKENDS, "--backend") for name in backend)
    outcome(run_peer(PeerOptions(llama_server, str(gguf) if gguf else None, task, dtype, threads, requests, clients,
                                 str(json_path) if json_path else None, backends)))


def whole_numbers(text: str) -> tuple[int, ...]:
    """``"32,8"`` -> ``(32, 8)``: comma-separated whole numbers of at least 1."""
    try:
        values = tuple(int(value) for value in text.split(",") if value.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{text!r}: give whole numbers of at least 1, separated by commas")
    return values


@loadtest_app.command(rich_help_panel=OTHER_LANES)
@reported
def fairness(
    model: str = ModelOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ServerThreadsOpt,
    max_batch: str = typer.Option(",".join(map(str, FAIR.max_batches)), "--max-batch", help="Comma-separated "
                                  "--max-batch values, one server each."),
    max_step_tokens: str = typer.Option("", "--max-step-tokens", help="Comma-separated --max-step-tokens values, one "
                                        "server each per --max-batch (default: the server's own)."),
    requests: int = typer.Option(FAIR.requests, "--requests", min=1, help="The victim's requests per lane."),
    flood_connections: int = typer.Option(FAIR.flood_connections, "--flood-connections", min=1,
                                          help="The flooding client's concurrent requests."),
    flood_items: int = typer.Option(FAIR.flood_items, "--flood-items", min=1, help="Items per flood request."),
    flood_lead: float = typer.Option(FAIR.flood_lead, "--flood-lead", min=0.0,
                                     help="Seconds the flood runs before the victim starts."),
    ratio: float = typer.Option(FAIR.ratio, "--ratio", min=1.0,
                                help="The bar: the victim's p99 under the flood / its idle p99."),
):
    """One client floods the server (from 127.0.0.2); another's one-item requests (from 127.0.0.3) are timed idle
    and under the flood; passes when that p99 stays within --ratio x the idle p99 and nothing failed."""
    from ..bench.loadtest.fairness import run_fairness

    batches = parsed(whole_numbers, max_batch, "--max-batch")
    steps = parsed(whole_numbers, max_step_tokens, "--max-step-tokens") if max_step_tokens.strip() else (None,)
    served = served_model(model, dtype, threads)
    outcome(run_fairness(FairnessOptions(served, batches, steps, requests, flood_connections, flood_items, flood_lead,
                                         ratio)))
