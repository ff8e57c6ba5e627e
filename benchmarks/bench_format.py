"""Format benchmarks: writer throughput, bulk reads, streaming memory. Prints ratios to same-run baselines.

    python benchmarks/bench_format.py            # full sizes (about 2 GB of temporary files)
    python benchmarks/bench_format.py --quick    # small sizes, a smoke run

Baselines, measured in the same run on the same bytes:
- write: plain ``f.write`` of every batch into one file per layer (what any writer must at least do);
- read: ``np.fromfile`` of each shard's tensor bytes into one array (the fastest obvious numpy read);
- per-row: the format document's loop, ``safe_open(...).get_tensor(key)[row_offset]`` per prompt.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmprobe import load  # noqa: E402
from lmprobe.format.safetensors_io import read_header  # noqa: E402
from lmprobe.format.writer import DatasetWriter  # noqa: E402


def best_of(n, fn):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_write(tmp: Path, n_prompts: int, dim: int, layers: int, batch: int, shard: str, reps: int) -> None:
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(batch, dim)).astype(np.float32) for _ in range(4)]
    n_batches = n_prompts // batch
    total = n_batches * batch * dim * 4 * layers

    def plain():
        d = tmp / "plain"
        d.mkdir(exist_ok=True)
        files = [open(d / f"l{i}.bin", "wb") for i in range(layers)]
        for b in range(n_batches):
            for f in files:
                f.write(batches[b % 4])
        for f in files:
            f.close()
        shutil.rmtree(d)

    def ours(checksums: bool):
        def run():
            d = tmp / "ours"
            with DatasetWriter(d, layers=list(range(layers)), dim=dim, model_name="bench", shard_size=shard,
                               checksums=checksums, overwrite=True) as w:
                for b in range(n_batches):
                    w.add_batch(texts=[""] * batch, num_tokens=np.ones(batch, dtype=np.int64),
                                hidden={i: batches[b % 4] for i in range(layers)})
            shutil.rmtree(d)

        return run

    t_plain = best_of(reps, plain)
    t_ours = best_of(reps, ours(False))
    t_sha = best_of(reps, ours(True))
    gb = total / 1e9
    print(f"write {n_prompts} prompts x {layers} layers x {dim} dims float32 ({gb:.2f} GB), shards of {shard}")
    print(f"  plain file writes          {gb / t_plain:6.2f} GB/s")
    print(f"  DatasetWriter, no sha256   {gb / t_ours:6.2f} GB/s   ratio {t_plain / t_ours:.2f} (target >= 0.7)")
    print(f"  DatasetWriter, sha256      {gb / t_sha:6.2f} GB/s   ratio {t_plain / t_sha:.2f}")


def bench_read(tmp: Path, n_prompts: int, dim: int, shard: str, reps: int, per_row_sample: int) -> None:
    d = tmp / "read"
    rng = np.random.default_rng(1)
    batch = 5000
    with DatasetWriter(d, layers=[0], dim=dim, model_name="bench", shard_size=shard, checksums=False,
                       overwrite=True) as w:
        for s in range(0, n_prompts, batch):
            b = min(batch, n_prompts - s)
            w.add_batch(texts=[""] * b, num_tokens=np.ones(b, dtype=np.int64),
                        hidden={0: rng.normal(size=(b, dim)).astype(np.float32)})
    ds = load(d)
    files = sorted((d / "tensors").glob("hidden_layer000_*.safetensors"))
    entries = [(p, read_header(p).tensors["hidden.layer_0"]) for p in files]

    def numpy_read():
        parts = [np.fromfile(p, dtype=np.float32, count=(e.end - e.start) // 4, offset=e.start) for p, e in entries]
        return np.concatenate(parts).reshape(-1, dim)

    def ours():
        return ds.hidden(0)

    np.testing.assert_array_equal(numpy_read(), ours())
    t_np = best_of(reps, numpy_read)
    t_ours = best_of(reps, ours)

    from safetensors import safe_open

    df = ds.index
    hidden = ds.info["tensors"]["hidden_layers"]
    rows = np.linspace(0, n_prompts - 1, per_row_sample).astype(int)

    def per_row():
        for i in rows:
            row = df.iloc[i]
            filename = d / hidden["file_pattern"].format(layer=0, shard=row["shard_index"])
            with safe_open(str(filename), framework="np") as f:
                f.get_tensor(hidden["key_pattern"].format(layer=0))[row["row_offset"]]

    t_row = best_of(1, per_row) / per_row_sample * n_prompts
    gb = n_prompts * dim * 4 / 1e9
    print(f"read .hidden(layer) of {n_prompts} prompts x {dim} dims ({gb:.2f} GB, {len(files)} shards of {shard})")
    print(f"  numpy fromfile of the same bytes   {t_np:7.3f} s  {gb / t_np:6.2f} GB/s")
    print(f"  ds.hidden(layer)                   {t_ours:7.3f} s  {gb / t_ours:6.2f} GB/s   ratio {t_np / t_ours:.2f} (target >= 0.7)")
    print(f"  document's per-row loop (est.)     {t_row:7.1f} s  (from {per_row_sample} rows)   speed-up {t_row / t_ours:.0f}x")
    shutil.rmtree(d)


_RSS_CHILD = r"""
import sys, numpy as np

def hwm():  # peak RSS of this process (VmHWM resets at exec, unlike ru_maxrss)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

sys.path.insert(0, sys.argv[4])
from lmprobe.format.writer import DatasetWriter
out, budget, dim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
layers, batch = 4, 256
total_rows = 5 * budget // (dim * 4)     # the dataset is five shard budgets per layer
x = np.random.default_rng(0).normal(size=(batch, dim)).astype(np.float32)
w = DatasetWriter(out, layers=list(range(layers)), dim=dim, model_name="bench", shard_size=budget, overwrite=True)
base = hwm()
for s in range(0, total_rows, batch):
    w.add_batch(texts=["p"] * batch, num_tokens=np.ones(batch, dtype=np.int64), hidden={i: x for i in range(layers)})
w.close()
peak = hwm()
print(base * 1024, peak * 1024, total_rows * dim * 4 * layers)
"""


def bench_rss(tmp: Path, budget: int, dim: int) -> None:
    root = str(Path(__file__).resolve().parent.parent)
    r = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(tmp / "rss"), str(budget), str(dim), root],
                       capture_output=True, text=True, check=True)
    base, peak, written = (int(x) for x in r.stdout.split())
    grow = peak - base
    print(f"peak RSS writing {written / 2**20:.0f} MiB (5 budgets of {budget / 2**20:.0f} MiB per layer, 4 layers)")
    print(f"  RSS after imports {base / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB, growth {grow / 2**20:.1f} MiB"
          f" = {grow / budget:.2f} budgets (target < 3)")
    shutil.rmtree(tmp / "rss")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmprobe-bench-"))
    try:
        if args.quick:
            bench_rss(tmp, 8 * 2**20, 256)
            bench_write(tmp, 4000, 256, 2, 500, "1MB", 2)
            bench_read(tmp, 5000, 256, "1MB", 2, 20)
        else:
            bench_rss(tmp, 128 * 2**20, 1024)
            bench_write(tmp, 40000, 1024, 4, 1000, "256MB", 5)
            bench_read(tmp, 100_000, 1024, "128MB", 5, 50)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"(max RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
          f"cpu count {os.cpu_count()})")


if __name__ == "__main__":
    main()
