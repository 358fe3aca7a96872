"""``prefixcache suggest``: which rows of an unlabelled pool to label next (features stored on disk, reused)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..types import DEFAULT_FEATURE
from .errors import choice, err, open_output, output_path, reported
from .loading import load, progress
from .options import BatchOpt, DtypeOpt, HeadOpt, IdFieldOpt, ModelOpt, TaskOpt, TextFieldOpt, ThreadsOpt

STRATEGY_HELP = "uncertain (needs a head: least sure rows, spread out), diverse (a cover of the pool), margin, random."


@reported
def suggest(
    pool: str = typer.Argument(..., help="Unlabelled rows: .csv, .jsonl, .parquet."),
    task: str = TaskOpt,
    head: Optional[Path] = HeadOpt,
    n: int = typer.Option(..., "--n", min=1, help="How many rows to suggest."),
    out_path: Path = typer.Option(..., "--out", help="Where to write the chosen rows (JSON Lines: each whole input row)."),
    strategy: Optional[str] = typer.Option(None, "--strategy", help=STRATEGY_HELP + " Default: uncertain with a head."),
    feature: str = typer.Option(DEFAULT_FEATURE, "--feature", help="Features to spread over without a head "
                                "(with a head: the head's)."),
    feature_cache: Optional[Path] = typer.Option(None, "--feature-cache", help="Folder of stored features "
                                                 "(default: $PREFIXCACHE_HOME/features); a second round reads them."),
    seed: int = typer.Option(0, "--seed", help="Seed of the k-means++ spreading."),
    text_field: str = TextFieldOpt,
    id_field: Optional[str] = IdFieldOpt,
    model: str = ModelOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    batch_size: int = BatchOpt,
):
    """Suggest N rows of POOL to label: with a head, the rows it is least sure of, kept diverse; without, a diverse
    cover. Rows the head was fitted on are never suggested. Each pool row is encoded once; later rounds read its
    features from --feature-cache."""
    import numpy as np

    from ..engine.head_file import check, head_for
    from ..eval.suggest import STRATEGIES, choose_rows, margins
    from ..io import records as data
    from ..model.load import cache_home
    from ..scheduler.feature_store import stored_features
    from ..task.definition import load_task
    from ..task.prompt import build_prompt

    from ..engine.features import FeatureSpec

    output_path(out_path, "--out")
    if feature_cache is not None and feature_cache.exists() and not feature_cache.is_dir():
        raise typer.BadParameter(f"{feature_cache} is a file, not a folder", param_hint="--feature-cache")
    FeatureSpec.parse(feature)  # a bad spec is refused before the model loads
    strategy = choice(strategy, STRATEGIES, "--strategy") if strategy else None
    spec = load_task(task)
    fitted = head_for(spec, head)
    records = [r for r in data.read_records(pool, text_field, id_field) if r.error is None]
    loaded = load(model, dtype, threads)
    if fitted is not None:
        check(fitted.manifest, loaded, build_prompt(spec, loaded.tokenizer), list(spec.labels), None)
    root = feature_cache or cache_home() / "features"
    with progress(len(records), "features") as bar:
        features, ran = stored_features(loaded, spec, records, root, feature=fitted or feature,
                                        batch_size=batch_size, progress=bar.update)
    logprobs = fitted.log_probs(features.features, features.prompt_logprobs).numpy() if fitted else None
    trained = set(fitted.manifest.get("training", {}).get("text_sha256", [])) if fitted else set()
    exclude = np.array([h in trained for h in features.text_hashes])
    chosen = choose_rows(features.features, n, logprobs, strategy=strategy, exclude=exclude, seed=seed)
    _write(out_path, records, features, chosen, logprobs, margins)
    err.print(f"{len(features.ids)} pool rows ({ran} encoded now, {len(features.ids) - ran} read from {root}); "
              f"{int(exclude.sum())} already fitted on; wrote {len(chosen)} rows to label to {out_path}")


def _write(out_path: Path, records, features, chosen, logprobs, margins) -> None:
    """Each chosen row's input fields, with the head's best guess and margin (when there is a head)."""
    from ..io.jsonl import write_line

    by_id = {r.id: r for r in records}
    gaps = margins(logprobs) if logprobs is not None else None
    with open_output(out_path, "w", "--out") as sink:
        for i in chosen:
            record = by_id[features.ids[i]]
            note = {"id": record.id}
            if gaps is not None:
                note |= {"best_guess": features.labels[int(logprobs[i].argmax())], "margin": round(float(gaps[i]), 6)}
            write_line(sink, {**record.fields, "prefixcache": note})
