"""Feature arrays for the probe tests: two classes apart along a known direction, and a pooled dataset that
holds exactly given arrays."""

from __future__ import annotations

import numpy as np

from lmprobe.format.writer import DatasetWriter


def gaussian(rng, n=400, dim=16, shift=1.0, correlated=True):
    """Two classes apart along a known direction, with correlated noise (so that iid and plain differ)."""
    y = np.arange(n) % 2
    A = rng.normal(size=(dim, dim)) if correlated else np.eye(dim)
    X = rng.normal(size=(n, dim)) @ A + 3.0
    d = rng.normal(size=dim)
    X[y == 1] += shift * d
    return X.astype(np.float32), y


def write(out, X_by_layer, y, texts=None, storage="pooled", **cols):
    """A pooled dataset holding exactly these feature arrays, labels and extra index columns."""
    n = len(y)
    with DatasetWriter(out, layers=sorted(X_by_layer), dim=next(iter(X_by_layer.values())).shape[1], model_name="m",
                       label_type="int", storage=storage,
                       columns={k: ("string" if isinstance(v[0], str) else "int64") for k, v in cols.items()}) as w:
        w.add_batch(texts=texts or [f"t{i}" for i in range(n)], num_tokens=np.ones(n, dtype=int), labels=[int(v) for v in y],
                    hidden={k: v.astype(np.float32) for k, v in X_by_layer.items()}, columns=cols or None)
