"""The node-shared cache's bookkeeping against the downloads it manages.

    python benchmarks/bench_cache.py            # ~10 s
    python benchmarks/bench_cache.py --quick

Every piece a reader takes costs bookkeeping in the shared folder: its claim (under the folder's
lock: the folder's usage, the other readers' downloads and waits), its download's rename and its
release, each done without following a link (one O_NOFOLLOW open per folder on the way). A piece
downloads 64 MiB at full size. This measures, in one run:

- baseline: writing one 64 MiB file and renaming it into place on this disk (a download at local-disk
  speed, which no network beats);
- bookkeeping: the seconds per piece of 1 reader, with downloads that write one byte (so that only
  the bookkeeping is timed), windows of 3 pieces claimed together, a budget of six pieces;
- turns: the same for each of 3 readers sharing the folder and the budget (two windows fit at once,
  so they take turns; a waiting reader looks for room every 50 ms): the time per piece includes the
  waits. A reader that claims pieces one at a time (as the reader before did) deadlocks here: each holds two
  pieces of its window and waits for the others (it ends after ``patience``, 30 s here).

It prints each per-piece time as a fraction of the baseline (what it adds to a pass).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmprobe.storage.cache import BoundedCache  # noqa: E402


def baseline(folder: Path, mib: int = 64) -> float:
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    tmp = folder / "piece.part"
    with open(tmp, "wb") as f:
        for _ in range(mib):
            f.write(block)
    os.replace(tmp, folder / "piece")
    took = time.perf_counter() - t0
    (folder / "piece").unlink()
    return took


def _download(name, dst):
    with open(dst, "wb") as f:
        f.write(b"\1")


def readers(root: Path, n_readers: int, n_windows: int) -> float:
    """Seconds per piece taken, each of ``n_readers`` reading ``n_windows`` windows of 3 pieces."""
    sizes = {f"{r}-{w}-{i}": 1 for r in range(n_readers) for w in range(n_windows) for i in range(3)}
    caches = [BoundedCache(_download, 6, key="bench", sizes=sizes, root=root, workers=2, patience=30)
              for _ in range(n_readers)]
    errors: list[BaseException] = []

    def read(r, cache):
        try:
            windows = [[f"{r}-{w}-{i}" for i in range(3)] for w in range(n_windows)]
            for w in windows:
                cache.schedule(w)
            for w in windows:
                for name in w:
                    cache.get(name)
                for name in w:
                    cache.release(name)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(r, c)) for r, c in enumerate(caches)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    for c in caches:
        c.close()
    if errors:
        raise errors[0]
    return took / (n_windows * 3)  # the readers run at once: per piece of one reader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_windows = 30 if args.quick else 150
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = min(baseline(tmp) for _ in range(3))
        print(f"baseline: a 64 MiB piece written and renamed in {base * 1e3:.1f} ms")
        per = readers(tmp / "stream1", 1, n_windows)
        print(f"bookkeeping, 1 reader, windows of 3 pieces, budget 6 pieces: {per * 1e3:.2f} ms per piece "
              f"= {per / base:.3f} x the baseline")
        per = readers(tmp / "stream3", 3, n_windows)
        print(f"turns, 3 readers on the same budget: {per * 1e3:.2f} ms per piece of each reader, waits included "
              f"= {per / base:.3f} x the baseline")


if __name__ == "__main__":
    main()
