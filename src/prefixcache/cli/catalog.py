"""``prefixcache tasks`` and ``prefixcache models``: what ``--task`` and ``--model`` accept. Neither loads a model."""

from __future__ import annotations

from rich.table import Table

from ..model.catalog import DEFAULT_MODEL, EMBEDDED
from .errors import reported, out


@reported
def tasks():
    """List the bundled tasks."""
    from ..task.selection import resolve_examples
    from ..task.definition import ExtractTask, bundled_task_names, load_any_task

    table = Table(title="bundled tasks (pass --task NAME or --task path/to/task.yaml)")
    for col in ("name", "kind", "labels / fields", "examples", "input template"):
        table.add_column(col)
    for name in bundled_task_names(kinds=("classify", "extract")):
        spec = load_any_task(name)
        if isinstance(spec, ExtractTask):
            table.add_row(name, "extract", ", ".join(spec.fields), str(len(spec.examples)), spec.input_template)
        else:
            shown = len(resolve_examples(spec).examples)
            table.add_row(name, "classify", ", ".join(spec.labels), str(shown), spec.input_template)
    out.print(table)


def models():
    """List the embedded models and the other accepted --model forms."""
    table = Table(title="models")
    table.add_column("--model")
    table.add_column("what")
    for name, entry in EMBEDDED.items():
        table.add_row(name + (" (default)" if name == DEFAULT_MODEL else ""), entry.description)
    table.add_row("path/to/model.gguf", "any llama.cpp GGUF that transformers can dequantize")
    table.add_row("Qwen/Qwen2.5-0.5B-Instruct", "a Hugging Face id (needs the hub or its local cache)")
    table.add_row("path/to/folder", "a local Hugging Face model folder")
    out.print(table)
