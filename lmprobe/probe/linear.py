"""Linear probes on lmprobe datasets: features per layer, cross-validated sweeps, saved probes.

>>> import lmprobe, lmprobe.probe as probe
>>> ds = lmprobe.load("out/tiny-demo")                                        # doctest: +SKIP
>>> table = probe.sweep(ds, cv=5)                                            # doctest: +SKIP
>>> p = probe.train_probe(ds, layer=int(table.loc[table.accuracy.idxmax(), "layer"]))   # doctest: +SKIP
>>> p.save("probe"); probe.LinearProbe.load("probe").predict(ds.hidden(p.layer))        # doctest: +SKIP

scikit-learn is needed for fitting (``pip install lmprobe[probe]``); saved probes are safetensors
weights plus JSON settings and predict with numpy alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..base.atomic import atomic_write
from ..errors import ProbeError
from ..format.reader import Dataset
from ..format.spec import RESERVED_COLUMNS
from ..opening import load
from ..tensors import load_file, save_file

Pooling = Literal["last_token", "mean"]


def _dataset(ds: Any) -> Dataset:
    return ds if isinstance(ds, Dataset) else load(ds)


def _sklearn():
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise ProbeError("probing needs scikit-learn: pip install 'lmprobe[probe]'") from None


def mean_hidden(ds: Any, layer: int, *, chunk_bytes: int = 64 * 2**20, hookpoint: str | None = None) -> np.ndarray:
    """Mean over each prompt's tokens of ``layer`` (full_sequence datasets): (num_prompts, dim) float32."""

    ds = _dataset(ds)
    if ds.storage != "full_sequence":
        raise ProbeError("mean pooling needs every token: this dataset is pooled (extract with --storage full_sequence)")
    lengths = ds.token_lengths()
    starts = np.concatenate([[0], np.cumsum(lengths)])
    dim = ds.hidden_desc(hookpoint).dim
    out = np.empty((len(lengths), dim), dtype=np.float32)
    per_chunk = max(1, chunk_bytes // (dim * 4))
    i = 0
    while i < len(lengths):  # prompts in chunks of about chunk_bytes of token rows, addresses read per chunk
        j = int(np.searchsorted(starts, starts[i] + per_chunk, side="right")) - 1
        j = max(j, i + 1)
        ids, offs, n = ds.shards.token_addresses(np.arange(i, j))
        rows = np.asarray(ds.shards.read_hidden_rows(layer, ids, offs, hookpoint=hookpoint), dtype=np.float32)
        local = np.concatenate([[0], np.cumsum(n)[:-1]])
        out[i:j] = np.add.reduceat(rows, local, axis=0) / n[:, None]
        i = j
    return out


def features(ds: Any, layer: int, *, pooling: Pooling = "last_token", rows: Any = None,
             hookpoint: str | None = None) -> np.ndarray:
    """(N, dim) float32 features of ``layer`` (of ``hookpoint``): the last token's vector, or the mean over tokens."""
    ds = _dataset(ds)
    if pooling == "last_token":
        X = ds.hidden(layer, rows=rows, hookpoint=hookpoint)
    elif pooling == "mean":
        X = mean_hidden(ds, layer, hookpoint=hookpoint)
        if rows is not None:
            X = X[ds.row_indices(rows)]
    else:
        raise ProbeError(f"pooling must be 'last_token' or 'mean', got {pooling!r}")
    return np.asarray(X, dtype=np.float32)


def labels(ds: Any, label_column: str = "label") -> np.ndarray:
    """Labels from ``label_column`` of the index; rows with a null label are an error."""
    ds = _dataset(ds)
    names = ds.prompt_table.column_names
    col = ds.prompt_table.column(label_column) if label_column in names else None
    if col is None or (col.null_count == len(col) and label_column == "label"):  # an unlabeled extraction's label
        own = [c for c in names if c not in RESERVED_COLUMNS]
        close = [c for c in own if c.lower() == label_column.lower()]
        raise ProbeError(f"the dataset has no {label_column!r} column; "
                         + (f"its own columns are {own}: pass --label-column NAME (label_column= in Python)" if own
                            else "it stores no other column to probe (extract with a label column)")
                         + (f"; did you mean --label-column {close[0]}?" if close else ""))
    if col.null_count:
        raise ProbeError(f"{col.null_count} row(s) have no {label_column!r}; probing needs a label for every prompt")
    y = np.asarray(col.to_pylist())
    if len(np.unique(y)) < 2:
        raise ProbeError(f"{label_column!r} has a single class; a probe needs at least two")
    return y


def layer_features(ds: Any, layers: Sequence[int] | None = None, *, label_column: str = "label",
                   pooling: Pooling = "last_token") -> tuple[dict[int, np.ndarray], np.ndarray]:
    """Features of every requested layer and the labels, in one call: ({layer: X}, y)."""
    ds = _dataset(ds)
    y = labels(ds, label_column)
    layers = ds.default_layers() if layers is None else list(layers)  # a partial copy: the layers it holds
    return {layer: features(ds, layer, pooling=pooling) for layer in layers}, y


def _estimator(classifier: Any, seed: int):
    from sklearn.linear_model import LogisticRegression, RidgeClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if not isinstance(classifier, str):
        return classifier
    if classifier == "logistic":
        return make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000, random_state=seed))
    if classifier == "ridge":
        return make_pipeline(StandardScaler(), RidgeClassifier())
    raise ProbeError(f"classifier must be 'logistic', 'ridge' or a scikit-learn estimator, got {classifier!r}")


def sweep(ds: Any, layers: Sequence[int] | None = None, label_column: str = "label", classifier: Any = "logistic",
          cv: int = 5, pooling: Pooling = "last_token", seed: int = 0, hookpoints: Sequence[str] | None = None):
    """Cross-validated linear probe accuracy per layer: a DataFrame with one row per layer.

    ``layers``: default every stored layer (in a partial copy made by ``lmprobe pull --layers``,
    the layers it holds). ``hookpoints`` sweeps layers x hookpoints (a ``hookpoint`` column is
    added); default: what ``hidden_layers`` holds.

    Columns: layer, accuracy (mean over folds), accuracy_std, auroc (binary labels; NaN otherwise),
    n_samples, n_features. Folds are stratified and shuffled with ``seed``: the same call gives the
    same table.
    """
    _sklearn()
    import pandas as pd
    from sklearn.model_selection import StratifiedKFold, cross_validate

    ds = _dataset(ds)
    y = labels(ds, label_column)
    classes, counts = np.unique(y, return_counts=True)
    if cv < 2 or counts.min() < cv:
        raise ProbeError(f"cv={cv} folds need at least {cv} prompts of every class; the smallest class has {counts.min()}")
    folds = StratifiedKFold(n_splits=cv, shuffle=True, random_state=seed)
    scoring = {"accuracy": "accuracy"}
    if len(classes) == 2:
        scoring["auroc"] = "roc_auc"
    rows = []
    hps = [None] if hookpoints is None else list(hookpoints)
    for hp in hps:
        if hp is not None and hp not in ds.hookpoints:
            raise ProbeError(f"hookpoint {hp!r} is not stored in this dataset; it stores {ds.hookpoints}")
    # default: every stored layer (of a partial copy, the ones it holds)
    grid = [(hp, layer) for hp in hps for layer in (ds.default_layers(hp) if layers is None else list(layers))]
    for hp, layer in grid:
        X = features(ds, layer, pooling=pooling, hookpoint=hp)
        res = cross_validate(_estimator(classifier, seed), X, y, cv=folds, scoring=scoring)
        rows.append({
            **({"hookpoint": hp} if hookpoints is not None else {}),
            "layer": int(layer),
            "accuracy": float(res["test_accuracy"].mean()),
            "accuracy_std": float(res["test_accuracy"].std()),
            "auroc": float(res["test_auroc"].mean()) if "test_auroc" in res else float("nan"),
            "n_samples": int(len(y)),
            "n_features": int(X.shape[1]),
        })
    return pd.DataFrame(rows)


def plot_sweep(table: Any, path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Accuracy (with +-1 std band) and AUROC against layer, written as an image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    if "hookpoint" in table.columns:  # one line per hookpoint
        for hp, part in table.groupby("hookpoint", sort=False):
            ax.plot(part["layer"], part["accuracy"], marker="o", label=f"{hp} accuracy")
            ax.fill_between(part["layer"], part["accuracy"] - part["accuracy_std"],
                            part["accuracy"] + part["accuracy_std"], alpha=0.2)
    else:
        ax.plot(table["layer"], table["accuracy"], marker="o", label="accuracy")
        ax.fill_between(table["layer"], table["accuracy"] - table["accuracy_std"],
                        table["accuracy"] + table["accuracy_std"], alpha=0.2)
    if "hookpoint" not in table.columns and table["auroc"].notna().any():
        ax.plot(table["layer"], table["auroc"], marker="s", linestyle="--", label="AUROC")
    ax.set_xlabel("layer")
    ax.set_ylabel("cross-validated score")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


@dataclass
class LinearProbe:
    """A trained linear probe: standardisation then a linear map; predicts with numpy alone.

    Saved as ``<path>.safetensors`` (mean, scale, coef, intercept) and ``<path>.json`` (settings,
    classes, layer, provenance); no pickle.
    """

    layer: int
    classes: list
    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray  # (n_classes or 1, dim)
    intercept: np.ndarray
    settings: dict = field(default_factory=dict)

    def decision_function(self, X: Any) -> np.ndarray:
        X = np.asarray(X, dtype=np.float32)
        if X.ndim == 1:
            X = X[None]
        if X.shape[1] != self.coef.shape[1]:
            raise ProbeError(f"this probe takes {self.coef.shape[1]}-dim activations, got {X.shape[1]}")
        Z = (X - self.mean) / self.scale
        return Z @ self.coef.T + self.intercept

    def predict_proba(self, X: Any) -> np.ndarray:
        s = self.decision_function(X)
        if s.shape[1] == 1:
            p = 1 / (1 + np.exp(-s[:, 0]))
            return np.stack([1 - p, p], axis=1)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    def predict(self, X: Any) -> np.ndarray:
        s = self.decision_function(X)
        idx = (s[:, 0] > 0).astype(int) if s.shape[1] == 1 else s.argmax(axis=1)
        return np.asarray(self.classes, dtype=object if isinstance(self.classes[0], str) else None)[idx]

    def score(self, X: Any, y: Any) -> float:
        return float(np.mean(self.predict(X) == np.asarray(y)))

    def save(self, path: str | os.PathLike) -> tuple[Path, Path]:
        base = Path(path)
        weights, meta = base.with_suffix(".safetensors"), base.with_suffix(".json")
        save_file({"probe": {"mean": self.mean, "scale": self.scale, "coef": self.coef, "intercept": self.intercept}},
                  weights)
        classes = [c.item() if hasattr(c, "item") else c for c in self.classes]
        atomic_write(meta, json.dumps({"format": "lmprobe-linear-probe/1", "layer": self.layer, "classes": classes,
                                       "settings": self.settings}, indent=2) + "\n")
        return weights, meta

    @classmethod
    def load(cls, path: str | os.PathLike) -> LinearProbe:
        base = Path(path)
        meta = json.loads(base.with_suffix(".json").read_text())
        if meta.get("format") != "lmprobe-linear-probe/1":
            raise ProbeError(f"{base.with_suffix('.json')} is not an lmprobe probe")
        w = load_file(base.with_suffix(".safetensors"))["probe"]
        return cls(int(meta["layer"]), list(meta["classes"]), w["mean"], w["scale"], w["coef"], w["intercept"],
                   meta.get("settings", {}))


def train_probe(ds: Any, layer: int, *, label_column: str = "label", pooling: Pooling = "last_token",
                C: float = 1.0, seed: int = 0) -> LinearProbe:
    """Fit a standardised logistic-regression probe on every prompt of ``layer``."""
    _sklearn()
    from sklearn.linear_model import LogisticRegression

    ds = _dataset(ds)
    X, y = features(ds, layer, pooling=pooling), labels(ds, label_column)
    mean, scale = X.mean(axis=0), X.std(axis=0)
    scale[scale == 0] = 1.0
    clf = LogisticRegression(C=C, max_iter=5000, random_state=seed).fit((X - mean) / scale, y)
    settings = {"label_column": label_column, "pooling": pooling, "C": C, "seed": seed,
                "model": ds.model, "trained_on": ds.source, "n_samples": int(len(y))}
    return LinearProbe(int(layer), list(clf.classes_), mean.astype(np.float32), scale.astype(np.float32),
                       clf.coef_.astype(np.float32), clf.intercept_.astype(np.float32), settings)
