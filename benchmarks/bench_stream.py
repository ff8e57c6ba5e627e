"""The training reader against the floor of any shuffled reader, measured in the same run.

    python benchmarks/bench_stream.py [--quick]
    python benchmarks/bench_stream.py --fresh 10     # a 230 MB layer in 10 fresh processes

- speed: ShardStream with global shuffling vs the read-plus-gather floor of the same bytes (read
  every shard with np.fromfile, gather every row into a batch by a random permutation), local files
  in the page cache; 1 rank, and 2 ranks in two processes at once (against the floor's one core);
- shuffle quality: on a dataset stored sorted by label, the spread of the label fraction across
  batches against uniform sampling's (binomial), and how many shards a batch draws from;
- memory: peak RSS growth of a fresh process reading a dataset 4x its budget, against the budget;
- fresh processes: a 230 MB float32 layer, in each of N fresh processes the floor and a fresh reader
  (as a user makes one) in turn, 3 times: the median ratio per process, the kernel CPU time of a
  pass (fresh memory faulting in), and the same for the reader as it was (one pool the size of the
  layer, allocated every pass), emulated in the same processes.
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


def reader(path: Path, batch: int, memory: str = "1GiB", rank: int = 0, world: int = 1) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for b in ShardStream(path, 0, batch, seed=0, memory=memory, rank=rank, world_size=world):
        b.sum()
        n += len(b)
    return time.perf_counter() - t0, n


def fresh_child(path: Path, batch: int) -> None:
    """One fresh process of ``--fresh``: floor, reader and the reader as it was, in turn, 3 times; one JSON line."""
    import resource

    def old_reader():  # the reader before: a pool as large as memory allows (the whole layer), new every pass
        s = ShardStream(path, 0, batch, seed=0)
        e = s.engine
        e.pool_rows = (2**30 - 4 * batch * e.source.dim * 4) // (2 * e.source.dim * 4) - batch
        e._set_block_rows()
        for b in s:
            b.sum()

    def measure(fn):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        fn()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter() - t0, r1.ru_stime - r0.ru_stime, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime

    floor(path, batch)  # the page cache, as in the other sections
    runs: dict[str, list] = {"floor": [], "reader": [], "before": []}
    for _ in range(3):
        runs["floor"].append(measure(lambda: floor(path, batch)))
        runs["reader"].append(measure(lambda: reader(path, batch, "1GiB")))
        runs["before"].append(measure(old_reader))
    med = {k: [float(np.median([r[i] for r in v])) for i in range(3)] for k, v in runs.items()}
    print(json.dumps({"ratio": med["floor"][0] / med["reader"][0], "ratio_before": med["floor"][0] / med["before"][0],
                      "cpu_ratio": med["floor"][2] / med["reader"][2], "sys": med["reader"][1],
                      "sys_before": med["before"][1], "sys_floor": med["floor"][1], "floor_s": med["floor"][0]}))


def fresh(n_proc: int) -> None:
    import os

    tmp = Path(tempfile.mkdtemp())
    try:
        write(tmp / "ds", 56_320, 1024, "64MB")  # 230.7 MB of float32
        print(f"fresh processes: a 230.7 MB float32 layer (56,320 x 1024, 64 MB shards), batch 4096, default memory; "
              f"in each of {n_proc} fresh processes the floor and a fresh reader in turn, 3 times (medians); load "
              f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        print("  process   ratio (target >= 0.8)   CPU ratio   kernel s/pass   | the reader before: ratio   kernel s/pass")
        rows = []
        for i in range(n_proc):
            out = subprocess.run([sys.executable, __file__, "--fresh-child", str(tmp / "ds")], capture_output=True,
                                 text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            rows.append(r)
            print(f"  {i:7d}   {r['ratio']:21.2f}   {r['cpu_ratio']:9.2f}   {r['sys']:13.3f}   | "
                  f"{r['ratio_before']:24.2f}   {r['sys_before']:13.3f}", flush=True)
        print(f"  min / median: now {min(r['ratio'] for r in rows):.2f} / {np.median([r['ratio'] for r in rows]):.2f}, "
              f"before {min(r['ratio_before'] for r in rows):.2f} / {np.median([r['ratio_before'] for r in rows]):.2f}; "
              f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(tmp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fresh", type=int, default=None, metavar="N", help="the 230 MB layer in N fresh processes")
    ap.add_argument("--fresh-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=5, metavar=("PATH", "BATCH", "MEMORY", "RANK", "WORLD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fresh_child:
        fresh_child(Path(args.fresh_child), 4096)
        return
    if args.fresh:
        fresh(args.fresh)
        return
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
