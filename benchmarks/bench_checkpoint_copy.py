"""What the checkpoint copies of a Hub job cost a rank, at a rank's share of W1 (or any size).

    python benchmarks/bench_checkpoint_copy.py                         # 2 x 10^6 tokens, ~1 min
    python benchmarks/bench_checkpoint_copy.py --tokens 1.56e7         # one rank's share of W1 (10^9 / 64)
    python benchmarks/bench_checkpoint_copy.py --tokens 1.56e7 --token-ids

A rank writing to the Hub keeps a copy of its writer's last checkpoint on the Hub (storage/hubresume.py), so that
it resumes on another node: its index rows so far, its state and the list of its shards, rewritten as one parquet
file about once a commit, on the writer's thread, and uploaded with the next commit. Its cost grows with the part:
each copy holds every row so far, so a job's copies together weigh about (copies / 2) x the part's index.

One part is written the way a corpus extraction writes it (DatasetWriter: full_sequence, windows of ``--window``
tokens with ~4 characters of text a token, a shard of width 1 for each window so that the part lists as many shards
as a W1 rank's 1 GiB shards), and a copy is made at every ``--every``-th checkpoint, as the Hub output makes them
(``write_resume``, the function it calls). Printed, for the last copy (the largest):
- its bytes, and its bytes per stored token;
- its seconds against the floor measured in the same run: reading the same index parts and writing them as one
  parquet file (what any copy of the rows must do), as a ratio;
and, for a job making ``--copies`` copies a rank (W1: ~27 commits while ranks extract, one copy a rank each), the
bytes a rank uploads for them and the seconds its writer spends making them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lmprobe.base.units import format_size  # noqa: E402
from lmprobe.format.writer import DatasetWriter  # noqa: E402
from lmprobe.storage.hubresume import write_resume  # noqa: E402


def floor_copy(staging: Path, parts: int, dst: Path) -> float:
    """Seconds to read the index parts and write them as one zstd parquet file: the least a copy does."""
    t0 = time.perf_counter()
    tables = [pq.read_table(staging / "index" / f"part-{i:06d}.parquet") for i in range(parts)]
    pq.write_table(pa.concat_tables(tables), dst, compression="zstd")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=float, default=2e6, help="the part's stored tokens (W1: 1.56e7 a rank)")
    ap.add_argument("--window", type=int, default=8192, help="tokens a window (row)")
    ap.add_argument("--every", type=int, default=8, help="a copy at every N-th checkpoint")
    ap.add_argument("--copies", type=int, default=27, help="copies a rank makes over the job (W1: ~27)")
    ap.add_argument("--token-ids", action="store_true", help="the index also holds every token's id")
    args = ap.parse_args()
    per, batch = args.window, 4
    rows = int(args.tokens) // per
    rng = np.random.default_rng(0)
    alphabet = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    vocab = np.array(["".join(rng.choice(alphabet, size=int(n))) for n in rng.integers(2, 9, size=20000)])
    copies: list[tuple[float, float, int, Path, dict]] = []  # (seconds, floor seconds, bytes, staging, state)
    checkpoints = [0]
    with tempfile.TemporaryDirectory(prefix="lmprobe-bench-copy-") as tmp:
        work = Path(tmp)

        def on_checkpoint(staging: Path, state: dict, files: dict) -> None:
            checkpoints[0] += 1
            if checkpoints[0] % args.every:
                return
            dst = work / f"copy-{checkpoints[0]}.parquet"
            t0 = time.perf_counter()
            write_resume(staging, state, files, dst)
            seconds = time.perf_counter() - t0
            floor = floor_copy(staging, state["index_parts"], work / "floor.parquet")
            copies.append((seconds, floor, dst.stat().st_size, staging, state))
            dst.unlink()

        h = np.zeros((per * batch, 1), np.float32)
        t_write = time.perf_counter()
        with DatasetWriter(work / "part", layers=[0], dim=1, model_name="m", storage="full_sequence", corpus=True,
                           shard_size=f"{per * 4}B", token_ids=args.token_ids,
                           on_file_complete=lambda path, **kw: None, on_checkpoint=on_checkpoint) as w:
            for s in range(0, rows, batch):
                b = min(batch, rows - s)
                ranks = np.minimum(rng.zipf(1.1, size=(b, per * 4 // 5)), 20000) - 1  # ~0.8 words a token
                kw = {"token_ids": [rng.integers(0, 128000, size=per) for _ in range(b)]} if args.token_ids else {}
                w.add_batch(texts=[" ".join(vocab[r]) for r in ranks], num_tokens=[per] * b,
                            hidden={0: h[: per * b]}, document=[s + i for i in range(b)],
                            window_start=[0] * b, **kw)
            w.checkpoint()
        t_write = time.perf_counter() - t_write
    if not copies:
        raise SystemExit("no copy was made: give more --tokens or a smaller --every")
    seconds, floor, size, _, state = copies[-1]
    tokens = state.get("n_tokens") or args.tokens
    print(f"one part: {rows:,} windows of {per:,} tokens ({rows * per:,} tokens){', token ids' if args.token_ids else ''}, "
          f"{checkpoints[0]} checkpoints, {len(copies)} copies made; written in {t_write:.0f} s")
    print(f"  the last copy: {format_size(size)} ({size / tokens:.2f} B/token), {seconds:.2f} s; the floor "
          f"(read the parts, write one file) {floor:.2f} s: ratio {seconds / floor:.2f}")
    growth = [c[2] for c in copies]
    print(f"  copies' sizes grow with the rows: first {format_size(growth[0])}, last {format_size(growth[-1])}")
    total = args.copies * size / 2
    print(f"  a job of {args.copies} copies a rank: ~{format_size(total)} uploaded by each rank for them, "
          f"~{args.copies * seconds / 2:.0f} s of its writer's time (against {format_size(rows * per * 3 * 8192)} of "
          "W1-shaped shards: 3 sites of 4,096 bfloat16 values a token)")


if __name__ == "__main__":
    main()
