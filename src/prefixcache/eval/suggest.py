"""Which unlabelled rows to label next: the ones a head is least sure of, spread over the feature space.

:func:`choose_rows` takes a pool's features ``[N, F]`` and, with a head, its label log-probs ``[N, L]``:

* **with a head** (``uncertain``): the ``CANDIDATES x n`` rows with the smallest top-two margin (the head's
  most confused rows), then ``n`` of them by k-means++ seeding over their standardized features
  (scikit-learn's ``kmeans_plusplus``): each next row is drawn with probability proportional to its squared
  distance from the rows already chosen, so 50 copies of one confusing ticket are not all picked;
* **with no head** (``diverse``): k-means++ seeding over the whole pool, a cover of the feature space;
* ``margin`` (the smallest margins, no spreading) and ``random`` are kept for comparison (``docs/accuracy.md``
  measures all four).

Rows in ``exclude`` (already labelled) are never chosen. The choice is deterministic for a seed.

This module runs no model: features come from :mod:`prefixcache.scheduler.feature_store`.
"""

from __future__ import annotations

import numpy as np
from sklearn.cluster import kmeans_plusplus
from sklearn.decomposition import PCA

STRATEGIES = ("uncertain", "diverse", "margin", "random")
CANDIDATES = 3  # with a head, k-means++ spreads n picks over the CANDIDATES x n least sure rows
DIMENSIONS = 64  # distances are taken over this many principal components of the standardized features


def margins(logprobs: np.ndarray) -> np.ndarray:
    """Top-two log-prob gap per row. ``[N, L]`` -> ``[N]``."""
    top = np.sort(np.asarray(logprobs, np.float64), axis=1)[:, -2:]
    return top[:, 1] - top[:, 0]


def _space(features: np.ndarray, seed: int) -> np.ndarray:
    """Standardized features, reduced to at most :data:`DIMENSIONS` principal components. ``[N, F]`` -> ``[N, D]``."""
    x = np.asarray(features, np.float64)
    x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-6)
    k = min(DIMENSIONS, x.shape[0], x.shape[1])
    return PCA(n_components=k, random_state=seed).fit_transform(x) if k < x.shape[1] else x


def _spread(space: np.ndarray, rows: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` of ``rows`` by k-means++ seeding over ``space[rows]``."""
    if n >= len(rows):
        return rows
    _, picked = kmeans_plusplus(space[rows], n_clusters=n, random_state=seed)
    return rows[picked]


def choose_rows(features: np.ndarray, n: int, logprobs: np.ndarray | None = None, *, strategy: str | None = None,
                exclude: np.ndarray | None = None, seed: int = 0) -> np.ndarray:
    """Indices of ``n`` rows of the pool to label (fewer if the pool has fewer), by ``strategy`` (default:
    ``uncertain`` with ``logprobs``, else ``diverse``).

    Raises:
        ValueError: an unknown strategy, or one that needs ``logprobs`` without them.
    """
    strategy = strategy or ("uncertain" if logprobs is not None else "diverse")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    if strategy in ("uncertain", "margin") and logprobs is None:
        raise ValueError(f"strategy {strategy!r} needs a head's label scores")
    allowed = np.flatnonzero(~exclude) if exclude is not None else np.arange(len(features))
    n = min(n, len(allowed))
    if strategy == "random":
        return np.sort(np.random.default_rng(seed).choice(allowed, size=n, replace=False))
    if strategy == "diverse":
        return np.sort(_spread(_space(features, seed), allowed, n, seed))
    by_margin = allowed[np.argsort(margins(logprobs)[allowed], kind="stable")]
    if strategy == "margin":
        return np.sort(by_margin[:n])
    return np.sort(_spread(_space(features, seed), by_margin[:CANDIDATES * n], n, seed))
