"""SAE dictionary projection: batched throughput and single-vector latency at 16k features x 1024 dims.

    python benchmarks/bench_sae.py [--quick]

Baselines in the same run: a dense numpy matmul of the same (densified) matrix with the same top-k
selection, and scipy.sparse CSR x dense when scipy is installed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmprobe.sae import SAEConfig, load_dictionary, project_topk, project_topk_batch  # noqa: E402
from lmprobe.sae.export import export_sae  # noqa: E402
from lmprobe.sae.loader import _topk_from_scores, dense_encoder  # noqa: E402


def best(n, fn):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    F, D, per_feature, B, k = (2048, 256, 32, 64, 32) if args.quick else (16384, 1024, 128, 512, 64)
    rng = np.random.default_rng(0)
    W = rng.normal(size=(F, D)).astype(np.float32)
    b = rng.normal(size=F).astype(np.float32) * 0.01
    tmp = Path(tempfile.mkdtemp())
    export_sae(layer=0, root=tmp, dictionary="bench", W_enc=W, b_enc=b, orientation="out_in",
               topk_per_feature=per_feature)
    layer = load_dictionary(SAEConfig(root_path=tmp, dictionary_name="bench", device="cpu")).get_layer(0)
    X = rng.normal(size=(B, D)).astype(np.float32)
    Wd = dense_encoder(layer).copy()
    bias = layer.bias.astype(np.float32)

    def dense_baseline():
        S = X @ Wd.T + bias
        return [_topk_from_scores(np, row, k) for row in S]

    assert dense_baseline() == project_topk_batch(layer, X, k)
    t_dense = best(3, dense_baseline)
    t_ours = best(3, lambda: project_topk_batch(layer, X, k))
    print(f"{F} features x {D} dims, {per_feature} weights per feature ({layer.nnz} nnz, "
          f"{layer.nnz / (F * D):.1%} dense), batch {B}, top-{k}")
    print(f"  dense numpy matmul + top-k      {B / t_dense:9.0f} vectors/s")
    print(f"  project_topk_batch              {B / t_ours:9.0f} vectors/s   ratio {t_dense / t_ours:.2f}")
    try:
        import scipy.sparse as sp

        csr = sp.csr_matrix((layer.data.astype(np.float32), layer.indices, layer.indptr), shape=layer.shape)

        def scipy_baseline():
            S = (csr @ X.T).T + bias
            return [_topk_from_scores(np, row, k) for row in S]

        t_sp = best(3, scipy_baseline)
        print(f"  scipy.sparse CSR @ X + top-k    {B / t_sp:9.0f} vectors/s   ours/scipy {t_sp / t_ours:.2f}")
    except ImportError:
        print("  scipy not installed: no sparse baseline")
    x = X[0]
    project_topk(layer, x, k)
    t_one = best(20, lambda: project_topk(layer, x, k))
    t_one_dense = best(20, lambda: _topk_from_scores(np, Wd @ x + bias, k))
    sparse_layer = load_dictionary(SAEConfig(root_path=tmp, dictionary_name="bench", device="cpu")).get_layer(0)
    project_topk(sparse_layer, x, k)
    t_sparse = best(20, lambda: project_topk(sparse_layer, x, k))
    print(f"  single vector, sparse CSR path  {t_sparse * 1e3:7.2f} ms")
    print(f"  single vector, dense cache      {t_one * 1e3:7.2f} ms   (bare dense matvec + top-k {t_one_dense * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
