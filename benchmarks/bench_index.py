"""Index memory and time at corpus scale: writer and reader peak RSS, load time, against token count.

    python benchmarks/bench_index.py                 # 10^6, 10^7 and 10^8 stored tokens
    python benchmarks/bench_index.py --tokens 1e6 3.07e7
    python benchmarks/bench_index.py --quick         # 10^5 and 10^6

Synthetic full_sequence datasets written by DatasetWriter (one layer, dim 4, 256 tokens per
prompt, as in the corpus-scale issue), each measurement in a fresh process:
- writer: peak RSS of the process that writes the dataset (close included);
- reader: peak RSS over lmprobe.load + token_hidden of 20 random prompts + hidden(layer), the
  time lmprobe.load takes, and the median time of one token_hidden call.
The baseline is the smallest size in the same run: memory should not grow with tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WRITE = r"""
import json, resource, sys, time
import numpy as np
sys.path.insert(0, sys.argv[3])
from lmprobe.format import DatasetWriter
out, n_tokens = sys.argv[1], int(float(sys.argv[2]))
per, batch = 256, 64
n_prompts = n_tokens // per
t0 = time.perf_counter()
with DatasetWriter(out, layers=[0], dim=4, model_name="bench", storage="full_sequence", shard_size="256MB",
                   checksums=False) as w:
    h = np.zeros((per * batch, 4), np.float32)
    for s in range(0, n_prompts, batch):
        b = min(batch, n_prompts - s)
        w.add_batch(texts=[f"prompt {i}" for i in range(s, s + b)], num_tokens=[per] * b, hidden={0: h[: per * b]})
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

READ = r"""
import json, resource, sys, time
import numpy as np
sys.path.insert(0, sys.argv[2])
import lmprobe
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
ds = lmprobe.load(sys.argv[1])
load_s = time.perf_counter() - t0
rng = np.random.default_rng(0)
times = []
for i in rng.integers(0, ds.num_prompts, 20):
    t = time.perf_counter()
    ds.token_hidden(int(i), 0)
    times.append(time.perf_counter() - t)
ds.hidden(0)
print(json.dumps({"load_s": load_s, "token_hidden_ms": 1000 * float(np.median(times)),
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "import_mib": base}))
"""


def run(code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="*", type=float, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--lmprobe", default=str(ROOT), help="the checkout to measure (for before/after runs)")
    args = ap.parse_args()
    sizes = args.tokens or ([1e5, 1e6] if args.quick else [1e6, 1e7, 1e8])
    work = Path(tempfile.mkdtemp(prefix="lmprobe-bench-index-"))
    rows = []
    try:
        for n in sizes:
            out = work / f"ds-{int(n)}"
            w = run(WRITE, str(out), str(n), args.lmprobe)
            r = run(READ, str(out), args.lmprobe)
            index = out / "index/train-00000-of-00001.parquet"
            rows.append((int(n), index.stat().st_size, w, r))
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("full_sequence, 1 layer, dim 4, 256 tokens per prompt; each figure from a fresh process")
    print(f"{'stored tokens':>14} {'index MB':>9} {'write s':>8} {'writer peak MiB':>16} {'load s':>7} "
          f"{'reader peak MiB':>16} {'token_hidden ms':>16}")
    for n, size, w, r in rows:
        print(f"{n:>14,} {size / 1e6:>9.1f} {w['seconds']:>8.1f} {w['peak_mib']:>16.0f} {r['load_s']:>7.2f} "
              f"{r['peak_mib']:>16.0f} {r['token_hidden_ms']:>16.2f}")
    n0, _, w0, r0 = rows[0]
    for n, _, w, r in rows[1:]:
        print(f"{n:,} vs {n0:,} tokens: reader peak +{r['peak_mib'] - r0['peak_mib']:.0f} MiB, load +"
              f"{r['load_s'] - r0['load_s']:.2f} s; writer peak +{w['peak_mib'] - w0['peak_mib']:.0f} MiB "
              "(targets: under 100 MiB and 1 s at 30.7M)")


if __name__ == "__main__":
    main()
