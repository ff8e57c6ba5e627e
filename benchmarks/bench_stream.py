"""Streaming training reader: shuffled vectors/s from local disk against a numpy copy of the same bytes.

    python benchmarks/bench_stream.py [--quick]
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

from lmprobe import load  # noqa: E402
from lmprobe.format.safetensors_io import read_header  # noqa: E402
from lmprobe.format.writer import DatasetWriter  # noqa: E402
from lmprobe.stream import ShardStream  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_prompts, tokens, dim = (200, 64, 128) if args.quick else (2000, 128, 1024)
    tmp = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    with DatasetWriter(tmp / "ds", layers=[0], dim=dim, model_name="bench", storage="full_sequence",
                       shard_size="64MB" if not args.quick else "1MB", checksums=False) as w:
        for _ in range(0, n_prompts, 50):
            acts = rng.normal(size=(50 * tokens, dim)).astype(np.float32)
            w.add_batch(texts=["x"] * 50, num_tokens=np.full(50, tokens), hidden={0: acts})
    ds = load(tmp / "ds")
    files = sorted((tmp / "ds/tensors").glob("*.safetensors"))
    entries = [(p, read_header(p).tensors["hidden.layer_0"]) for p in files]
    n_vec = sum(e.shape[0] for _, e in entries)

    def numpy_copy():
        return [np.fromfile(p, dtype=np.float32, count=(e.end - e.start) // 4, offset=e.start) for p, e in entries]

    numpy_copy()
    t0 = time.perf_counter()
    numpy_copy()
    t_np = time.perf_counter() - t0
    stream = ShardStream(ds, 0, 4096, seed=0, pool_shards=2, prefetch=2)
    t0 = time.perf_counter()
    count = sum(len(b) for b in stream)
    t_s = time.perf_counter() - t0
    assert count == n_vec
    print(f"streaming reader: {n_vec} vectors x {dim} dims ({n_vec * dim * 4 / 2**20:.0f} MiB, {len(files)} shards)")
    print(f"  numpy copy of the same bytes       {n_vec / t_np:12,.0f} vectors/s")
    print(f"  ShardStream (shuffled, prefetch)   {n_vec / t_s:12,.0f} vectors/s   ratio {t_np / t_s:.2f}")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
