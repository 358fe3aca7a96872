"""Every option the CLI documents (``prefixcache CMD --help``), given a bad value, is a clean usage error.

The cases are found by walking the real typer app, so a new command or option fails
:func:`test_every_option_has_a_bad_value_case` until it gets a case in :data:`BAD`. Each case runs
the real command through typer's CliRunner on a tiny model and asserts exit code 2 (1 where a bad
value is documented to fail records, not the run), a message naming the problem, and no traceback.
"""

from __future__ import annotations

import json
import typing

import pytest
import typer.main
from typer.testing import CliRunner

from prefixcache.cli.app import app

from tests.support.models import save_tiny_model
from tests.support.tasks import EXTRACT_YAML, TASK_YAML, TEXTS

runner = CliRunner()
NOWHERE = "/nonexistent-folder/out"  # a path whose folder does not exist

# (command, option) -> (bad value, the words the message must hold, exit code). ``{file}`` is an existing
# file, where a folder is wanted. None: the option takes any value (no bad one exists).
ANY = {
    "--task": ("no-such-task", "no-such-task", 2),
    "--model": ("/nonexistent-folder/model.gguf", "no such .gguf file", 2),
    "--mode": ("sideways", "--mode must be one of", 2),
    "--batch-size": ("0", "--batch-size", 2),
    "--method": ("guess", "--method must be one of", 2),
    "--text-field": ("nope", "no row has a field 'nope'", 2),
    "--id-field": ("nope", "'nope'", 2),
    "--dtype": ("float8", "--dtype must be one of", 2),
    "--threads": ("0", "--threads", 2),
    "--cache-budget": ("12XB", "not a size", 2),
    "--cache-dir": ("{file}", "is a file", 2),
    "--cache-dir-budget": ("12XB", "not a size", 2),
    "--kv-storage": ("int4", "--kv-storage must be one of", 2),
    "--eviction": ("random", "--eviction must be one of", 2),
    "--out": (f"{NOWHERE}/out.jsonl", "is not a folder", 2),
    "input": ("no-such-input.jsonl", "no-such-input.jsonl", 2),
}
BAD = {
    **{("classify", option): case for option, case in ANY.items()},
    ("classify", "--id-field"): ("nope", "'nope'", 1),
    ("classify", "--on-error"): ("ignore", "--on-error must be one of", 2),
    ("classify", "--overflow"): ("wrap", "--overflow must be one of", 2),
    ("classify", "--window"): ("0", "--window", 2),
    ("classify", "--ray-address"): ("auto", "--ray-address needs --ray", 2),
    ("classify", "--workers"): ("0", "--workers", 2),
    ("classify", "--num-gpus"): ("-1", "--num-gpus", 2),
    **{("verify", option): case for option, case in ANY.items() if option != "--out"},
    ("verify", "--mode"): ("full", "--mode must be one of cached, batched", 2),
    **{("extract", option): case for option, case in ANY.items() if option != "--method"},
    ("extract", "--max-new-tokens"): ("0", "--max-new-tokens", 2),
    ("extract", "--backend"): ("ggml", "--backend must be one of auto, torch, llama.cpp", 2),
    ("extract", "--id-field"): ("nope", "'nope'", 1),  # like classify: each row an error line naming it, exit 1
    **{("eval", option): ANY[option] for option in ("input", "--task", "--model", "--batch-size", "--method",
                                                    "--text-field", "--id-field", "--dtype", "--threads")},
    ("eval", "--label-field"): ("nope", "no gold label in field 'nope'", 2),
    ("eval", "--content-free"): None,  # any text is a content-free input
    ("eval", "--sweep-examples"): ("0,x", "whole numbers", 2),
    ("eval", "--seed"): ("x", "--seed", 2),
    ("eval", "--plot"): (f"{NOWHERE}/plot.png", "is not a folder", 2),
    **{("demo", option): ANY[option] for option in ("--model", "--dtype", "--threads", "--batch-size")},
    ("demo", "--subset"): ("0", "--subset", 2),
    ("demo", "--out-dir"): ("{file}", "is a file", 2),
    **{("bench", option): ANY[option] for option in ("--task", "--model", "--dtype", "--threads", "--batch-size")},
    ("bench", "--items"): ("0", "--items", 2),
    ("bench", "--model-config"): ("gpt-5", "unknown --model-config 'gpt-5'", 2),  # with --random-weights
    ("bench", "--json"): (f"{NOWHERE}/bench.json", "is not a folder", 2),
    ("bench", "--plot"): (f"{NOWHERE}/bench.png", "is not a folder", 2),
    ("bench", "--sweep-plot"): (f"{NOWHERE}/sweep.png", "is not a folder", 2),
    ("bench", "--head"): ("/nonexistent-folder/head.safetensors", "does not exist", 2),  # or `fit`: fits one
    ("bench", "--records"): ("/nonexistent-folder/rows.csv", "no such input file", 2),
    ("bench", "--label-field"): None,  # any name: it matters only to --head fit, which names a record without a gold label
    ("bench", "--full-items"): ("0", "--full-items", 2),
    ("bench", "--before-batch-size"): ("0", "--before-batch-size", 2),
    ("bench", "--ray-workers"): ("0", "--ray-workers", 2),
    **{("serve", option): ANY[option] for option in ("--task", "--model", "--dtype", "--threads", "--method", "--cache-budget")},
    ("loadtest peer", "--backend"): ("ggml", "--backend must be one of auto, torch, llama.cpp", 2),
    ("bench", "--backend"): ("ggml", "--backend must be one of auto, torch, llama.cpp", 2),
    ("serve", "--backend"): ("ggml", "--backend must be one of auto, torch, llama.cpp", 2),
    ("serve", "--host"): ("256.256.256.256", "cannot listen on 256.256.256.256", 2),
    ("serve", "--port"): ("70000", "--port", 2),
    ("serve", "--max-batch"): ("0", "--max-batch", 2),
    ("serve", "--max-step-tokens"): ("0", "--max-step-tokens", 2),
    ("serve", "--max-queue"): ("0", "--max-queue", 2),
    ("serve", "--max-queue-per-client"): ("0", "--max-queue-per-client", 2),
    ("serve", "--max-items"): ("0", "--max-items", 2),
    ("serve", "--max-item-tokens"): ("0", "--max-item-tokens", 2),
    ("serve", "--max-body-bytes"): ("0", "--max-body-bytes", 2),
    ("serve", "--max-prefix-tokens"): ("0", "--max-prefix-tokens", 2),
    **{("serve", option): ("0", option, 2) for option in ("--max-task-bytes", "--max-labels", "--max-examples", "--max-tasks",
                                                                "--max-choice-chars", "--max-choice-tokens")},
    ("serve", "--log-level"): ("loud", "--log-level must be one of", 2),
    ("serve", "--head"): ("/nonexistent-folder/head.safetensors", "does not exist", 2),
    ("demo", "--json"): (f"{NOWHERE}/demo.json", "is not a folder", 2),
    **{(command, "--head"): ("/nonexistent-folder/head.safetensors", "does not exist", 2)
       for command in ("classify", "verify", "eval")},
    **{("fit", option): ANY[option] for option in ("input", "--task", "--model", "--dtype", "--threads", "--batch-size",
                                                   "--id-field", "--out")},
    ("fit", "--text-field"): ("nope", "missing field 'text'", 2),  # fit names every row that cannot run
    ("fit", "--label-field"): ("nope", "no gold label in field 'nope'", 2),
    ("fit", "--feature"): ("first", "is not one of last, mean", 2),
    ("fit", "--folds"): ("1", "--folds", 2),
    ("fit", "--curve"): ("1,x", "rows per label", 2),
    ("fit", "--seed"): ("x", "--seed", 2),
    ("fit", "--plot"): (f"{NOWHERE}/fit.png", "is not a folder", 2),
    ("fit", "--tune"): ("lora", "is not one of head, prefix", 2),
    ("fit", "--epochs"): ("0", "--epochs", 2),
    ("fit", "--lr"): ("-1", "--lr", 2),
    ("fit", "--virtual-tokens"): ("1", "--virtual-tokens", 2),
    ("classify", "--calibration"): ("/nonexistent-folder/cal.json", "cannot be read", 2),
    ("classify", "--min-confidence"): ("2", "--min-confidence", 2),
    ("classify", "--target-accuracy"): ("2", "--target-accuracy", 2),
    ("classify", "--review-out"): (f"{NOWHERE}/review.jsonl", "is not a folder", 2),
    ("classify", "--keep-fields"): ("a,,b", "has an empty name", 2),
    **{("suggest", option): ANY[option] for option in ("input", "--task", "--model", "--dtype", "--threads", "--batch-size",
                                                       "--id-field", "--out")},
    ("suggest", "--text-field"): ("nope", "none of the 3 records can be run", 2),
    ("suggest", "--head"): ("/nonexistent-folder/head.safetensors", "does not exist", 2),
    ("suggest", "--n"): ("0", "--n", 2),
    ("suggest", "--strategy"): ("best", "--strategy must be one of", 2),
    ("suggest", "--feature"): ("first", "is not one of last, mean", 2),
    ("suggest", "--feature-cache"): ("{file}", "is a file", 2),
    ("suggest", "--seed"): ("x", "--seed", 2),
    # the field options of eval: the base task classifies, so any value is refused as not applying
    ("eval", "--field-head"): ("x=/nonexistent-folder/head.safetensors", "extraction task's fields only", 2),
    ("eval", "--min-confidence"): ("x=0.5", "--min-confidence", 2),
    ("eval", "--target-accuracy"): ("2", "--target-accuracy", 2),
    ("fit", "--field"): ("nope", "is a classification task", 2),
    ("extract", "--head"): ("nope", "does not exist", 2),  # a bare file is a tuned prefix's head file; FIELD=FILE a field's
    ("extract", "--min-confidence"): ("sentiment=x", "--min-confidence", 2),
    ("extract", "--review"): (f"{NOWHERE}/review.jsonl", "cannot write", 2),
    ("cache ls", "--cache-dir"): ("/nonexistent-folder/cache", "no such cache folder", 2),
    ("cache clear", "--cache-dir"): ("/nonexistent-folder/cache", "no such cache folder", 2),
    # every loadtest lane checks its values before it starts a server
    **{("loadtest", option): ANY[option] for option in ("--task", "--model", "--dtype", "--threads")},
    **{("loadtest", option): ("0", option, 2) for option in ("--clients", "--requests", "--items-per-request",
                                                             "--distinct", "--max-batch", "--max-step-tokens", "--rounds")},
    **{("loadtest", option): ("-1", option, 2) for option in ("--tolerance", "--near-tie", "--target", "--openai-target")},
    ("loadtest", "--soak"): ("0", "--soak", 2),
    ("loadtest", "--json"): (f"{NOWHERE}/loadtest.json", "is not a folder", 2),
    **{("loadtest mixed", option): ANY[option] for option in ("--model", "--dtype", "--threads")},
    ("loadtest mixed", "--baseline-src"): ("/nonexistent-folder/src", "is not a folder", 2),
    **{("loadtest mixed", option): ("0", option, 2) for option in ("--extract-clients", "--classify-clients", "--seconds",
                                                                   "--idle")},
    ("loadtest mixed", "--json"): (f"{NOWHERE}/mixed.json", "is not a folder", 2),
    ("loadtest peer", "--llama-server"): None,  # any path: without a binary there, that lane is skipped and says so
    ("loadtest peer", "--gguf"): ("/nonexistent-folder/model.gguf", "no such .gguf file", 2),
    **{("loadtest peer", option): ANY[option] for option in ("--task", "--dtype", "--threads")},
    **{("loadtest peer", option): ("0", option, 2) for option in ("--requests", "--clients")},
    ("loadtest peer", "--json"): (f"{NOWHERE}/peer.json", "is not a folder", 2),
    **{("loadtest fairness", option): ANY[option] for option in ("--model", "--dtype", "--threads")},
    ("loadtest fairness", "--max-batch"): ("32,x", "whole numbers", 2),
    ("loadtest fairness", "--max-step-tokens"): ("0", "whole numbers", 2),
    **{("loadtest fairness", option): ("0", option, 2) for option in ("--requests", "--flood-connections", "--flood-items")},
    ("loadtest fairness", "--flood-lead"): ("-1", "--flood-lead", 2),
    ("loadtest fairness", "--ratio"): ("0.5", "--ratio", 2),
}


def documented_options() -> list[tuple[str, str, bool]]:
    """(command, option, takes a number) for every non-flag parameter of every command, from the app itself."""
    found = []

    def add(command, name: str) -> None:
        for param in command.params:
            if getattr(param, "is_flag", False):
                continue
            option = param.opts[0] if param.opts[0].startswith("-") else "input"
            annotation = param.type_descriptor.annotation  # typer's own record of the declared type
            numeric = annotation in (int, float) or bool({int, float} & set(typing.get_args(annotation)))
            found.append((name, option, numeric))

    def walk(group, prefix: str) -> None:
        for name, command in group.commands.items():
            add(command, f"{prefix}{name}")  # a group's own options too: `loadtest` runs its plain lane
            if hasattr(command, "commands"):
                walk(command, f"{prefix}{name} ")

    walk(typer.main.get_command(app), "")
    return found


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny model, a classification and an extraction task, and inputs; the base arguments of each command."""
    root = tmp_path_factory.mktemp("cli-options")
    model_dir = save_tiny_model(tmp_path_factory, "qwen2")
    (root / "task.yaml").write_text(TASK_YAML)
    (root / "extract.yaml").write_text(EXTRACT_YAML)
    rows = [{"id": f"r{i}", "body": t, "label": "billing"} for i, t in enumerate(TEXTS[:3])]
    (root / "in.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "a-file").write_text("not a folder")
    model = ["--model", model_dir, "--dtype", "float32", "--threads", "1"]
    task = ["--task", str(root / "task.yaml")]
    source = [str(root / "in.jsonl"), "--text-field", "body", "--id-field", "id"]
    return {
        "file": str(root / "a-file"),
        "base": {
            "classify": [*source, *task, *model],
            "verify": [*source, *task, *model],
            "extract": [*source, "--task", str(root / "extract.yaml"), *model],
            "eval": [*source, *task, *model],
            "fit": [*source, *task, "--out", str(root / "head.safetensors"), *model],
            "suggest": [*source, *task, *model, "--n", "2", "--out", str(root / "suggested.jsonl"),
                        "--feature-cache", str(root / "features")],
            "demo": [*model, "--out-dir", str(root / "demo")],
            "bench": [*task, *model, "--items", "2", "--no-llama-cpp"],
            "serve": [*task, *model, "--port", "0"],
            "cache ls": ["--cache-dir", str(root)],
            "cache clear": ["--cache-dir", str(root / "empty-cache")],
            "loadtest": [*task, *model],
            "loadtest mixed": model,
            "loadtest peer": ["--threads", "1"],
            "loadtest fairness": model,
        },
    }


def with_option(args: list[str], option: str, value: str) -> list[str]:
    """``args`` with ``option`` set to ``value`` (replacing its value there, or appended; ``input`` is the argument)."""
    if option == "input":
        return [value, *args[1:]]
    if option in args:
        at = args.index(option)
        return [*args[:at], option, value, *args[at + 2:]]
    return [*args, option, value]


def invoke(command: str, args: list[str]):
    return runner.invoke(app, [*command.split(), *args])


def assert_clean(result, code: int, words: str) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"a traceback instead of a message: {result.exception!r}\n{result.output}"
    )
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == code, f"exit code {result.exit_code}, not {code}:\n{result.output}"
    assert words in " ".join(result.output.split()), f"the message does not say {words!r}:\n{result.output}"


def test_every_option_has_a_bad_value_case():
    missing = [(c, o) for c, o, _ in documented_options() if (c, o) not in BAD]
    assert not missing, f"options without a bad-value case (add one to BAD): {missing}"


@pytest.mark.parametrize(("command", "option"), [(c, o) for c, o, _ in documented_options() if BAD.get((c, o))])
def test_a_bad_value_is_a_usage_error(setup, command, option):
    value, words, code = BAD[(command, option)]
    value = value.format(file=setup["file"])
    args = with_option(setup["base"][command], option, value)
    if (command, option) == ("bench", "--model-config"):
        args.append("--random-weights")
    assert_clean(invoke(command, args), code, words)


@pytest.mark.parametrize(("command", "option"), [(c, o) for c, o, numeric in documented_options() if numeric])
def test_a_number_option_refuses_text(setup, command, option):
    args = with_option(setup["base"][command], option, "many")
    assert_clean(invoke(command, args), 2, option)
