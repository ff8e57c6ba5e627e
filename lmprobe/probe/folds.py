"""Cross-validation folds, pure numpy: stratified and shuffled, or group-aware; the duplicate-text check.

Group-aware folds keep every row of a group (paraphrases of one item, the two sides of a contrast
pair, the tokens of one prompt) in one fold: groups are shuffled with the seed, then dealt largest
first to the fold with the fewest rows, so folds stay balanced.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..errors import ProbeError

logger = logging.getLogger(__name__)

Folds = list[tuple[np.ndarray, np.ndarray]]  # (train rows, test rows) per fold


def make_folds(y: np.ndarray, k: int, *, seed: int = 0, groups: np.ndarray | None = None,
               stratify: bool = True) -> Folds:
    """``k`` (train, test) row splits of ``len(y)`` rows; the same arguments give the same folds."""
    n = len(y)
    rng = np.random.default_rng(seed)
    fold_of = np.empty(n, dtype=np.int64)
    if groups is not None:
        uniq, inverse, sizes = np.unique(groups, return_inverse=True, return_counts=True)
        if k < 2 or len(uniq) < k:
            raise ProbeError(f"cv={k} group-aware folds need at least {k} groups; there are {len(uniq)}")
        order = rng.permutation(len(uniq))
        order = order[np.argsort(-sizes[order], kind="stable")]  # largest first, ties in shuffled order
        load = np.zeros(k, dtype=np.int64)
        group_fold = np.empty(len(uniq), dtype=np.int64)
        for g in order:
            f = int(np.argmin(load))
            group_fold[g] = f
            load[f] += sizes[g]
        fold_of = group_fold[inverse]
    elif stratify:
        classes, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
        if k < 2 or counts.min() < k:
            raise ProbeError(f"cv={k} folds need at least {k} prompts of every class; the smallest class has "
                             f"{counts.min()}")
        offset = 0
        for c in range(len(classes)):
            rows = rng.permutation(np.flatnonzero(inverse == c))
            fold_of[rows] = (np.arange(len(rows)) + offset) % k  # classes continue where the last left off
            offset += len(rows)
    else:
        if k < 2 or n < k:
            raise ProbeError(f"cv={k} folds need at least {k} rows; there are {n}")
        fold_of[rng.permutation(n)] = np.arange(n) % k
    return [(np.flatnonzero(fold_of != f), np.flatnonzero(fold_of == f)) for f in range(k)]


def straddling_duplicates(texts: Sequence[str], splits: Folds) -> int:
    """How many distinct texts occur on both the train and the test side of some split."""
    texts = np.asarray(texts, dtype=object)
    _, codes, counts = np.unique(texts, return_inverse=True, return_counts=True)
    if counts.max(initial=0) < 2:
        return 0
    both = np.zeros(len(counts), dtype=bool)
    for train, test in splits:
        both |= np.isin(np.arange(len(counts)), codes[test]) & np.isin(np.arange(len(counts)), codes[train])
    return int(both.sum())


def warn_duplicates(texts: Sequence[str], splits: Folds, where: str = "cross-validation folds") -> int:
    """One warning line when duplicated texts fall on both sides of a split; returns their count."""
    n = straddling_duplicates(texts, splits)
    if n:
        logger.warning("%s duplicated text(s) fall on both the train and the test side of the %s: their "
                       "scores are inflated; pass groups='text' to keep copies together, or deduplicate",
                       n, where)
    return n
