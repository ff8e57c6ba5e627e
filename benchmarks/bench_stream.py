"""The training reader against the floor of any shuffled reader, measured in the same run.

    python benchmarks/bench_stream.py [--quick]

- speed: ShardStream with global shuffling vs the read-plus-gather floor of the same bytes (read
  every shard with np.fromfile, gather every row into a batch by a random permutation), local files
  in the page cache; 1 rank, and 2 ranks in two processes at once (against the floor's one core);
- shuffle quality: on a dataset stored sorted by label, the spread of the label fraction across
  batches against uniform sampling's (binomial), and how many shards a batch draws from;
- memory: peak RSS growth of a fresh process reading a dataset 4x its budget, against the budget.
"""

from __future__ import annotations

import argparse
import json
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
from lmprobe.stream import ShardStream  # noqa: E402


def write(path: Path, n: int, dim: int, shard: str, *, sorted_labels: bool = False) -> None:
    rng = np.random.default_rng(0)
    with DatasetWriter(path, layers=[0], dim=dim, model_name="bench", shard_size=shard, checksums=False,
                       statistics=False, label_type="int" if sorted_labels else None) as w:
        for a in range(0, n, 8192):
            b = min(8192, n - a)
            x = rng.normal(size=(b, dim)).astype(np.float32)
            labels = None
            if sorted_labels:
                labels = [int(i >= n // 2) for i in range(a, a + b)]
                x[:, 0] = labels
                x[:, 1] = np.arange(a, a + b)  # the row, to tell which shard a vector came from
            w.add_batch(texts=["x"] * b, num_tokens=[1] * b, hidden={0: x}, labels=labels)


def floor(path: Path, batch: int) -> float:
    """Seconds to read every byte of the layer and gather every row into a batch once."""
    entries = [(p, read_header(p).tensors["hidden.layer_0"]) for p in sorted((path / "tensors").glob("*.safetensors"))]
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    for p, e in entries:
        x = np.fromfile(p, dtype=np.float32, count=(e.end - e.start) // 4, offset=e.start).reshape(e.shape)
        order = rng.permutation(len(x))
        for i in range(0, len(x), batch):
            x[order[i : i + batch]].sum()  # touch it, as a consumer would
    return time.perf_counter() - t0


def reader(path: Path, batch: int, memory: str, rank: int = 0, world: int = 1) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for b in ShardStream(path, 0, batch, seed=0, memory=memory, rank=rank, world_size=world):
        b.sum()
        n += len(b)
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", nargs=5, metavar=("PATH", "BATCH", "MEMORY", "RANK", "WORLD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        path, batch, memory, rank, world = args.child
        import threading

        def anon() -> int:  # resident anonymous memory: mapped shard pages are page cache, not the reader's
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
            return 0

        base, peak, done = anon(), [0], threading.Event()

        def sample() -> None:
            while not done.wait(0.005):
                peak[0] = max(peak[0], anon())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t, n = reader(Path(path), int(batch), memory, int(rank), int(world))
        done.set()
        sampler.join()
        grow = max(peak[0], anon()) - base
        print(json.dumps({"seconds": t, "vectors": n, "rss_growth": grow}))
        return
    n, dim, batch = (40_000, 256, 1024) if args.quick else (262_144, 1024, 4096)
    memory = "64MiB" if args.quick else "256MiB"
    tmp = Path(tempfile.mkdtemp())
    try:
        write(tmp / "ds", n, dim, "8MB" if args.quick else "64MB")
        size = n * dim * 4
        floor(tmp / "ds", batch)  # warm the page cache
        t_floor = min(floor(tmp / "ds", batch) for _ in range(3))
        t_read = min(reader(tmp / "ds", batch, memory)[0] for _ in range(3))
        print(f"training reader: {n:,} vectors x {dim} dims ({size / 2**20:.0f} MiB), batch {batch}, memory {memory}")
        print(f"  read + gather floor              {n / t_floor:12,.0f} vectors/s")
        print(f"  ShardStream, global shuffle      {n / t_read:12,.0f} vectors/s   ratio {t_floor / t_read:.2f}")

        def children(world: int) -> list[dict]:
            procs = [subprocess.Popen([sys.executable, __file__, "--child", str(tmp / "ds"), str(batch), memory,
                                       str(r), str(world)], stdout=subprocess.PIPE, text=True) for r in range(world)]
            return [json.loads(p.communicate()[0]) for p in procs]

        two = children(2)
        t_two = max(c["seconds"] for c in two)  # both ran at once: the pass ends with the slower one
        assert sum(c["vectors"] for c in two) == n
        print(f"  2 ranks at once (2 processes)    {n / t_two:12,.0f} vectors/s   ratio {t_floor / t_two:.2f} "
              "(against the one-core floor)")
        one = children(1)[0]
        budget = ShardStream(tmp / "ds", 0, batch, memory=memory).engine
        print(f"  peak anonymous RSS growth, 1 rank: {one['rss_growth'] / 2**20:.0f} MiB for a {memory} budget "
              f"({size / 2**20:.0f} MiB of data; pools of {budget.pool_rows:,} rows, blocks of {budget.block_rows})")

        # shuffle quality on label-sorted data
        write(tmp / "sorted", n, 64, "2MB", sorted_labels=True)
        ds = load(tmp / "sorted")
        shard = ds.column("shard_index")
        qb = 1024
        for name, kw in (("global shuffle (default)", {}),
                         ("2-shard pool (the reader on main)", {"block_rows": 8192, "memory": "8MiB"})):
            batches = list(ShardStream(ds, 0, qb, seed=0, drop_last=True, **kw))
            frac = np.array([b[:, 0].mean() for b in batches])
            spread = frac.std() / np.sqrt(0.25 / qb)
            shards = np.median([len(np.unique(shard[b[:, 1].astype(np.int64)])) for b in batches])
            print(f"  label-sorted data, {name:34s}: label-fraction spread {spread:5.2f} x binomial, "
                  f"{shards:.0f} shards per batch (median)")
        print(f"  ({len(np.unique(shard))} shards; uniform sampling gives 1.00)")
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
