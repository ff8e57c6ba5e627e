"""A saved linear probe: standardisation then a linear map, predicting with numpy alone; and the features it reads.

>>> import lmprobe, lmprobe.probe as probe
>>> ds = lmprobe.load("out/tiny-demo")                                        # doctest: +SKIP
>>> table = probe.sweep(ds, cv=5, method=["logistic", "mass_mean"])           # doctest: +SKIP
>>> p = probe.train_probe(ds, layer=2, method="mass_mean")                    # doctest: +SKIP
>>> p.save("probe"); probe.LinearProbe.load("probe").predict(ds.hidden(p.layer))        # doctest: +SKIP

Saved probes are safetensors weights plus JSON settings and predict with numpy alone, whatever
method fitted them (docs/probing.md lists the methods).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..base.atomic import atomic_write
from ..errors import ProbeError
from ..tensors import load_file, save_file
from .inputs import Pooling, as_dataset, pooled, probe_data
from .methods import Fit
from .metrics import r2

FORMAT = "lmprobe-linear-probe/1"


def mean_hidden(ds: Any, layer: int, *, chunk_bytes: int = 64 * 2**20, hookpoint: str | None = None) -> np.ndarray:
    """Mean over each prompt's tokens of ``layer`` (full_sequence datasets): (num_prompts, dim) float32."""
    return pooled(ds, layer, pooling="mean", hookpoint=hookpoint, chunk_bytes=chunk_bytes)


def features(ds: Any, layer: int, *, pooling: Pooling = "last_token", rows: Any = None,
             hookpoint: str | None = None) -> np.ndarray:
    """(N, dim) float32 features of ``layer`` (of ``hookpoint``), pooled as ``pooling`` says (see ``inputs``)."""
    return pooled(ds, layer, pooling=pooling, rows=rows, hookpoint=hookpoint)


def labels(ds: Any, label_column: str = "label") -> np.ndarray:
    """Labels from ``label_column`` of the index; rows with a null label are an error."""
    return probe_data(ds, label_column=label_column).y


def layer_features(ds: Any, layers: Sequence[int] | None = None, *, label_column: str = "label",
                   pooling: Pooling = "last_token") -> tuple[dict[int, np.ndarray], np.ndarray]:
    """Features of every requested layer and the labels, in one call: ({layer: X}, y)."""
    ds = as_dataset(ds)
    y = labels(ds, label_column)
    layers = ds.default_layers() if layers is None else list(layers)  # a partial copy: the layers it holds
    return {layer: features(ds, layer, pooling=pooling) for layer in layers}, y


@dataclass
class LinearProbe:
    """A trained linear probe: standardisation then a linear map; predicts with numpy alone.

    Saved as ``<path>.safetensors`` (mean, scale, coef, intercept) and ``<path>.json`` (settings,
    classes, layer, provenance); no pickle.
    """

    layer: int | list[int]  # several: their features concatenated in this order
    classes: list  # empty for a regression probe
    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray  # (n_classes or 1, dim)
    intercept: np.ndarray
    settings: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        """One line: what the probe reads and how well it fit, never its arrays (``probe.coef`` shows them)."""
        s = self.settings
        layer = self.layer if isinstance(self.layer, int) else "+".join(map(str, self.layer))
        parts = [str(s.get("method", "linear")), f"layer {layer}"]
        parts += [str(s["hookpoint"])] if s.get("hookpoint") else []
        parts += [f"{s['pooling']} pooling"] if s.get("pooling") else []
        parts.append(f"{self.coef.shape[1]} dims")
        parts.append(f"classes {self.classes}" if self.classes else "regression")
        score = s.get("train_score")
        if isinstance(score, (int, float)):
            parts.append(f"train {'R^2' if self.task == 'regression' else 'accuracy'} {round(float(score), 3)}")
        return f"<LinearProbe {', '.join(parts)}>"

    def decision_function(self, X: Any) -> np.ndarray:
        X = np.asarray(X, dtype=np.float32)
        if X.ndim == 1:
            X = X[None]
        if X.shape[1] != self.coef.shape[1]:
            raise ProbeError(f"this probe takes {self.coef.shape[1]}-dim activations, got {X.shape[1]}")
        Z = (X - self.mean) / self.scale
        return Z @ self.coef.T + self.intercept

    @property
    def task(self) -> str:
        return self.settings.get("task", "classification")

    @property
    def direction(self) -> np.ndarray:
        """The unit vector in activation space along which the score grows (toward ``classes[1]``, or a larger
        target): ``coef / scale`` normalised. Two-class and regression probes only."""
        if self.coef.shape[0] != 1:
            raise ProbeError(f"a probe of {self.coef.shape[0]} classes has no single direction")
        w = self.coef[0].astype(np.float64) / self.scale
        return (w / np.linalg.norm(w)).astype(np.float32)

    @classmethod
    def from_fit(cls, fit: Fit, layer: int | list[int], settings: dict) -> LinearProbe:
        classes = [c.item() if hasattr(c, "item") else c for c in fit.classes]  # plain values: 1, not np.int64(1)
        return cls(layer, classes, fit.mean.astype(np.float32), fit.scale.astype(np.float32),
                   fit.coef.astype(np.float32), fit.intercept.astype(np.float32), settings)

    def predict_proba(self, X: Any) -> np.ndarray:
        if self.task == "regression":
            raise ProbeError("a regression probe predicts values, not probabilities: use predict")
        s = self.decision_function(X)
        if s.shape[1] == 1:
            p = 1 / (1 + np.exp(-s[:, 0]))
            return np.stack([1 - p, p], axis=1)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    def predict(self, X: Any) -> np.ndarray:
        s = self.decision_function(X)
        if self.task == "regression":
            return s[:, 0]
        idx = (s[:, 0] > 0).astype(int) if s.shape[1] == 1 else s.argmax(axis=1)
        return np.asarray(self.classes, dtype=object if isinstance(self.classes[0], str) else None)[idx]

    def score(self, X: Any, y: Any) -> float:
        """Accuracy, or R^2 for a regression probe."""
        if self.task == "regression":
            return r2(np.asarray(y, np.float64), self.predict(X))
        return float(np.mean(self.predict(X) == np.asarray(y)))

    def save(self, path: str | os.PathLike) -> tuple[Path, Path]:
        base = Path(path)
        weights, meta = base.with_suffix(".safetensors"), base.with_suffix(".json")
        save_file({"probe": {"mean": self.mean, "scale": self.scale, "coef": self.coef, "intercept": self.intercept}},
                  weights)
        classes = [c.item() if hasattr(c, "item") else c for c in self.classes]
        atomic_write(meta, json.dumps({"format": FORMAT, "layer": self.layer, "classes": classes,
                                       "settings": self.settings}, indent=2) + "\n")
        return weights, meta

    @classmethod
    def load(cls, path: str | os.PathLike) -> LinearProbe:
        """Read a saved probe; its JSON and tensors are untrusted, so shapes and kinds are checked."""
        base = Path(path)
        meta_path = base.with_suffix(".json")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            raise ProbeError(f"{meta_path} cannot be read as a probe: {e}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ProbeError(f"{meta_path} is not an lmprobe probe")
        layer, classes, settings = meta.get("layer"), meta.get("classes"), meta.get("settings", {})
        ok_layer = isinstance(layer, int) or (isinstance(layer, list) and layer and all(isinstance(x, int)
                                                                                        for x in layer))
        if not ok_layer or not isinstance(classes, list) or not isinstance(settings, dict):
            raise ProbeError(f"{meta_path}: layer, classes or settings has the wrong type")
        w = load_file(base.with_suffix(".safetensors")).get("probe")
        if not isinstance(w, dict) or set(w) != {"mean", "scale", "coef", "intercept"}:
            raise ProbeError(f"{base.with_suffix('.safetensors')} does not hold a probe's mean, scale, coef, intercept")
        mean, scale, coef, intercept = (np.asarray(w[k], np.float32) for k in ("mean", "scale", "coef", "intercept"))
        dim = mean.shape[0] if mean.ndim == 1 else -1
        if (coef.ndim != 2 or scale.shape != (dim,) or coef.shape[1] != dim or intercept.shape != (coef.shape[0],)
                or not np.all(scale != 0)):
            raise ProbeError(f"{base.with_suffix('.safetensors')}: the probe's tensors do not fit together")
        return cls(layer, classes, mean, scale, coef, intercept, settings)
