"""The merge's memory and the index's size on disk, against the token count.

    python benchmarks/bench_merge_memory.py                      # 8 parts, 10^6 and 10^7 tokens in all
    python benchmarks/bench_merge_memory.py --old /tmp/old       # and the merge of another checkout, same parts
    python benchmarks/bench_merge_memory.py --tokens 1e6 --token-ids

Parts like a corpus extraction's (full_sequence, one layer of width 1 so that shards are small, windows of
1,024 tokens with ~4 characters of text a token, document and window_start columns), written by DatasetWriter.
Each merge runs in a fresh process: peak RSS above that process's baseline (imports done), for the order a
torchrun job merges in (``positions``: rows dealt round-robin) and part after part (``concat``: lmprobe merge).
Also printed: the index's bytes per stored token, in the parts (the writer's) and merged.
The target: a merge of 10^7 tokens within 512 MiB of its baseline, the same at 10^6 and 10^7.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INDEX = "index/train-00000-of-00001.parquet"

WRITE = r"""
import sys
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[1])
from lmprobe.format.writer import DatasetWriter
work, n_tokens, n_parts, token_ids = Path(sys.argv[2]), int(float(sys.argv[3])), int(sys.argv[4]), sys.argv[5] == "1"
per, batch = 1024, 16
rng = np.random.default_rng(0)
# text with English-like statistics, never repeated: words drawn from a Zipf law over 20,000 made-up words
alphabet = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
vocab = np.array(["".join(rng.choice(alphabet, size=int(n))) for n in rng.integers(2, 9, size=20000)])
for k in range(n_parts):
    with DatasetWriter(work / f"p{k}", layers=[0], dim=1, model_name="m", storage="full_sequence", corpus=True,
                       shard_size="256MB", checksums=False, token_ids=token_ids) as w:
        h = np.zeros((per * batch, 1), np.float32)
        rows = n_tokens // n_parts // per
        for s in range(0, rows, batch):
            b = min(batch, rows - s)
            ranks = np.minimum(rng.zipf(1.1, size=(b, per * 4 // 5)), 20000) - 1  # ~0.8 words a token
            texts = [" ".join(vocab[r]) for r in ranks]
            doc = [(s + i) // 4 * n_parts + k for i in range(b)]  # 4 windows a document, documents dealt round-robin
            kw = {"token_ids": [rng.integers(0, 128000, size=per) for _ in range(b)]} if token_ids else {}
            w.add_batch(texts=texts, num_tokens=[per] * b, hidden={0: h[: per * b]}, document=doc,
                        window_start=[(s + i) % 4 * per for i in range(b)], **kw)
"""

MERGE = r"""
import json, resource, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from lmprobe.format.merge import plan_merge
from lmprobe.format.reader import open_local
work, order, n_parts = Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
out = work / f"merged-{order}"
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
dss = [open_local(work / f"p{k}") for k in range(n_parts)]
out.mkdir()
plan_merge(dss, order=order).finish(dss, out)
print(json.dumps({"growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
                  "seconds": time.perf_counter() - t0}))
"""


def run(code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    lines = r.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def index_bytes(path: Path) -> int:
    return os.path.getsize(path / INDEX)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="*", type=float, default=[1e6, 1e7])
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--token-ids", action="store_true", help="the index also holds every token's id")
    ap.add_argument("--old", default=None, help="another checkout (e.g. `git archive` of main) whose merge runs on "
                    "the same parts: the baseline")
    ap.add_argument("--orders", nargs="*", default=["positions", "concat"])
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmprobe-bench-merge-"))
    rows = []
    try:
        for n in args.tokens:
            d = work / f"{n:g}"
            d.mkdir()
            t0 = time.perf_counter()
            run(WRITE, str(ROOT), str(d), str(n), str(args.parts), "1" if args.token_ids else "0")
            write_s = time.perf_counter() - t0
            parts_b = sum(index_bytes(d / f"p{k}") for k in range(args.parts))
            if args.old:  # the same parts written by the other checkout's writer: its index encodings
                od = work / f"{n:g}-old"
                od.mkdir()
                run(WRITE, args.old, str(od), str(n), str(args.parts), "1" if args.token_ids else "0")
                old_b = sum(index_bytes(od / f"p{k}") for k in range(args.parts))
                shutil.rmtree(od)
                print(f"{n:9.3g} tokens  the writer's index: {parts_b / n:6.3f} B/token, old {old_b / n:6.3f} "
                      f"(new/old {parts_b / old_b:.3f})", flush=True)
            for order in args.orders:
                for name, tree in [("new", ROOT)] + ([("old", Path(args.old))] if args.old else []):
                    m = run(MERGE, str(tree), str(d), order, str(args.parts))
                    merged = index_bytes(d / f"merged-{order}")
                    shutil.rmtree(d / f"merged-{order}")
                    rows.append({"tokens": n, "order": order, "tree": name, **m, "merged_index_bytes": merged,
                                 "parts_index_bytes": parts_b, "write_s": write_s})
                    print(f"{n:9.3g} tokens  {order:9s} {name}: merge peak +{m['growth_mib']:6.1f} MiB "
                          f"in {m['seconds']:5.2f} s; index {merged / n:6.3f} B/token merged, "
                          f"{parts_b / n:6.3f} in the parts", flush=True)
            shutil.rmtree(d)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for order in args.orders:
        new = [r for r in rows if r["order"] == order and r["tree"] == "new"]
        if len(new) > 1:
            print(f"{order}: peak at {new[-1]['tokens']:.3g} tokens / at {new[0]['tokens']:.3g}: "
                  f"{new[-1]['growth_mib'] / new[0]['growth_mib']:.2f}")
        for r in new:
            old = [o for o in rows if o["order"] == order and o["tree"] == "old" and o["tokens"] == r["tokens"]]
            if old:
                print(f"{order} at {r['tokens']:.3g} tokens: peak new/old {r['growth_mib'] / old[0]['growth_mib']:.2f}, "
                      f"merged index new/old {r['merged_index_bytes'] / old[0]['merged_index_bytes']:.3f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
