"""Scoring anything that predicts over the same folds: probes, baselines, ensembles.

A *fitter* takes (train rows, their targets) and returns a predictor; a predictor takes test rows
and returns (predictions, score), where score is the positive class's score (two classes), the
predicted value (regression) or None. Each metric is averaged over folds with its standard
deviation; ``bootstrap=N`` adds a 95% interval from N resamples of the pooled out-of-fold
predictions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .folds import Folds
from .methods import Fit
from .metrics import CLASSIFICATION, REGRESSION, classification_scores, regression_scores

Predictor = Callable[[np.ndarray], tuple[np.ndarray, Any]]
Fitter = Callable[[np.ndarray, np.ndarray], Predictor]  # (train row numbers, their targets) -> predictor


def metric_names(task: str) -> tuple[str, ...]:
    return REGRESSION if task == "regression" else CLASSIFICATION


def fit_predictor(fit: Fit) -> Predictor:
    """Predictions of a fitted linear map on raw features."""

    def predict(X: np.ndarray) -> tuple[np.ndarray, Any]:
        s = ((np.asarray(X, np.float32) - fit.mean) / fit.scale) @ fit.coef.T + fit.intercept  # (N, k)
        if not fit.classes:  # regression
            return s[:, 0], s[:, 0]
        classes = np.asarray(fit.classes)
        if s.shape[1] == 1:
            return classes[(s[:, 0] > 0).astype(int)], s[:, 0]
        return classes[s.argmax(axis=1)], None

    return predict


def score_predictions(task: str, classes: list, y: np.ndarray, pred: np.ndarray, score: Any) -> dict:
    if task == "regression":
        return regression_scores(y, pred)
    return classification_scores(y, pred, score, classes)


def cross_validate(fitter: Fitter, y: np.ndarray, folds: Folds, *, task: str, classes: list, bootstrap: int = 0,
                   seed: int = 0, test_rows: np.ndarray | None = None) -> dict:
    """``{metric: mean, metric_std: ..., [metric_lo, metric_hi], [test_metric]}`` over ``folds`` of ``y``'s rows.

    ``test_rows``: held-out rows, scored by a fit on every row of the folds."""
    per_fold, oof_y, oof_pred, oof_score = [], [], [], []
    for train, test in folds:
        pred, score = fitter(train, y[train])(test)
        per_fold.append(score_predictions(task, classes, y[test], pred, score))
        oof_y.append(y[test])
        oof_pred.append(pred)
        oof_score.append(score)
    out: dict = {}
    for name in metric_names(task):
        vals = np.array([f[name] for f in per_fold], dtype=np.float64)
        ok = vals[~np.isnan(vals)]  # a fold with one class has no AUROC: the others still count
        out[name] = float(ok.mean()) if len(ok) else float("nan")
        out[f"{name}_std"] = float(ok.std()) if len(ok) else float("nan")
    if bootstrap:
        yy, pp = np.concatenate(oof_y), np.concatenate(oof_pred)
        ss = None if any(s is None for s in oof_score) else np.concatenate(oof_score)
        rng = np.random.default_rng(seed)
        draws = {name: [] for name in metric_names(task)}
        for _ in range(bootstrap):
            i = rng.integers(0, len(yy), len(yy))
            res = score_predictions(task, classes, yy[i], pp[i], None if ss is None else ss[i])
            for name in draws:
                draws[name].append(res[name])
        for name, vals in draws.items():
            lo, hi = np.nanpercentile(vals, [2.5, 97.5]) if not np.all(np.isnan(vals)) else (np.nan, np.nan)
            out[f"{name}_lo"], out[f"{name}_hi"] = float(lo), float(hi)
    if test_rows is not None:
        train = np.concatenate([t for _, t in folds])
        pred, score = fitter(train, y[train])(test_rows)
        for name, v in score_predictions(task, classes, y[test_rows], pred, score).items():
            out[f"test_{name}"] = v
    return out
