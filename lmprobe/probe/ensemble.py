"""``ProbeEnsemble``: probes averaged over bootstrap resamples of the prompts or over methods (0.10.3's
``ProbeEnsemble``); the spread of its members says how stable a direction is.

>>> ens = ProbeEnsemble.resampled("out/tiny", layer=2, n=20, method="mass_mean")   # doctest: +SKIP
>>> ens.predict(X), ens.direction_agreement()                                        # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..base.atomic import atomic_write
from ..errors import ProbeError
from .inputs import LayerArg, Pooling, probe_data
from .linear import LinearProbe
from .methods import check_method, fit, method_name

FORMAT = "lmprobe-probe-ensemble/1"


@dataclass
class ProbeEnsemble:
    """Members' scores averaged: for two classes the mean decision value, else the mean probabilities."""

    probes: list[LinearProbe]

    def __post_init__(self) -> None:
        if not self.probes:
            raise ProbeError("an ensemble needs at least one probe")
        if len({json.dumps(p.layer) for p in self.probes}) > 1 or len({p.coef.shape[1] for p in self.probes}) > 1:
            raise ProbeError("an ensemble's probes must read the same layer(s) and width")

    @property
    def layer(self):
        return self.probes[0].layer

    @property
    def classes(self) -> list:
        return self.probes[0].classes

    def decision_function(self, X: Any) -> np.ndarray:
        return np.mean([p.decision_function(X) for p in self.probes], axis=0)

    def predict_proba(self, X: Any) -> np.ndarray:
        return np.mean([p.predict_proba(X) for p in self.probes], axis=0)

    def predict(self, X: Any) -> np.ndarray:
        if self.probes[0].task == "regression":
            return self.decision_function(X)[:, 0]
        classes = np.asarray(self.classes, dtype=object if isinstance(self.classes[0], str) else None)
        return classes[self.predict_proba(X).argmax(axis=1)]

    def score(self, X: Any, y: Any) -> float:
        return float(np.mean(self.predict(X) == np.asarray(y)))

    @property
    def direction(self) -> np.ndarray:
        w = np.mean([p.direction for p in self.probes], axis=0)
        return (w / np.linalg.norm(w)).astype(np.float32)

    def direction_agreement(self) -> tuple[float, float]:
        """Mean and minimum cosine between each member's direction and the ensemble's."""
        d = self.direction
        cos = np.array([float(p.direction @ d) for p in self.probes])
        return float(cos.mean()), float(cos.min())

    def save(self, path: str | os.PathLike) -> Path:
        """``<path>.json`` naming the members, each saved as ``<path>-<i>``."""
        base = Path(path)
        names = []
        for i, p in enumerate(self.probes):
            p.save(base.with_name(f"{base.name}-{i}"))
            names.append(f"{base.name}-{i}")
        meta = base.with_suffix(".json")
        atomic_write(meta, json.dumps({"format": FORMAT, "members": names}, indent=2) + "\n")
        return meta

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProbeEnsemble:
        base = Path(path)
        try:
            meta = json.loads(base.with_suffix(".json").read_text())
        except (OSError, ValueError) as e:
            raise ProbeError(f"{base.with_suffix('.json')} cannot be read as a probe ensemble: {e}") from None
        members = meta.get("members") if isinstance(meta, dict) and meta.get("format") == FORMAT else None
        if not isinstance(members, list) or not all(isinstance(m, str) and m == Path(m).name for m in members):
            raise ProbeError(f"{base.with_suffix('.json')} is not an lmprobe probe ensemble")
        return cls([LinearProbe.load(base.with_name(m)) for m in members])  # names only: files beside it

    @classmethod
    def resampled(cls, ds: Any, layer: LayerArg, *, n: int = 10, method: Any = "logistic", label_column: str = "label",
                  task: str = "classification", pooling: Pooling = "last_token", hookpoint: str | None = None,
                  seed: int = 0, C: float = 1.0) -> ProbeEnsemble:
        """``n`` probes, each fitted on a bootstrap resample of the prompts (drawn with replacement)."""
        return cls.of_methods(ds, layer, methods=[method] * n, label_column=label_column, task=task, pooling=pooling,
                              hookpoint=hookpoint, seed=seed, C=C, resample=True)

    @classmethod
    def of_methods(cls, ds: Any, layer: LayerArg, *, methods: Sequence[Any] = ("logistic", "mass_mean"),
                   label_column: str = "label", task: str = "classification", pooling: Pooling = "last_token",
                   hookpoint: str | None = None, seed: int = 0, C: float = 1.0, resample: bool = False) -> ProbeEnsemble:
        """One probe per method on the same features (``resample``: each on its own bootstrap resample)."""
        data = probe_data(ds, label_column=label_column, task=task, pooling=pooling, hookpoint=hookpoint)
        for m in methods:
            check_method(m, task=task, n_classes=len(data.classes))
        X, blocks = data.features(layer)
        rng = np.random.default_rng(seed)
        layers = data.layers_list(layer)
        probes = []
        for i, m in enumerate(methods):
            rows = rng.integers(0, data.n, data.n) if resample else np.arange(data.n)
            if task == "classification" and len(np.unique(data.y[rows])) < len(data.classes):
                rows = np.arange(data.n)  # a resample that lost a class: use every row for this member
            f = fit(X[rows], data.y[rows], m, task=task, blocks=blocks, seed=seed + i, C=C)
            settings = {"method": method_name(m), "task": task, "label_column": label_column, "pooling": pooling,
                        "hookpoint": hookpoint, "seed": seed + i, "member": i, "resampled": resample}
            probes.append(LinearProbe.from_fit(f, layers[0] if isinstance(layer, (int, np.integer)) else layers,
                                               settings))
        return cls(probes)
