"""The upload side of a push against a plain parallel upload of the same bytes, on a throttled link.

    python benchmarks/bench_push.py                   # 640 MiB in 160 shards, 32 MiB/s uplink, 0.5 s commits (~2.5 min)
    python benchmarks/bench_push.py --quick           # 64 MiB
    python benchmarks/bench_push.py --xet             # and, for information, the same push through Xet (unthrottled)

Everything runs against the local Hub test server (tests/support/hub_server.py) on 127.0.0.1, started here,
with HF_HOME in a temporary folder. The server receives LFS uploads through one shared uplink of
RATE bytes/s (``throttle_uploads``; the loopback is faster than any real uplink) and takes
COMMIT_LATENCY seconds per commit (``delay_commits``; the Hub's commits take about a second).

- baseline: the shard files uploaded with WORKERS threads, each file one LFS batch request, one
  PUT of its bytes and one verify: no preupload, no commit, the sha256s known (what the writer
  recorded). The least any client can do to move these bytes over this link.
- lmprobe: ``lmprobe.push_to_hub`` of the dataset (WORKERS upload workers, commits of 50 files
  and the index and card in a last commit, all landed).

The server's object store is emptied before each run, so each run sends every byte. Each is run
twice, alternating, and the faster of each pair is kept. Two ratios are printed, baseline / lmprobe
(1.0: the push costs nothing beyond moving the bytes; the target is >= 0.9):
- the upload side: until the server has the last byte of the last shard (the server's own clock);
- the whole push: until the index and card are committed. After the last byte, a push still makes
  two commits (the last shards, then the index and card alone, so that no index ever names a
  missing shard): a fixed cost of about two commit latencies, whatever the size of the push.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MiB = 2**20


def write(path: Path, total: int, shard: int) -> None:
    from lmprobe.format.writer import DatasetWriter

    dim = 1024  # float32 rows of 4 KiB
    rows = total // (4 * dim)
    rng = np.random.default_rng(0)
    with DatasetWriter(path, layers=[0], dim=dim, model_name="bench", shard_size=shard, statistics=False) as w:
        for a in range(0, rows, 4096):
            b = min(4096, rows - a)
            w.add_batch(texts=["x"] * b, num_tokens=[1] * b, hidden={0: rng.normal(size=(b, dim)).astype(np.float32)})


def empty_store(server) -> None:
    for p in (server.state.root / "lfs").iterdir():
        p.unlink()


def baseline(server, files, workers: int) -> float:
    """Each shard: LFS batch, PUT, verify; WORKERS at a time."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import get_session

    repo = f"bench/plain-{uuid.uuid4().hex[:8]}"
    HfApi().create_repo(repo, repo_type="dataset")
    session = get_session()

    def upload(f) -> None:
        body = {"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256",
                "objects": [{"oid": f.sha256, "size": f.size}]}
        r = session.post(f"{server.url}/datasets/{repo}.git/info/lfs/objects/batch", json=body,
                         headers={"Accept": "application/vnd.git-lfs+json"})
        r.raise_for_status()
        actions = r.json()["objects"][0].get("actions")
        if actions:
            with open(f.local, "rb") as fh:
                session.put(actions["upload"]["href"], content=fh.read()).raise_for_status()
            session.post(actions["verify"]["href"], json={"oid": f.sha256, "size": f.size}).raise_for_status()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(upload, files))
    return time.perf_counter() - t0


def lmprobe_push(server, path: Path, workers: int) -> tuple[float, float]:
    """(seconds until the last shard byte was in, seconds until the push returned)."""
    import lmprobe

    start = len(server.state.spans)
    t0 = time.monotonic()
    lmprobe.push_to_hub(path, f"bench/push-{uuid.uuid4().hex[:8]}", workers=workers, quiet=True)
    done = time.monotonic() - t0
    uploads = [end for kind, _, end in server.state.spans[start:] if kind == "upload"]
    return (max(uploads) - t0 if uploads else done), done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="64 MiB instead of 320 MiB")
    ap.add_argument("--rate", type=float, default=32 * MiB, help="uplink throttle in bytes/s (default 32 MiB/s)")
    ap.add_argument("--commit-latency", type=float, default=0.5, help="seconds per commit (default 0.5)")
    ap.add_argument("--workers", type=int, default=8, help="parallel uploads, both sides (default 8)")
    ap.add_argument("--xet", action="store_true", help="also time the same push through Xet (not throttled)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmprobe-push-"))
    import socket

    with socket.socket() as sock:  # the server's port, known before huggingface_hub reads its settings
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"HF_HOME": str(tmp / "hf-home"), "HF_ENDPOINT": f"http://127.0.0.1:{port}",
                       "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                       "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"})
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        os.environ.pop(var, None)
    from support.hub_server import HubServer

    from lmprobe.format.reader import open_local
    from lmprobe.publish.push import dataset_files

    server = HubServer(tmp / "hub", port=port).start()
    try:
        total = (64 if args.quick else 640) * MiB
        path = tmp / "ds"
        write(path, total, 4 * MiB)
        files = dataset_files(open_local(path))
        for f in files:
            f.size = f.local.stat().st_size
        n_bytes = sum(f.size for f in files)
        print(f"{len(files)} shards, {n_bytes / MiB:.0f} MiB; uplink {args.rate / MiB:.0f} MiB/s, "
              f"{args.commit_latency:g} s per commit, {args.workers} parallel uploads; "
              f"the link alone: {n_bytes / args.rate:.1f} s")
        server.throttle_uploads(args.rate)
        server.delay_commits(args.commit_latency)
        base_runs: list[float] = []
        push_runs: list[tuple[float, float]] = []
        for _ in range(2):
            empty_store(server)
            base_runs.append(baseline(server, files, args.workers))
            empty_store(server)
            push_runs.append(lmprobe_push(server, path, args.workers))
        base = min(base_runs)
        uploaded, ours = min(push_runs, key=lambda r: r[1])
        print(f"baseline (plain parallel upload, no commit):  {base:6.2f} s  {n_bytes / MiB / base:6.1f} MiB/s  "
              f"runs {', '.join(f'{t:.2f}' for t in base_runs)}")
        print(f"lmprobe push, last shard byte in:             {uploaded:6.2f} s  {n_bytes / MiB / uploaded:6.1f} MiB/s")
        print(f"lmprobe push, landed (index and card last):   {ours:6.2f} s  {n_bytes / MiB / ours:6.1f} MiB/s  "
              f"runs {', '.join(f'{t:.2f}' for _, t in push_runs)}")
        print(f"ratio baseline / lmprobe, the upload side: {base / uploaded:.2f}; the whole push: {base / ours:.2f}  "
              f"(target >= 0.9); after the last byte: {ours - uploaded:.2f} s "
              f"({args.commit_latency:g} s per commit)")
        if args.xet:
            import huggingface_hub.constants as c

            server.throttle_uploads(None)
            c.HF_HUB_DISABLE_XET = False
            _, t = lmprobe_push(server, path, args.workers)
            print(f"for information, the same push through Xet to the local CAS (not throttled): {t:.2f} s "
                  f"({n_bytes / MiB / t:.0f} MiB/s)")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
