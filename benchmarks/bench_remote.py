"""Training from a remote dataset with many ranks: requests, amplification, mixing, the node cache, a storm, memory.

    python benchmarks/bench_remote.py                  # every section but the soak (~10 min)
    python benchmarks/bench_remote.py --only requests  # or amplification | mixing | pieces | node | storm | memory | link
    python benchmarks/bench_remote.py --quick          # small sizes
    python benchmarks/bench_remote.py --soak 1e8       # the soak: 10^8 stored tokens, cache <= 1/10 of the data

Everything runs against the local Hub test server (tests/support/hub_server.py) on 127.0.0.1, started here,
with HF_HOME and LMPROBE_CACHE in a temporary folder. The server counts every request and the bytes
of every answer, so the figures are what the Hub would see.

- requests: an epoch of a layer stored in 64 MiB shard files (the issue's reference layout), every
  request counted (repo description, index, headers, data): MiB per request, requests per GiB, and
  requests per second per rank at 1 GB/s against the Hub's published limits.
- amplification: 1, 2 and 4 ranks (in turn, in this process; the plan is the same in any process):
  bytes all ranks download together over the layer's bytes; every vector served once.
- mixing: a label-sorted dataset (40% 0s, then 60% 1s), a cache of a quarter of the data, pieces
  of 64 KiB standing for 64 MiB ones of a dataset 1,024 times larger (what matters is how many
  pieces the data and the cache hold); the spread of the label fraction across one rank's batches
  against a uniform sample's (1.00 = uniform), for resident groups chosen by strata (now) and at
  random (the reader before, emulated in the same run).
- pieces: pieces sized for mixing at 1/64 scale: a 1.6 GiB label-sorted layer, batches
  of 4,096, a cache of a quarter of it (spread against uniform, pieces chosen and given) and of all of it
  (bytes per request).
- node: 4 ranks in 4 processes on one machine sharing one cache folder (LOCAL_WORLD_SIZE=4): bytes
  downloaded by the node, the folder's peak against its budget (sampled every millisecond).
- storm: a fifth of the range requests answered 429 or 503: an epoch's time against a calm one.
- memory: the plan's bookkeeping at 10^10 stored tokens (tracemalloc peak of building a pass's plan
  and two windows; a synthetic layer, nothing on disk).
- link: the server's downloads throttled to one shared link; a pass against a plain parallel
  download of the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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

MiB = 2**20


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


def write(path: Path, n: int, dim: int, shard: str, *, sorted_labels: bool = False, boundary: float = 0.4) -> None:
    """A layer of ``n`` vectors; labels 0 for the first ``boundary`` of the rows, then 1 (a publisher's sort
    order, falling where the reader's strata do not)."""
    from lmprobe.format.writer import DatasetWriter

    rng = np.random.default_rng(0)
    with DatasetWriter(path, layers=[0], dim=dim, model_name="bench", shard_size=shard, label_type="int",
                       statistics=False) as w:
        for a in range(0, n, 8192):
            b = min(8192, n - a)
            x = rng.normal(size=(b, dim)).astype(np.float32)
            labels = [int(i >= int(boundary * n)) for i in range(a, a + b)]
            if sorted_labels:
                x[:, 0] = labels
            x[:, 1] = np.arange(a, a + b)  # the row: every vector once is checked with it
            w.add_batch(texts=["x"] * b, num_tokens=[1] * b, hidden={0: x}, labels=labels)


def push(path: Path) -> str:
    import lmprobe

    repo = f"bench/remote-{uuid.uuid4().hex[:8]}"
    lmprobe.push_to_hub(path, repo, quiet=True)
    return f"hf://datasets/{repo}"


def layer_bytes(url: str) -> int:
    import lmprobe

    return sum(f.bytes for f in lmprobe.load(url).meta.files() if f.rel.startswith("tensors/hidden"))


def tensor_bytes(server, since: int) -> int:
    return sum(b for m, p, _, b in server.transfers[since:] if m == "GET" and "tensors" in p)


def epoch(url: str, **kw) -> np.ndarray:
    """Every batch's row ids (component 1) of one pass."""
    from lmprobe.stream import ShardStream

    s = ShardStream(url, 0, kw.pop("batch", 4096), **kw)
    rows = np.concatenate([b[:, 1].astype(np.int64) for b in s])
    s.close()
    return rows


# ----------------------------------------------------------------------------- sections


def bench_requests(server, tmp: Path, quick: bool) -> None:
    n, dim = (65_536, 1024) if quick else (262_144, 1024)  # 256 MiB or 1 GiB of float32 in 64 MiB shard files
    write(tmp / "req", n, dim, "64MiB")
    url = push(tmp / "req")
    total = layer_bytes(url)
    print(f"requests: {n:,} vectors x {dim} ({total / MiB:.0f} MiB in 64 MiB shard files), batch 4096, "
          "cache 512 MiB a rank, default pieces (64 MiB)")
    for world in (1, 4):
        log0, t0 = len(server.log), len(server.transfers)
        rows = np.concatenate([epoch(url, seed=0, rank=r, world_size=world, cache="512MiB", memory="256MiB")
                               for r in range(world)])
        requests = len(server.log) - log0
        served = sum(b for *_, b in server.transfers[t0:])
        per_gib = requests / (served / 2**30)
        assert len(np.unique(rows)) == len(rows) == n
        print(f"  {world} rank(s): {requests} requests (repo description, index, headers, data; all ranks) for "
              f"{served / MiB:.0f} MiB: {served / requests / MiB:5.1f} MiB per request, {per_gib:5.1f} requests "
              f"per GiB; at 1 GB/s a rank makes {per_gib * 1e9 / 2**30:4.1f} requests/s")
    rate = 1e9 / (64 * MiB)
    print(f"  the Hub's limits for resolve requests: 5,000 / 5 min free (16.7/s), 12,000 PRO (40/s), 100,000-"
          f"500,000 on the largest plans (333-1,667/s): one rank at 1 GB/s needs ~{rate:.1f}/s; 64 ranks "
          f"~{64 * rate:.0f}/s")


def bench_amplification(server, tmp: Path, quick: bool) -> None:
    n, dim = (32_768, 1024) if quick else (131_072, 1024)
    for shard, piece in (("64MiB", None), ("256MiB", "64MiB")):
        write(tmp / f"amp{shard}", n, dim, shard)
        url = push(tmp / f"amp{shard}")
        total = layer_bytes(url)
        cut = f", {piece} pieces" if piece else " (a shard is one piece)"
        print(f"amplification: {total / MiB:.0f} MiB in {shard} shard files{cut}; bytes all ranks download "
              "together over the layer's bytes")
        for world in (1, 2, 4):
            t0 = len(server.transfers)
            kw = {"piece": piece} if piece else {}
            shares = [epoch(url, seed=1, rank=r, world_size=world, cache="1GiB", memory="256MiB", **kw)
                      for r in range(world)]
            every = np.concatenate(shares)
            once = len(np.unique(every)) == len(every) == n
            sizes = [len(s) for s in shares]
            print(f"  {world} rank(s): {tensor_bytes(server, t0) / total:5.3f}x   every vector once: {once}   "
                  f"vectors per rank {min(sizes):,}-{max(sizes):,}")


def bench_mixing(server, tmp: Path, quick: bool) -> None:
    import lmprobe.stream.engine as engine_mod
    from lmprobe.stream import ShardStream

    piece = 64 * 1024
    n, dim = (131_072, 16) if quick else (524_288, 16)  # 8 MiB (128 pieces) or 32 MiB (512 pieces)
    write(tmp / "sorted", n, dim, "256KiB", sorted_labels=True)
    url = push(tmp / "sorted")
    total = n * dim * 4
    real_groups = engine_mod.groups

    def random_groups(n_parts, k, rng):  # the reader before: K pieces drawn at random
        k = max(1, min(int(k), n_parts))
        return rng.permutation(n_parts) // k if n_parts else np.zeros(0, np.int64)

    print(f"mixing: {n:,} label-sorted vectors x {dim} ({total / MiB:.0f} MiB, {total // piece} pieces of 64 KiB "
          f"standing for 64 MiB ones), cache a quarter of the data ({total / 4 / MiB:.0f} MiB); the spread of a "
          "rank's batches' label fraction against a uniform sample's (1.00 = uniform), 2 seeds")
    print("  ranks  batch  K (pieces resident)  groups by strata (now)  random groups (before)   bound sqrt(1 + B/K^2)")
    for world, batch in ((1, 256), (1, 1024), (1, 4096), (4, 256), (4, 1024)):
        out = {}
        for name, fn in (("strata", real_groups), ("random", random_groups)):
            engine_mod.groups = fn
            spreads = []
            for seed in (0, 1):
                with _local_world(world):  # the ranks of one machine share its cache (the budget)
                    s = ShardStream(url, 0, batch, seed=seed, drop_last=True, cache=str(total // 4),
                                    piece=str(piece), memory="256MiB", rank=world - 1, world_size=world)
                fr = np.array([b[:, 0].mean() for b in s])
                k = s.resident
                s.close()
                spreads.append(fr.std() / np.sqrt(0.24 / batch))  # 60% of the labels are 1
            out[name] = spreads
        engine_mod.groups = real_groups
        fmt = lambda v: " / ".join(f"{x:5.2f}" for x in v)  # noqa: E731
        print(f"  {world:5d}  {batch:5d}  {k:19d}  {fmt(out['strata']):>21s}  {fmt(out['random']):>22s}   "
              f"{np.sqrt(1 + batch / k**2):6.2f}")


def bench_pieces(server, tmp: Path, quick: bool) -> None:
    """Pieces sized for mixing (no piece=), both ends, at 1/64 scale: a 1.6 GiB label-sorted
    layer in 64 MiB shard files is 25.6 MiB in 1 MiB files, pieces of 1-64 MiB are 16 KiB-1 MiB."""
    import lmprobe.stream.plan as plan_mod
    from lmprobe.stream import ShardStream

    scale = 64
    plan_mod.MIN_PIECE, plan_mod.MAX_PIECE = MiB // scale, 64 * MiB // scale
    n, dim = (102_400, 16) if quick else (409_600, 16)  # 6.25 or 25 MiB: 400 MiB or 1.6 GiB at full size
    write(tmp / "sorted", n, dim, "1MiB", sorted_labels=True)
    url = push(tmp / "sorted")
    total = n * dim * 4
    batch = 4096
    print(f"pieces: {n:,} label-sorted vectors x {dim} ({total / MiB:.1f} MiB standing for {total * scale / 2**30:.1f} "
          f"GiB; 1 MiB shard files for 64 MiB ones), batches of {batch}; sizes below at full scale")
    print("  cache            piece (chosen)   K   spread vs uniform (2 seeds)   bound   MiB per request")
    for label, cache, piece in (("a quarter", total // 4, None), ("a quarter", total // 4, str(MiB // scale * 4)),
                                ("a quarter", total // 4, str(64 * MiB // scale)),
                                ("the whole layer", layer_bytes(url), None)):  # its files, headers included
        spreads, per_request = [], []
        for seed in (0, 1):
            t0 = len(server.transfers)
            kw = {"piece": piece} if piece else {}
            s = ShardStream(url, 0, batch, seed=seed, drop_last=True, cache=str(cache), memory="256MiB", **kw)
            fr = np.array([b[:, 0].mean() for b in s])
            k, chosen = s.resident, s.piece_bytes
            s.close()
            spreads.append(fr.std() / np.sqrt(0.24 / batch))  # 60% of the labels are 1
            data = [b for m, p, _, b in server.transfers[t0:] if m == "GET" and "tensors" in p]
            per_request.append(sum(data) / max(1, len(data)))
        how = "chosen" if piece is None else "given"
        print(f"  {label:15s}  {chosen * scale / MiB:5.0f} MiB ({how})  {k:4d}  "
              f"{' / '.join(f'{x:5.2f}' for x in spreads):>26s}   {np.sqrt(1 + batch / k**2):5.2f}   "
              f"{np.mean(per_request) * scale / MiB:6.1f}")


class _local_world:
    """LOCAL_WORLD_SIZE for the readers made inside (as torchrun sets it)."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.old = os.environ.get("LOCAL_WORLD_SIZE")
        os.environ["LOCAL_WORLD_SIZE"] = str(self.n)

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = self.old


_NODE_RANK = """
import json, sys, threading, time
import numpy as np
from lmprobe.storage.cachedir import usage
from lmprobe.stream import ShardStream
url, rank, budget, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
s = ShardStream(url, 0, 4096, seed=3, rank=rank, world_size=4, cache=budget, memory="256MiB")
folder = s.engine.source.cache().folder
peak, done = [0], threading.Event()
def sample():
    while not done.wait(0.001):
        try:
            peak[0] = max(peak[0], usage(folder))
        except OSError:
            pass
threading.Thread(target=sample, daemon=True).start()
t = time.perf_counter()
rows = np.concatenate([b[:, 1].astype(np.int64) for b in s])
done.set()
np.save(out, rows)
c = s.engine.source.cache()
print(json.dumps({"peak": peak[0], "seconds": time.perf_counter() - t, "downloaded": c.downloaded, "shared": c.shared}))
s.close()
"""


def bench_node(server, tmp: Path, quick: bool) -> None:
    n, dim = (65_536, 1024) if quick else (262_144, 1024)
    write(tmp / "node", n, dim, "32MiB")
    url = push(tmp / "node")
    total = layer_bytes(url)
    budget = 512 * MiB
    env = {**os.environ, "LOCAL_WORLD_SIZE": "4", "LMPROBE_CACHE": str(tmp / "node-cache"),
           "PYTHONPATH": str(ROOT)}
    t0 = len(server.transfers)
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", _NODE_RANK, url, str(r), str(budget), str(tmp / f"node{r}.npy")],
                              env=env, stdout=subprocess.PIPE, text=True) for r in range(4)]
    infos = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    wall = time.perf_counter() - start
    rows = np.concatenate([np.load(tmp / f"node{r}.npy") for r in range(4)])
    print(f"node: 4 ranks in 4 processes on one machine, one cache folder of {budget / MiB:.0f} MiB "
          f"(LOCAL_WORLD_SIZE=4: each rank holds at most a quarter), {total / MiB:.0f} MiB in 32 MiB shard files")
    print(f"  bytes the node downloaded / layer bytes {tensor_bytes(server, t0) / total:5.3f}; every vector once: "
          f"{len(np.unique(rows)) == len(rows) == n}; {wall:.1f} s for the epoch")
    print(f"  the folder's peak, sampled by each rank every ms: {max(i['peak'] for i in infos) / MiB:.0f} MiB "
          f"(budget {budget / MiB:.0f} MiB); pieces downloaded {sum(i['downloaded'] for i in infos)}, found "
          f"downloaded by another rank {sum(i['shared'] for i in infos)}; files left afterwards: "
          f"{len([p for p in (tmp / 'node-cache').rglob('*') if p.is_file() and p.name != '.lock'])}")


def bench_storm(server, tmp: Path, quick: bool) -> None:
    import lmprobe.storage.hub as hub_mod

    n, dim = (32_768, 256) if quick else (131_072, 256)
    write(tmp / "storm", n, dim, "4MiB")
    url = push(tmp / "storm")
    hub_mod.BASE_WAIT = 0.05
    calm, stormy = [], []
    for _ in range(2):
        t = time.perf_counter()
        epoch(url, seed=2, cache="64MiB", memory="64MiB")
        calm.append(time.perf_counter() - t)
        storm = server.storm(0.2, pattern=r"/resolve/.*tensors", headers={"Retry-After": "0"}, seed=len(stormy))
        t = time.perf_counter()
        rows = epoch(url, seed=2, cache="64MiB", memory="64MiB")
        stormy.append(time.perf_counter() - t)
        server.clear_faults()
        assert len(np.unique(rows)) == len(rows) == n
    hub_mod.BASE_WAIT = 1.0
    print(f"storm: {n:,} vectors x {dim} ({n * dim * 4 / MiB:.0f} MiB in 4 MiB shards, a request each), a fifth of "
          f"the range requests answered 429 or 503 (Retry-After 0; backoff from 50 ms): {storm.hits} refused in the "
          f"last epoch; every vector once in each")
    print(f"  epoch calm {', '.join(f'{t:.2f}' for t in calm)} s, in the storm {', '.join(f'{t:.2f}' for t in stormy)} s")


def bench_memory() -> None:
    import tracemalloc

    from lmprobe.stream.engine import Engine

    class Rows:  # 10^10 rows of 4096 bfloat16 (80 TB) in 64 MiB shard files: 1.22 M shards, one piece each
        n_sites, dim, dtype = 1, 4096, "bfloat16"
        shard_rows = np.full(1_220_704, 8192, dtype=np.int64)
        shard_rows[-1] = 10**10 - 8192 * (len(shard_rows) - 1)

    print("memory: the plan of a pass over 10^10 stored tokens (4096 bfloat16, 64 MiB shard files: 1.22 M pieces), "
          "batch 4096, memory 1 GiB; tracemalloc peak of the engine, the pass's plan and its first and last windows")
    for rank, world, k in ((0, 1, 160), (3, 64, 20)):
        tracemalloc.start()
        t = time.perf_counter()
        engine = Engine(Rows(), 4096, seed=0, shuffle=True, rank=rank, world=world, memory=2**30, drop_last=False)
        engine.set_resident(k, k * 8192)
        plan = engine.pass_plan(0)
        plan.window(0), plan.window(plan.n_windows - 1)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"  rank {rank} of {world}, K = {k}: {peak / MiB:6.1f} MiB peak ({time.perf_counter() - t:.1f} s), "
              f"{plan.n_windows:,} windows, {len(plan.share):,} pieces in this rank's share")


def bench_link(server, tmp: Path, quick: bool, rate: float) -> None:
    import lmprobe

    n, dim, shard = (65_536, 128, "2MiB") if quick else (262_144, 256, "8MiB")
    write(tmp / "link", n, dim, shard)
    url = push(tmp / "link")
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
        epoch(url, seed=0, cache=cache, memory="64MiB")

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
    print(f"link speed: {total / MiB:.0f} MiB of shards, server throttled to one link of {rate / MiB:.0f} MiB/s, "
          f"cache {cache / MiB:.0f} MiB (a quarter of the data)")
    print(f"  plain parallel download (4 threads)  {', '.join(f'{total / t / MiB:.0f}' for t in tp)} MiB/s")
    print(f"  ShardStream pass                     {', '.join(f'{total / t / MiB:.0f}' for t in to)} MiB/s")
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
    url = push(path)
    t_push = time.perf_counter() - t0
    budget = max(stored // 10, 2 * 65 * MiB)
    stream = ShardStream(url, 0, 65536, seed=0, memory="256MiB", cache=budget)
    cache_dir = stream.engine.source.cache().folder
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
    print(f"  one epoch from the Hub with cache={budget / MiB:.0f} MiB: {n:,} vectors in {t_stream:.0f} s "
          f"({n / t_stream / 1e6:.2f} M vectors/s)")
    print(f"  every vector once: {n == n_local}; sum of all vectors equals the local reading's: "
          f"{bool(np.allclose(got, want, rtol=1e-9))} (max relative difference {np.max(np.abs(got - want) / np.abs(want)):.1e})")
    print(f"  local disk use, {len(samples)} samples: max {max(samples) / MiB:.0f} MiB (budget {budget / MiB:.0f} MiB)")
    print(f"  reader RSS: first quarter median {np.median(rss_samples[:quarter]) / MiB:.0f} MiB, last quarter "
          f"median {np.median(rss_samples[-quarter:]) / MiB:.0f} MiB, max {max(rss_samples) / MiB:.0f} MiB")


SECTIONS = ("requests", "amplification", "mixing", "pieces", "node", "storm", "memory", "link")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections (repeatable)")
    ap.add_argument("--soak", type=float, default=None, metavar="TOKENS", help="run the soak with this many tokens")
    ap.add_argument("--rate", type=float, default=64 * MiB, help="link throttle in bytes/s (default 64 MiB/s)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmprobe-remote-"))
    import socket

    with socket.socket() as sock:  # the server's port, known before huggingface_hub reads its settings
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"HF_HOME": str(tmp / "hf-home"), "LMPROBE_CACHE": str(tmp / "lmprobe-cache"),
                       "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_DISABLE_XET": "1",
                       "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"})
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(var, None)
    from support.hub_server import HubServer

    server = HubServer(tmp / "hub", port=port).start()
    print(f"load average at start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)", flush=True)
    try:
        if args.soak:
            bench_soak(server, tmp, int(args.soak))
            return
        for name in args.only or SECTIONS:
            if name == "memory":
                bench_memory()
            elif name == "link":
                bench_link(server, tmp, args.quick, args.rate)
            else:
                globals()[f"bench_{name}"](server, tmp, args.quick)
            sys.stdout.flush()
            for d in tmp.iterdir():  # the datasets of a section go before the next one writes its own
                if d.name not in ("hub", "hf-home", "lmprobe-cache"):
                    shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink()
    finally:
        server.stop()
        print(f"load average at end: {os.getloadavg()[0]:.1f}")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
