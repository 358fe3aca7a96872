"""The demo's fitted-head step: fit a label head on half the bundled tickets, score it on the other half."""

from __future__ import annotations

import sys

from rich.console import Console


def fitted_head_section(classifier, records: list, gold: dict, batch_size: int, out: Console, err: Console) -> dict:
    """Print the prompt's and a fitted head's accuracy on the tickets the head was not fitted on; their JSON.

    The split is stratified by label; a scored ticket never has a fitted ticket's normalized text
    (:func:`~prefixcache.eval.holdout.fit_and_score`).
    """
    from tqdm import tqdm

    from ..eval.holdout import fit_and_score

    with tqdm(total=len(records), desc="features for the fitted head", unit="rec", file=sys.stderr) as bar:
        result = fit_and_score(classifier.loaded, classifier.task, records, [gold[r.id] for r in records],
                               batch_size=batch_size, progress=bar.update)
    out.print(
        f"[bold]fitted head[/] (fitted on {result.fitted_rows} tickets, scored on the other {result.scored_rows}"
        + (f", {result.dropped} duplicates of fitted texts left out" if result.dropped else "")
        + f"): prompt {result.prompt.accuracy:.1%} -> head {result.head.accuracy:.1%} "
        f"(fit {result.fit.seconds:.1f} s; `prefixcache fit` writes such a head, docs/accuracy.md)"
    )
    return result.to_json()
