"""saev export and reader benchmarks.

    python benchmarks/bench_saev.py [--quick]

Baselines in the same run: writing the same bytes with plain file writes (export), a numpy copy of
the same bytes out of the shard files (shuffled reader); random-access latency of SaevDataset.get.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmprobe.format.writer import DatasetWriter  # noqa: E402
from lmprobe.saev import SaevDataset, export_saev  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_prompts, tokens, D, layers, T = (200, 64, 128, 2, 32) if args.quick else (2000, 128, 768, 2, 128)
    tmp = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    with DatasetWriter(tmp / "src", layers=list(range(layers)), dim=D, model_name="bench", storage="full_sequence",
                       token_ids=True, checksums=False) as w:
        for _ in range(0, n_prompts, 50):
            n = np.full(50, tokens)
            acts = rng.normal(size=(50 * tokens, D)).astype(np.float32)
            w.add_batch(texts=["x"] * 50, num_tokens=n, hidden={i: acts for i in range(layers)},
                        token_ids=[list(range(tokens))] * 50)
    t = time.perf_counter()
    out = export_saev(tmp / "src", tmp / "dump", context_len=T, patches_per_shard=T * layers * 256, quiet=True)
    t_export = time.perf_counter() - t
    files = sorted(out.glob("acts*.bin"))
    total = sum(f.stat().st_size for f in files)
    blob = np.frombuffer(np.random.default_rng(1).bytes(64 * 2**20), dtype=np.uint8)

    def plain():
        d = tmp / "plain"
        d.mkdir(exist_ok=True)
        for f in files:
            size = f.stat().st_size
            with open(d / f.name, "wb") as g:
                for a in range(0, size, len(blob)):
                    g.write(blob[: min(len(blob), size - a)])
        shutil.rmtree(d)

    t0 = time.perf_counter()
    plain()
    t_plain = time.perf_counter() - t0
    print(f"export: {total / 2**20:.0f} MiB of saev shards ({n_prompts} prompts x {tokens} tokens, {layers} layers, "
          f"d_model {D}, T={T})")
    print(f"  plain file writes of the same bytes {total / t_plain / 1e9:6.2f} GB/s")
    print(f"  export_saev (read source + write)   {total / t_export / 1e9:6.2f} GB/s   ratio {t_plain / t_export:.2f}"
          " (target >= 0.8)")

    sv = SaevDataset(out)
    n_vec = sv.n_ex * T

    def numpy_copy():
        return [np.array(sv.shard(i)[:, 0]).reshape(-1, D) for i in range(len(sv.shards))]

    numpy_copy()
    t0 = time.perf_counter()
    numpy_copy()
    t_np = time.perf_counter() - t0
    t0 = time.perf_counter()
    count = sum(len(b) for b in sv.batches(sv.layers[0], 4096, seed=0))
    t_b = time.perf_counter() - t0
    assert count == n_vec
    print(f"shuffled reader, layer {sv.layers[0]}: {n_vec} vectors")
    print(f"  numpy copy of the same bytes        {n_vec / t_np:12,.0f} vectors/s")
    print(f"  SaevDataset.batches (shuffled)      {n_vec / t_b:12,.0f} vectors/s   ratio {t_np / t_b:.2f}")
    idx = rng.integers(0, sv.n_ex, size=2000)
    toks = rng.integers(0, T, size=2000)
    t0 = time.perf_counter()
    for e, tk in zip(idx, toks, strict=True):
        sv.get(int(e), sv.layers[-1], int(tk))
    t_get = (time.perf_counter() - t0) / len(idx)
    print(f"random access SaevDataset.get         {t_get * 1e6:8.1f} us per vector")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
