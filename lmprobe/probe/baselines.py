"""Baselines a probe must beat, scored on the probe's own folds (0.10.3's ``BaselineBattery``, and more).

=================== ======================================================================
baseline            what it predicts from
=================== ======================================================================
majority            the most frequent training label (regression: the training mean)
shuffled_labels     the probe's method, at its layer, trained on permuted labels
random_direction    a random unit direction at the probe's layer, sign and threshold fitted
text_length         characters, words and tokens of the prompt (a logistic / ridge fit)
bag_of_words        TF-IDF of the text, then logistic / ridge (scikit-learn)
layer_0             the probe's method on layer 0, the embeddings (when stored)
perplexity          the prompt's mean perplexity (when extracted with --perplexity)
=================== ======================================================================

A baseline that cannot run here (no scikit-learn, layer 0 or perplexity not stored) keeps its
row with NaN scores and a ``note`` saying why. A probe whose score is no better than the best row
beats no baseline: ``sweep(..., baselines=True)`` marks it ``beats_baselines = False``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .crossval import cross_validate, fit_predictor, metric_names
from .folds import Folds
from .inputs import LayerArg, ProbeData
from .methods import fit, has_sklearn, resolve_sign, unit

BASELINES = ("majority", "shuffled_labels", "random_direction", "text_length", "bag_of_words", "layer_0", "perplexity")


def baseline_table(data: ProbeData, folds: Folds, *, layer: LayerArg, method: Any = "logistic", seed: int = 0,
                   C: float = 1.0, test_rows: np.ndarray | None = None):
    """One row per baseline, scored on ``folds`` of ``data`` (what ``sweep`` and ``baselines`` share)."""
    import pandas as pd

    task, y, classes = data.task, data.y, data.classes
    sk = has_sklearn()
    text_method = ("ridge" if task == "regression" else "logistic") if sk else "mass_mean"
    rows = []

    def run(name: str, fitter, n_features: int, note: str = "") -> None:
        res = cross_validate(fitter, y, folds, task=task, classes=classes, seed=seed, test_rows=test_rows)
        rows.append({"baseline": name, **res, "n_features": n_features, "note": note})

    def skip(name: str, note: str) -> None:
        rows.append({"baseline": name, **{k: np.nan for m in metric_names(task) for k in (m, f"{m}_std")},
                     "n_features": 0, "note": note})

    def linear(X: np.ndarray, how: Any, labels: np.ndarray | None = None, blocks=None):
        def fitter(train, y_train):
            yt = y_train if labels is None else labels[train]
            predict = fit_predictor(fit(X[train], yt, how, task=task, blocks=blocks, seed=seed, C=C))
            return lambda rows: predict(X[rows])
        return fitter

    run("majority", _majority(task, y), 0)

    XL, blocks = data.features(layer)  # the probe's layer, read once for the two baselines that use it
    rng = np.random.default_rng(seed)
    shuffled = y.copy()
    for train, _ in folds:  # each fold's training labels permuted among themselves
        shuffled[train] = y[rng.permutation(train)]
    run("shuffled_labels", linear(XL, method, shuffled, blocks), XL.shape[1])

    w = unit(rng.normal(size=XL.shape[1]))
    run("random_direction", _random_direction(XL, w, task, classes), XL.shape[1])
    run("text_length", linear(_length_features(data), text_method), 3, "" if sk else "mass_mean (no scikit-learn)")
    if sk:
        run("bag_of_words", _bag_of_words(data.texts, task, C, seed), 0,
            "TF-IDF + " + ("ridge" if task == "regression" else "logistic"))
    else:
        skip("bag_of_words", "needs scikit-learn: pip install 'lmprobe[probe]'")

    first = data.parts[0][0]
    if data.layers_list(layer) == [0]:
        skip("layer_0", "the probe reads layer 0 itself")
    elif 0 in first.layers_here(data.hookpoint) and all(0 in ds.layers_here(data.hookpoint) for ds, _ in data.parts):
        X0, b0 = data.features(0)
        run("layer_0", linear(X0, method, blocks=b0), X0.shape[1], "embeddings")
        del X0
    else:
        skip("layer_0", "layer 0 is not stored (extract with --layers 0,...)")

    if all("perplexity_mean" in ds.prompt_table.column_names for ds, _ in data.parts):
        vals = [np.asarray(ds.prompt_table.column("perplexity_mean").to_pylist(), dtype=object)[r]
                for ds, r in data.parts]
        ppl = np.concatenate(vals)
        if data.token_counts is not None:
            ppl = np.repeat(ppl, data.token_counts)
        if any(v is None for v in ppl):
            skip("perplexity", "some prompts have no perplexity")
        else:
            P = np.log(np.asarray(ppl, dtype=np.float64)).astype(np.float32)[:, None]
            run("perplexity", linear(P, text_method), 1, "log mean perplexity")
    else:
        skip("perplexity", "not stored (extract with --perplexity)")
    return pd.DataFrame(rows)


def _majority(task: str, y: np.ndarray) -> Any:
    """The majority baseline's fitter: a constant (the mean, for regression)."""

    def majority(train, y_train):
        if task == "regression":
            v = float(np.mean(y_train))
            return lambda X: (np.full(len(X), v), np.full(len(X), v))
        vals, counts = np.unique(y_train, return_counts=True)
        top = vals[np.argmax(counts)]
        return lambda X: (np.full(len(X), top, dtype=np.asarray(y).dtype), np.zeros(len(X)))
    return majority


def _random_direction(XL: np.ndarray, w: np.ndarray, task: str, classes: Any) -> Any:
    """The random-direction baseline's fitter: the probe's layer projected on ``w``, a random unit vector, with
    only the sign and threshold (or the line, for regression) fitted."""

    def random_direction(train, y_train):
        z = XL[train] @ w
        if task == "regression":
            a, b = np.polyfit(z, y_train, 1)
            return lambda rows: (XL[rows] @ w * a + b,) * 2
        pos = y_train == classes[1] if len(classes) == 2 else y_train == y_train[0]
        ww, b = resolve_sign(XL[train], pos, w)
        hi = classes[1] if len(classes) == 2 else y_train[0]
        lo = classes[0] if len(classes) == 2 else [c for c in classes if c != hi][0]
        return lambda rows: (np.where(XL[rows] @ ww + b > 0, hi, lo), XL[rows] @ ww + b)
    return random_direction


def _length_features(data: ProbeData) -> np.ndarray:
    """Per row: the text's characters, its words and the prompt's tokens (float32, three columns)."""
    texts = data.texts
    lengths = np.concatenate([ds.token_lengths()[r] for ds, r in data.parts])
    if data.token_counts is not None:
        lengths = np.repeat(lengths, data.token_counts)
    return np.stack([np.char.str_len(texts.astype(str)), np.char.count(texts.astype(str), " ") + 1, lengths],
                    axis=1).astype(np.float32)


def _bag_of_words(texts: np.ndarray, task: str, C: float, seed: int) -> Any:
    """The bag-of-words baseline's fitter: TF-IDF of the texts, then ridge or logistic regression (scikit-learn)."""

    def bag_of_words(train, y_train):
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression, Ridge

        vec = TfidfVectorizer(max_features=20000, sublinear_tf=True)
        A = vec.fit_transform(texts[train].astype(str))
        est = (Ridge() if task == "regression" else LogisticRegression(C=C, max_iter=5000, random_state=seed))
        est.fit(A, y_train)

        def predict(rows):
            B = vec.transform(texts[rows].astype(str))
            if task == "regression":
                p = est.predict(B)
                return p, p
            s = est.decision_function(B)
            return est.predict(B), (s if np.ndim(s) == 1 else None)
        return predict
    return bag_of_words
