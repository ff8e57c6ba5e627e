"""A probe sweep (layers x methods x folds) against scikit-learn alone on the same arrays, and its memory.

    python benchmarks/bench_probe.py                  # 4 layers x 5 methods x 5 folds, 2,000 prompts of width 512
    python benchmarks/bench_probe.py --full           # the issue's size: 32 layers, 10,000 prompts of width 4096
    python benchmarks/bench_probe.py --layers 8 --prompts 4000 --dim 1024

lmprobe: ``probe.sweep(ds, method=[logistic, ridge, mass_mean, mass_mean_iid, lda], cv=5)`` on a
dataset written to disk (every layer read from its shards inside the clock). Baseline, in the same
process on the same float32 arrays already in memory, with scikit-learn's ``cross_validate`` on
the same folds: StandardScaler + LogisticRegression, StandardScaler + RidgeClassifier,
NearestCentroid (the mass-mean rule: the nearest class mean is the side of the midpoint along
their difference), LinearDiscriminantAnalysis(solver="lsqr") (the covariance-corrected mass mean)
and LinearDiscriminantAnalysis(). Printed: each side's seconds and the ratio (target <= 2), and the
peak memory the sweep allocated (tracemalloc, numpy's allocations included) in units of one
layer's (N, dim) float32 features (target: bounded by a small multiple, not growing with layers).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lmprobe  # noqa: E402
import lmprobe.probe as probe  # noqa: E402
from lmprobe.format.writer import DatasetWriter  # noqa: E402
from lmprobe.probe.folds import make_folds  # noqa: E402

METHODS = ["logistic", "ridge", "mass_mean", "mass_mean_iid", "lda"]


def write(out: Path, layers: int, n: int, dim: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    d = rng.normal(size=dim).astype(np.float32) / np.sqrt(dim)
    with DatasetWriter(out, layers=list(range(layers)), dim=dim, model_name="bench", label_type="int",
                       shard_size="256MiB", statistics=False, checksums=False) as w:
        step = 2000
        for s in range(0, n, step):
            e = min(n, s + step)
            batch = {}
            for layer in range(layers):
                rows = rng.normal(size=(e - s, dim)).astype(np.float32)
                rows += (0.5 * layer / max(1, layers - 1)) * np.outer(y[s:e], d) * np.sqrt(dim)
                batch[layer] = rows
            w.add_batch(texts=[f"p{i}" for i in range(s, e)], num_tokens=np.ones(e - s, int),
                        labels=y[s:e].tolist(), hidden=batch)
    return y


def sklearn_alone(ds, y, layers: int, cv: int, seed: int) -> float:
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    from sklearn.linear_model import LogisticRegression, RidgeClassifier
    from sklearn.model_selection import cross_validate
    from sklearn.neighbors import NearestCentroid
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    arrays = [np.asarray(ds.hidden(layer), np.float32) for layer in range(layers)]  # in memory before the clock
    folds = make_folds(y, cv, seed=seed)
    ests = [make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000, random_state=seed)),
            make_pipeline(StandardScaler(), RidgeClassifier()), NearestCentroid(),
            LinearDiscriminantAnalysis(solver="lsqr"), LinearDiscriminantAnalysis()]
    t = time.perf_counter()
    for X in arrays:
        for est in ests:
            cross_validate(est, X, y, cv=folds, scoring={"accuracy": "accuracy", "auroc": "roc_auc"})
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="32 layers, 10,000 prompts, width 4096 (hours on 2 cores)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--cv", type=int, default=5)
    args = ap.parse_args()
    if args.full:
        args.layers, args.prompts, args.dim = 32, 10_000, 4096
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ds"
        y = write(out, args.layers, args.prompts, args.dim)
        ds = lmprobe.load(out)
        base = sklearn_alone(ds, y, args.layers, args.cv, 0)
        tracemalloc.start()
        t = time.perf_counter()
        table = probe.sweep(ds, method=METHODS, cv=args.cv, seed=0)
        ours = time.perf_counter() - t
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    layer_bytes = args.prompts * args.dim * 4
    print(f"{args.layers} layers x {len(METHODS)} methods x {args.cv} folds, {args.prompts} prompts of width "
          f"{args.dim} ({layer_bytes / 2**20:.0f} MiB a layer)")
    print(f"scikit-learn alone (arrays in memory): {base:.2f} s")
    print(f"lmprobe sweep (reading every layer):    {ours:.2f} s")
    print(f"ratio lmprobe / scikit-learn: {ours / base:.2f} (target <= 2)")
    print(f"peak memory allocated by the sweep: {peak / layer_bytes:.2f} x one layer's features")
    print(table.groupby("method").accuracy.mean().round(3).to_string())


if __name__ == "__main__":
    main()
