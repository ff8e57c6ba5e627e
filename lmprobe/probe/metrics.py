"""Scores of a probe's predictions, in numpy: accuracy, AUROC, F1, precision, recall, recall at 1% FPR, R^2.

Binary metrics take the second class (the larger label) as positive; with more classes F1,
precision and recall are macro averages and AUROC and recall at a fixed FPR are NaN. Each is
checked against scikit-learn's in tests/probe/test_probe_metrics.py.
"""

from __future__ import annotations

import numpy as np

CLASSIFICATION = ("accuracy", "auroc", "f1", "precision", "recall", "recall_at_1fpr")
REGRESSION = ("r2",)


def auroc(y_pos: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve: the Mann-Whitney statistic with ties counted half."""
    y_pos = np.asarray(y_pos, bool)
    n1, n0 = int(y_pos.sum()), int((~y_pos).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    s = np.asarray(score)[order]
    ranks = np.empty(len(s))
    # average ranks over ties
    _, start, counts = np.unique(s, return_index=True, return_counts=True)
    avg = start + (counts + 1) / 2
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[y_pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def recall_at_fpr(y_pos: np.ndarray, score: np.ndarray, fpr: float = 0.01) -> float:
    """The fraction of positives scored above the threshold that lets through at most ``fpr`` of the negatives."""
    y_pos = np.asarray(y_pos, bool)
    neg, posv = np.sort(np.asarray(score)[~y_pos]), np.asarray(score)[y_pos]
    if len(neg) == 0 or len(posv) == 0:
        return float("nan")
    allowed = int(np.floor(fpr * len(neg)))  # negatives allowed above the threshold
    threshold = neg[len(neg) - 1 - allowed]  # strictly above this
    return float(np.mean(posv > threshold))


def classification_scores(y: np.ndarray, pred: np.ndarray, score: np.ndarray | None, classes: list) -> dict:
    """Every classification metric of one set of predictions (``score``: the positive class's, binary only)."""
    y, pred = np.asarray(y), np.asarray(pred)
    out = {"accuracy": float(np.mean(pred == y))}
    if len(classes) == 2:
        tp = float(np.sum((pred == classes[1]) & (y == classes[1])))
        fp = float(np.sum((pred == classes[1]) & (y != classes[1])))
        fn = float(np.sum((pred != classes[1]) & (y == classes[1])))
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        y_pos = y == classes[1]
        out.update(auroc=auroc(y_pos, score) if score is not None else float("nan"),
                   f1=2 * precision * recall / (precision + recall) if precision + recall else 0.0,
                   precision=precision, recall=recall,
                   recall_at_1fpr=recall_at_fpr(y_pos, score) if score is not None else float("nan"))
    else:
        ps, rs, fs = [], [], []
        for c in classes:
            tp = float(np.sum((pred == c) & (y == c)))
            p = tp / float(np.sum(pred == c)) if np.any(pred == c) else 0.0
            r = tp / float(np.sum(y == c)) if np.any(y == c) else 0.0
            ps.append(p)
            rs.append(r)
            fs.append(2 * p * r / (p + r) if p + r else 0.0)
        out.update(auroc=float("nan"), f1=float(np.mean(fs)), precision=float(np.mean(ps)),
                   recall=float(np.mean(rs)), recall_at_1fpr=float("nan"))
    return out


def r2(y: np.ndarray, pred: np.ndarray) -> float:
    y, pred = np.asarray(y, np.float64), np.asarray(pred, np.float64)
    ss = float(np.sum((y - y.mean()) ** 2))
    return float(1 - np.sum((y - pred) ** 2) / ss) if ss > 0 else float("nan")


def regression_scores(y: np.ndarray, pred: np.ndarray) -> dict:
    return {"r2": r2(y, pred)}
