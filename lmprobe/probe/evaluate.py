"""Training and honest evaluation of probes: ``train_probe``, ``sweep`` (layers x hookpoints x methods, every
metric with its spread, groups, a held-out set, baselines, bootstrap intervals) and ``transfer``.

>>> import lmprobe.probe as probe
>>> table = probe.sweep("out/tiny", method=["logistic", "mass_mean"], groups="topic", baselines=True)  # doctest: +SKIP
>>> probe.transfer({"cities": "out/cities", "neg_cities": "out/neg_cities"}, layer=4)                   # doctest: +SKIP

Memory: one layer's (N, dim) features at a time (several, concatenated, when ``layers`` names a
list); every method and fold reads the same array.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ProbeError
from ..format.reader import Dataset
from .baselines import baseline_table
from .crossval import cross_validate, fit_predictor, score_predictions
from .folds import Folds, make_folds, warn_duplicates
from .inputs import LayerArg, Pooling, ProbeData, as_dataset, probe_data
from .linear import LinearProbe
from .methods import Pairs, check_method, fit, method_name


def _settings(data: ProbeData, method: Any, label_column: str, seed: int, extra: dict) -> dict:
    ds = data.parts[0][0]
    hookpoint = data.hookpoint or ds.hidden_desc(None).hookpoint  # what the probe reads, named for `steer`
    return {"method": method_name(method), "task": data.task, "label_column": label_column,
            "pooling": data.pooling, "hookpoint": hookpoint, "stored_layers": list(ds.layers_here(data.hookpoint)),
            "seed": seed, "model": ds.model,
            "trained_on": ds.source, "n_samples": int(data.n), **extra}


def train_probe(ds: Any, layer: LayerArg, *, method: Any = "logistic", label_column: str = "label",
                task: str = "classification", pooling: Pooling = "last_token", pairs: Any = None,
                hookpoint: str | None = None, C: float = 1.0, seed: int = 0) -> LinearProbe:
    """Fit a probe on every prompt of ``layer`` (a list: those layers concatenated, each standardised).

    >>> p = train_probe("out/tiny", layer=2, method="mass_mean")   # doctest: +SKIP
    >>> p.direction.shape, p.predict(lmprobe.load("out/tiny").hidden(2))[:3]   # doctest: +SKIP
    """
    data = probe_data(ds, label_column=label_column, task=task, pooling=pooling, hookpoint=hookpoint, pairs=pairs)
    check_method(method, task=task, n_classes=len(data.classes), pairs=data.pairs)
    X, blocks = data.features(layer)
    f = fit(X, data.y, method, task=task, pairs=data.pairs, blocks=blocks, seed=seed, C=C)
    layers = data.layers_list(layer)
    p = LinearProbe.from_fit(f, layers[0] if isinstance(layer, (int, np.integer)) else layers,
                             _settings(data, method, label_column, seed, {"C": C}))
    p.settings["train_score"] = p.score(X, data.y)  # in-sample: what the repr shows (sweep gives held-out scores)
    return p


def _fitter(X: np.ndarray, data: ProbeData, method: Any, blocks: list[int], seed: int, C: float):
    def fitter(train: np.ndarray, y_train: np.ndarray):
        pairs = _pairs_within(data, train)
        predict = fit_predictor(fit(X[train], y_train, method, task=data.task, pairs=pairs, blocks=blocks, seed=seed,
                                    C=C))
        return lambda rows: predict(X[rows])

    return fitter


def _pairs_within(data: ProbeData, rows: np.ndarray):
    """The contrast pairs whose two rows are both in ``rows``, renumbered to positions in ``rows``."""
    if data.pairs is None:
        return None
    where = np.full(data.n, -1)
    where[rows] = np.arange(len(rows))
    a, b = where[data.pairs.a], where[data.pairs.b]
    keep = (a >= 0) & (b >= 0)
    return Pairs(a[keep], b[keep])


def _splits(data: ProbeData, cv: int, seed: int) -> tuple[Folds, np.ndarray | None]:
    """Folds over the training rows (as row numbers of ``data``) and the held-out rows."""
    train = np.flatnonzero(~data.test) if data.test is not None else np.arange(data.n)
    test = np.flatnonzero(data.test) if data.test is not None else None
    groups = None if data.groups is None else data.groups[train]
    folds = make_folds(data.y[train], cv, seed=seed, groups=groups, stratify=data.task == "classification")
    folds = [(train[a], train[b]) for a, b in folds]
    return folds, test


def _grid_layers(ds, layers: Any, hookpoint: str | None) -> list:
    return ds.default_layers(hookpoint) if layers is None else list(layers)


def _layer_label(layer: Any) -> Any:
    return int(layer) if isinstance(layer, (int, np.integer)) else "+".join(str(int(x)) for x in layer)


def probe_scores(data: ProbeData, layer: LayerArg, *, method: Any = "logistic", cv: int = 5, seed: int = 0,
                 C: float = 1.0, bootstrap: int = 0) -> tuple[dict, Folds]:
    """The cross-validated scores of one probe on ``data``, and the folds they used."""
    folds, test_rows = _splits(data, cv, seed)
    X, blocks = data.features(layer)
    res = cross_validate(_fitter(X, data, method, blocks, seed, C), data.y, folds, task=data.task,
                         classes=data.classes, bootstrap=bootstrap, seed=seed, test_rows=test_rows)
    return res, folds


def baselines(ds: Any, layer: LayerArg, *, method: Any = "logistic", label_column: str = "label",
              task: str = "classification", pooling: Pooling = "last_token", cv: int = 5, seed: int = 0,
              groups: Any = None, pairs: Any = None, hookpoint: str | None = None, C: float = 1.0):
    """Every baseline of ``lmprobe.probe.baselines`` next to the probe's own score (the first row, ``probe``), on
    the same folds as ``sweep(..., seed=seed)``: a DataFrame with baseline, accuracy, accuracy_std, ..., note.

    >>> probe.baselines("out/tiny", layer=2, method="mass_mean")     # doctest: +SKIP
    """
    import pandas as pd

    data = probe_data(ds, label_column=label_column, task=task, pooling=pooling, hookpoint=hookpoint, groups=groups,
                      pairs=pairs)
    check_method(method, task=task, n_classes=len(data.classes), pairs=data.pairs)
    data.layers_list(layer)
    own, folds = probe_scores(data, layer, method=method, cv=cv, seed=seed, C=C)
    table = baseline_table(data, folds, layer=layer, method=method, seed=seed, C=C)
    first = pd.DataFrame([{"baseline": "probe", **own, "n_features": np.nan,
                           "note": f"{method_name(method)} at layer {_layer_label(layer)}"}])
    return pd.concat([first, table], ignore_index=True)


def sweep(ds: Any, layers: Sequence[Any] | None = None, label_column: str = "label", classifier: Any = None,
          cv: int = 5, pooling: Pooling = "last_token", seed: int = 0, hookpoints: Sequence[str] | None = None, *,
          method: Any = "logistic", task: str = "classification", groups: Any = None, pairs: Any = None,
          test: Any = None, bootstrap: int = 0, baselines: bool = False, C: float = 1.0):
    """Cross-validated probes per layer (x hookpoint x method): a DataFrame with one row each.

    ``layers``: default every stored layer (of a partial copy, the ones it holds); an entry that is
    a list concatenates those layers (its row's layer reads "4+8"). ``method``: one method or a
    list (``classifier=`` is its older name). ``groups``: a column (or array) whose rows always
    share a fold. ``pairs``: contrast pairs (a column pairing rows, or two datasets or row sets).
    ``test``: held-out rows, ``(column, value)`` or another dataset: ``test_*`` columns.
    ``bootstrap=N``: ``*_lo``/``*_hi``, a 95% interval of each score. ``baselines=True``: the
    baselines of ``lmprobe.probe.baselines`` on the same folds, in ``table.attrs["baselines"]``,
    with ``best_baseline``, ``over_baseline`` (the probe's accuracy, R^2 for regression, minus
    the best baseline's) and ``beats_baselines`` columns.

    Columns: layer, accuracy, accuracy_std, auroc, auroc_std, f1, precision, recall,
    recall_at_1fpr (each with _std; r2 for regression), n_samples, n_features, method. Folds are
    stratified (group-aware with groups or pairs) and shuffled with ``seed``: the same call
    gives the same table; every method and layer is scored on the same folds.
    """
    import pandas as pd

    methods = [classifier] if classifier is not None else (list(method) if isinstance(method, (list, tuple))
                                                             else [method])
    base = as_dataset(ds) if ds is not None else None  # None: pairs= names two datasets
    hps = [None] if hookpoints is None else list(hookpoints)
    first = base if base is not None else as_dataset(pairs[0])
    for hp in hps:
        if hp is not None and hp not in first.hookpoints:
            raise ProbeError(f"hookpoint {hp!r} is not stored in this dataset; it stores {first.hookpoints}")
    data_by_hp = {hp: probe_data(base, label_column=label_column, task=task, pooling=pooling, hookpoint=hp,
                                 groups=groups, pairs=pairs, test=test) for hp in hps}
    data0 = data_by_hp[hps[0]]
    for m in methods:
        check_method(m, task=task, n_classes=len(data0.classes), pairs=data0.pairs)
    grid = [(hp, layer) for hp in hps for layer in _grid_layers(first, layers, hp)]
    for hp, layer in grid:  # every layer checked before any is read
        data_by_hp[hp].layers_list(layer)
    folds, test_rows = _splits(data0, cv, seed)
    other = ({hp: probe_data(test, label_column=label_column, task=task, pooling=pooling, hookpoint=hp) for hp in hps}
             if isinstance(test, (Dataset, str, os.PathLike)) else None)  # another dataset held out, checked now
    warn_duplicates(data0.texts, folds)
    if test_rows is not None:
        warn_duplicates(data0.texts, [(np.concatenate([t for _, t in folds]), test_rows)], "held-out split")
    rows = []
    for hp, layer in grid:
        data = data_by_hp[hp]
        X, blocks = data.features(layer)  # (N, dim): one layer's features, shared by every method and fold
        y = data.y
        t_rows = test_rows
        if other is not None:  # another dataset held out: its rows after ours
            X = np.concatenate([X, other[hp].features(layer)[0]])
            y = np.concatenate([data.y, other[hp].y])
            t_rows = np.arange(data.n, data.n + other[hp].n)
        for m in methods:
            res = cross_validate(_fitter(X, data, m, blocks, seed, C), y, folds, task=task,
                                 classes=data.classes, bootstrap=bootstrap, seed=seed, test_rows=t_rows)
            resolved = data.layers_list(layer)  # -1 named as the layer it is
            label = resolved[0] if isinstance(layer, (int, np.integer)) else resolved
            rows.append({**({"hookpoint": hp} if hookpoints is not None else {}), "layer": _layer_label(label),
                         **res, "n_samples": int(len(folds[0][0]) + len(folds[0][1])),
                         "n_features": int(X.shape[1]), "method": method_name(m)})
    table = pd.DataFrame(rows)
    if baselines:
        key = "r2" if task == "regression" else "accuracy"
        best_row = table.loc[table[key].idxmax()]
        best_layer = best_row["layer"]
        best_layer = int(best_layer) if isinstance(best_layer, (int, np.integer)) else [int(x) for x in
                                                                                         str(best_layer).split("+")]
        btable = baseline_table(data_by_hp[hps[0]], folds, layer=best_layer, method=methods[0], seed=seed, C=C)
        scored = btable[btable[key].notna()]
        top = scored.loc[scored[key].idxmax()]
        table["best_baseline"] = top["baseline"]
        table["over_baseline"] = table[key] - float(top[key])
        table["beats_baselines"] = table["over_baseline"] > 0
        table.attrs["baselines"] = btable
    return table


def transfer(datasets: dict | Sequence[Any], layer: LayerArg, *, method: Any = "logistic", label_column: str = "label",
             task: str = "classification", pooling: Pooling = "last_token", cv: int = 5, seed: int = 0,
             metric: str | None = None, hookpoint: str | None = None, C: float = 1.0):
    """Train on dataset A, test on dataset B, for every pair: a DataFrame, rows the training set, columns the test
    set (geometry-of-truth's generalisation matrix). The diagonal is the cross-validated score on A itself.

    >>> probe.transfer({"cities": "out/cities", "larger_than": "out/larger"}, layer=4, method="mass_mean")  # doctest: +SKIP
    """
    import pandas as pd

    if not isinstance(datasets, dict):
        datasets = {str(getattr(d, "source", d)): d for d in datasets}
    if len(datasets) < 2:
        raise ProbeError("transfer needs at least two datasets")
    metric = metric or ("r2" if task == "regression" else "accuracy")
    data = {name: probe_data(d, label_column=label_column, task=task, pooling=pooling, hookpoint=hookpoint)
            for name, d in datasets.items()}
    for dd in data.values():
        check_method(method, task=task, n_classes=len(dd.classes))
    feats = {name: dd.features(layer) for name, dd in data.items()}
    dims = {name: X.shape[1] for name, (X, _) in feats.items()}
    if len(set(dims.values())) > 1:
        raise ProbeError(f"the datasets' features differ in width ({dims}): transfer needs one model's activations")
    out = pd.DataFrame(index=list(data), columns=list(data), dtype=float)
    for a, da in data.items():
        Xa, blocks = feats[a]
        folds, _ = _splits(da, cv, seed)
        out.loc[a, a] = cross_validate(_fitter(Xa, da, method, blocks, seed, C), da.y, folds, task=task,
                                       classes=da.classes)[metric]
        predictor = fit_predictor(fit(Xa, da.y, method, task=task, blocks=blocks, seed=seed, C=C))
        for b, db in data.items():
            if b == a:
                continue
            pred, score = predictor(feats[b][0])
            out.loc[a, b] = score_predictions(task, da.classes, db.y, pred, score)[metric]
    out.index.name = "train"
    out.columns.name = "test"
    return out


def plot_sweep(table: Any, path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Accuracy (with +-1 std band) and AUROC against layer, one line per method or hookpoint, the baselines of a
    ``sweep(..., baselines=True)`` as dashed horizontal lines; written as an image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "r2" if "r2" in table.columns else "accuracy"
    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=120)
    by = [c for c in ("hookpoint", "method") if c in table.columns and table[c].nunique() > 1]
    parts = table.groupby(by, sort=False) if by else [((), table)]
    x_of = {v: i for i, v in enumerate(dict.fromkeys(table["layer"].tolist()))}
    for name, part in parts:
        label = " ".join(map(str, name if isinstance(name, tuple) else (name,))) or key
        x = [x_of[v] for v in part["layer"]]
        ax.plot(x, part[key], marker="o", label=f"{label} {key}" if by else key)
        ax.fill_between(x, part[key] - part[f"{key}_std"], part[key] + part[f"{key}_std"], alpha=0.2)
    if not by and key == "accuracy" and table["auroc"].notna().any():
        ax.plot(range(len(table)), table["auroc"], marker="s", linestyle="--", label="AUROC")
    bt = table.attrs.get("baselines")
    if bt is not None:
        for _, row in bt[bt[key].notna()].iterrows():
            ax.axhline(row[key], linestyle=":", linewidth=1, color="grey")
            ax.text(len(x_of) - 1, row[key], f" {row['baseline']}", fontsize=6, va="bottom", ha="right", color="grey")
    ax.set_xticks(range(len(x_of)))
    ax.set_xticklabels([str(v) for v in x_of], rotation=45 if len(x_of) > 12 else 0)
    ax.set_xlabel("layer")
    ax.set_ylabel(f"cross-validated {key}")
    if key == "accuracy":
        ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
