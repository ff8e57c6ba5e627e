"""Training from a remote dataset in a bounded cache: mixing against the cache budget, link speed, a soak.

    python benchmarks/bench_remote.py                 # mixing table and link speed (~3 min)
    python benchmarks/bench_remote.py --quick         # small sizes
    python benchmarks/bench_remote.py --soak 1e8      # the soak: 10^8 stored tokens, cache <= 1/10 of the data

Everything runs against the local Hub test server (tests/hub_server.py) on 127.0.0.1, started here,
with HF_HOME and LMPROBE_CACHE in a temporary folder.

- Mixing: a label-sorted dataset (all 0s, then all 1s) streamed with ``ShardStream`` for several
  cache budgets; the spread of the label fraction across batches against a uniform sample's
  (binomial: 1.00 is perfect mixing). The local global shuffle is printed beside it.
- Link speed: the server's downloads throttled to one shared link of RATE (the loopback is faster
  than the reader); a pass of ``ShardStream`` (consuming every batch) against a plain parallel
  download of the same shard files (4 threads) from the same server in the same run.
- Soak: a dataset of N stored tokens (width 4) pushed to the server and streamed for one epoch with
  a cache of at most a tenth of its size; every vector served once (the sum of all vectors equals the
  local reading's), local disk use sampled during the run never above the budget, reader RSS flat.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def du(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                pass
    return total


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def write_sorted(path: Path, n: int, dim: int, shard: str) -> None:
    from lmprobe.format.writer import DatasetWriter

    rng = np.random.default_rng(0)
    with DatasetWriter(path, layers=[0], dim=dim, model_name="bench", shard_size=shard, label_type="int",
                       statistics=False) as w:
        for a in range(0, n, 8192):
            b = min(8192, n - a)
            x = rng.normal(size=(b, dim)).astype(np.float32)
            labels = [int(i >= n // 2) for i in range(a, a + b)]
            x[:, 0] = labels
            w.add_batch(texts=["x"] * b, num_tokens=[1] * b, hidden={0: x}, labels=labels)


def push(server, path: Path) -> str:
    import lmprobe

    repo = f"bench/remote-{uuid.uuid4().hex[:8]}"
    lmprobe.push_to_hub(path, repo, quiet=True)
    return f"hf://datasets/{repo}"


def spread(batches: list[np.ndarray], b: int) -> float:
    frac = np.array([x[:, 0].mean() for x in batches])
    return float(frac.std() / np.sqrt(0.25 / b))


def bench_mixing(server, tmp: Path, quick: bool) -> None:
    """Mixing against the number of pieces the cache holds: pieces of 64 KiB here stand for 4 MiB pieces of a
    dataset 64x larger (what matters is the cache's size in pieces)."""
    import lmprobe.stream.sources as sources
    from lmprobe.stream import ShardStream

    n, dim, shard = (65_536, 64, "2MiB") if quick else (262_144, 64, "8MiB")
    write_sorted(tmp / "sorted", n, dim, shard)
    url = push(server, tmp / "sorted")
    sources.PIECE_BYTES = 64 * 2**10
    total = n * dim * 4
    pieces = total // sources.PIECE_BYTES
    b = 1024
    local = spread(list(ShardStream(tmp / "sorted", 0, b, seed=0, drop_last=True, memory="64MiB")), b)
    print(f"mixing: {n:,} label-sorted vectors x {dim} ({total / 2**20:.0f} MiB in {shard} shards, {pieces} pieces of "
          f"64 KiB), batch {b}, memory 64MiB; label-fraction spread against a uniform sample's (1.00 = uniform)")
    print(f"  local dataset, global shuffle                                    {local:5.2f}x")
    for k in (4, 16, 64, 256, 1024):
        if k > pieces:
            break
        budget = 2 * k * sources.PIECE_BYTES
        s = ShardStream(url, 0, b, seed=0, drop_last=True, memory="64MiB", cache=budget)
        batches = list(s)
        peak = s.engine.source.cache().peak
        s.close()
        print(f"  cache {budget / 2**20:6.1f} MiB ({budget / total:6.1%} of the data), K = {s.resident:4d} pieces resident "
              f"{spread(batches, b):5.2f}x   peak on disk {peak / 2**20:6.1f} MiB")
    sources.PIECE_BYTES = 4 * 2**20
    s = ShardStream(url, 0, b, seed=0, drop_last=True, memory="64MiB")  # the default cache and 4 MiB pieces
    batches = list(s)
    print(f"  default cache ({s.cache_budget / 2**30:.1f} GiB here) and 4 MiB pieces: K = {s.resident} pieces resident "
          f"(the whole dataset)                {spread(batches, b):5.2f}x")
    s.close()
    print(f"  a K-piece resident set varies like a sample of K pieces: spread ~ sqrt(1 + B / K) for batch B; "
          f"<= 1.5x needs K >= 0.8 B ({int(0.8 * b)} pieces here; a 20 GiB cache holds 2,560 of 4 MiB)")


def bench_link(server, tmp: Path, quick: bool, rate: float) -> None:
    import lmprobe
    from lmprobe.stream import ShardStream

    n, dim, shard = (65_536, 128, "2MiB") if quick else (262_144, 256, "8MiB")
    write_sorted(tmp / "link", n, dim, shard)
    url = push(server, tmp / "link")
    ds = lmprobe.load(url)
    files = ds.files
    rels = [f.rel for f in ds.meta.files() if f.rel.startswith("tensors/hidden")]
    total = sum(f.bytes for f in ds.meta.files() if f.rel in rels)
    cache = max(total // 4, 4 * max(f.bytes for f in ds.meta.files() if f.rel in rels))
    server.throttle(rate)

    def plain():
        d = tmp / "plain"
        d.mkdir(exist_ok=True)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda rel: files.download(rel, d / rel.replace("/", "_")), rels))
        shutil.rmtree(d)

    def ours():
        s = ShardStream(url, 0, 4096, seed=0, cache=cache, memory="64MiB")
        for batch in s:
            batch.sum()
        s.close()

    tp, to = [], []
    for _ in range(2 if quick else 3):
        t = time.perf_counter()
        plain()
        tp.append(time.perf_counter() - t)
        t = time.perf_counter()
        ours()
        to.append(time.perf_counter() - t)
    server.throttle(None)
    ratios = sorted(a / b for a, b in zip(tp, to, strict=True))
    print(f"link speed: {total / 2**20:.0f} MiB of shards, server throttled to one link of {rate / 2**20:.0f} MiB/s, "
          f"cache {cache / 2**20:.0f} MiB (a quarter of the data)")
    print(f"  plain parallel download (4 threads)  {', '.join(f'{total / t / 2**20:.0f}' for t in tp)} MiB/s")
    print(f"  ShardStream pass                     {', '.join(f'{total / t / 2**20:.0f}' for t in to)} MiB/s")
    print(f"  ratio min / median / max {ratios[0]:.2f} / {float(np.median(ratios)):.2f} / {ratios[-1]:.2f} "
          "(target >= 0.9)")


def bench_soak(server, tmp: Path, tokens: int) -> None:
    from lmprobe.format.writer import DatasetWriter
    from lmprobe.stream import ShardStream

    dim, per_prompt = 4, 1024
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    path = tmp / "soak"
    step = 256 * per_prompt
    with DatasetWriter(path, layers=[0], dim=dim, model_name="bench", storage="full_sequence", shard_size="64MiB",
                       statistics=False) as w:
        for a in range(0, tokens, step):
            k = min(step, tokens - a) // per_prompt
            if k == 0:
                break
            w.add_batch(texts=[""] * k, num_tokens=[per_prompt] * k,
                        hidden={0: rng.standard_normal((k * per_prompt, dim), dtype=np.float32)})
    stored = sum(p.stat().st_size for p in (path / "tensors").glob("*.safetensors"))
    t_write = time.perf_counter() - t0
    local = ShardStream(path, 0, 65536, seed=0, memory="256MiB")
    want = np.zeros(dim)
    n_local = 0
    for b in local:
        want += b.sum(axis=0, dtype=np.float64)
        n_local += len(b)
    t0 = time.perf_counter()
    url = push(server, path)
    t_push = time.perf_counter() - t0
    budget = stored // 10
    stream = ShardStream(url, 0, 65536, seed=0, memory="256MiB", cache=budget)
    cache_dir = stream.engine.source.cache().dir
    samples, rss_samples, done = [], [], threading.Event()

    def sample():
        while not done.wait(0.05):
            samples.append(du(cache_dir))
            rss_samples.append(rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    got = np.zeros(dim)
    n = 0
    t0 = time.perf_counter()
    for b in stream:
        got += b.sum(axis=0, dtype=np.float64)
        n += len(b)
    t_stream = time.perf_counter() - t0
    done.set()
    sampler.join()
    stream.close()
    quarter = max(1, len(rss_samples) // 4)
    print(f"soak: {n_local:,} stored tokens x {dim} ({stored / 1e9:.2f} GB in 64 MiB shards), written in "
          f"{t_write:.0f} s, pushed to the local Hub server in {t_push:.0f} s")
    print(f"  one epoch from the Hub with cache={budget / 2**20:.0f} MiB (a tenth of the data): {n:,} vectors in "
          f"{t_stream:.0f} s ({n / t_stream / 1e6:.2f} M vectors/s)")
    print(f"  every vector once: {n == n_local}; sum of all vectors equals the local reading's: "
          f"{bool(np.allclose(got, want, rtol=1e-9))} (max relative difference {np.max(np.abs(got - want) / np.abs(want)):.1e})")
    print(f"  local disk use, {len(samples)} samples: max {max(samples) / 2**20:.0f} MiB (budget {budget / 2**20:.0f} MiB)")
    print(f"  reader RSS: first quarter median {np.median(rss_samples[:quarter]) / 2**20:.0f} MiB, last quarter "
          f"median {np.median(rss_samples[-quarter:]) / 2**20:.0f} MiB, max {max(rss_samples) / 2**20:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--soak", type=float, default=None, metavar="TOKENS", help="run the soak with this many tokens")
    ap.add_argument("--rate", type=float, default=64 * 2**20, help="link throttle in bytes/s (default 64 MiB/s)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmprobe-remote-"))
    import socket

    with socket.socket() as sock:  # the server's port, known before huggingface_hub reads its settings
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"HF_HOME": str(tmp / "hf-home"), "LMPROBE_CACHE": str(tmp / "lmprobe-cache"),
                       "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_DISABLE_XET": "1",
                       "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"})
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        os.environ.pop(var, None)
    from hub_server import HubServer

    server = HubServer(tmp / "hub", port=port).start()
    try:
        if args.soak:
            bench_soak(server, tmp, int(args.soak))
        else:
            bench_mixing(server, tmp, args.quick)
            bench_link(server, tmp, args.quick, args.rate)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
