"""W1 shaped down: many ranks, thousands of small shards, straight to a Hub that enforces its commit rate.

    python benchmarks/bench_scale.py                    # 16 ranks (4 nodes x 4), ~3,000 shards, a 60 s "hour"
    python benchmarks/bench_scale.py --nodes 2 --per-node 2 --tokens 40000   # a smaller run (2 cores: ~2 min)
    # the plan's three predictions, each in the setting where it is the one that holds:
    python benchmarks/bench_scale.py --nodes 4 --per-node 4 --tokens 60000 --shard-size 16KB --uplink 1e6
    python benchmarks/bench_scale.py --nodes 2 --per-node 2 --tokens 30000 --hour 3600 --commit-delay 15

Simulated nodes (torchrun, c10d rendezvous on 127.0.0.1, each node its own working, temporary and cache folders:
tests/support/nodes.py) run ``lmprobe extract`` over one corpus (a random llama of hidden size 64, 2 layers, layer 1, full
sequences, windows of 64 tokens, --max-tokens exact, tiny shards so that the job makes thousands of files) to
``hf://`` on the local Hub test server (tests/support/hub_server.py). The server enforces the Hub's commit rate on a
scaled clock (``--rate`` commits in any ``--hour`` seconds, 429 + Retry-After past it) and takes ``--commit-delay``
seconds per commit; the ranks run with LMPROBE_HUB_HOUR_SECONDS=--hour, so their commit window follows the same
clock.

Measured:
- tail: from the last shard content the server received (the last shard written, plus its upload) to the last
  commit of the job (the merge's, with the index): the time the job's GPUs would sit idle;
- commits: all the job's commits, those refused with 429 (0 expected: the job keeps to its window);
- staging peak: the most bytes under one node's cache while the job ran (shards, index parts, checkpoint copies,
  state and ledger: everything the plan's staging_bytes_per_node sizes);
- merge memory: rank 0's peak RSS (VmHWM) over the run, and its RSS growth during the tail (the merge).

The plan's prediction for the same command (``lmprobe extract ... --dry-run json``: commits, tail_commits,
tail_seconds and its parts, staging_bytes_per_node) is printed beside each number. Each compares in its own
setting:
- the staging is the peak when the ranks' uploads fall behind their model (``--uplink`` below the job's output
  rate): with a faster uplink a node stages less;
- the tail's seconds compare at the Hub's own pace (``--hour 3600 --commit-delay 15``, the plan's
  COMMIT_SECONDS): on a scaled clock every local second (2 cores for all the processes) counts 60 times. The
  plan's ``merge`` part (1 s to open a part on the Hub) has no counterpart on the local server, where a part
  opens in milliseconds;
- commits compare in every setting, but a scaled hour makes the committer's timed commits (a file uploaded 300 s
  of the hour ago) fire in a run that lasts more than an "hour", which W1 (23,000 files in 0.7 h) never does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MiB = 2**20


def corpus(path: Path, n_docs: int) -> Path:
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)] + ["the", "cat", "sat", "on", "a", "mat"]
    with open(path, "w") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(40, 400)))}) + "\n")
    return path


def planned(argv: list[str], env: dict) -> dict | None:
    """The plan's JSON for the same command (``--dry-run json``), or None where this tree has no plan yet."""
    r = subprocess.run([sys.executable, "-m", "lmprobe", *argv, "--dry-run", "json"], capture_output=True, text=True,
                       env=env, timeout=300)
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


class Rank0Memory:
    """Rank 0's RSS, polled from /proc every 50 ms (the process whose environment has RANK=0 under ``root``)."""

    def __init__(self, root: Path):
        self.root, self.pid, self.hwm, self.samples = str(root), None, 0, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)

    def _find(self) -> int | None:
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                env = (p / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"RANK=0" in env and any(e.startswith(b"LMPROBE_CACHE=" + self.root.encode()) for e in env):
                return int(p.name)
        return None

    def _poll(self):
        while not self._stop.is_set():
            if self.pid is None:
                self.pid = self._find()
            if self.pid is not None:
                try:
                    status = Path(f"/proc/{self.pid}/status").read_text()
                except OSError:
                    self.pid = None
                    continue
                fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
                rss = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
                self.hwm = max(self.hwm, int(fields.get("VmHWM", "0 kB").split()[0]) * 1024)
                self.samples.append((time.monotonic(), rss))
            self._stop.wait(0.05)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def growth_after(self, t: float) -> int:
        before = [r for s, r in self.samples if s <= t]
        after = [r for s, r in self.samples if s > t]
        return (max(after) - before[-1]) if before and after else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=200_000, help="--max-tokens")
    ap.add_argument("--shard-size", default="8KB")
    ap.add_argument("--hour", type=float, default=60.0, help="seconds of the scaled Hub hour")
    ap.add_argument("--rate", type=float, default=128, help="commits the server allows in any scaled hour")
    ap.add_argument("--commit-delay", type=float, default=0.2, help="seconds each commit takes on the server")
    ap.add_argument("--uplink", type=float, default=None,
                    help="bytes a second the server receives uploads at, all nodes together (default: unthrottled); "
                         "below the job's output rate the ranks' uploads fall behind, the case the plan's staging "
                         "sizes")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmprobe-scale-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"HF_HOME": str(tmp / "hf-home"), "HF_ENDPOINT": f"http://127.0.0.1:{port}",
                       "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                       "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "LMPROBE_HUB_HOUR_SECONDS": str(args.hour),
                       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        os.environ.pop(var, None)
    from support.hub_server import HubServer
    from support.nodes import Peak, disk_use, launch, wait
    from support.tiny_models import build_llama

    class Staged(Peak):
        """Everything under each node's cache, not only its shards: what the plan's staging covers."""

        def _poll(self):
            while not self._stop.is_set():
                for i, f in enumerate(self.folders):
                    self.peaks[i] = max(self.peaks[i], disk_use(f))
                self._stop.wait(self.every)

    import lmprobe

    server = HubServer(tmp / "hub", port=port).start()
    server.delay_commits(args.commit_delay)
    server.limit_commits(args.rate, hour=args.hour)
    server.throttle_uploads(args.uplink)
    ranks = args.nodes * args.per_node
    try:
        model = build_llama(tmp / "llama", hidden=64, layers=2)
        src = corpus(tmp / "corpus.jsonl", n_docs=args.tokens // 150)
        name = f"bench/scale-{uuid.uuid4().hex[:8]}"
        argv = ["extract", "--model", str(model), "--prompts", str(src), "--out", f"hf://datasets/{name}",
                "--layers", "1", "--storage", "full_sequence", "--context-len", "64", "--max-tokens",
                str(args.tokens), "--shard-size", args.shard_size, "--batch-size", "8", "--quiet"]
        plan = planned([*argv, "--world-size", str(ranks), "--gpus-per-node", str(args.per_node)], dict(os.environ))
        print(f"{args.nodes} nodes x {args.per_node} ranks, llama hidden 64, layer 1, {args.tokens:,} tokens in windows "
              f"of 64, shards of {args.shard_size}; the server allows {args.rate:g} commits per {args.hour:g} s "
              f"'hour' and takes {args.commit_delay:g} s a commit")
        root = tmp / "run"
        root.mkdir()
        caches = [root / f"node{n}" / "cache" for n in range(args.nodes)]
        t0 = time.monotonic()
        with Staged(caches, every=0.05) as peak, Rank0Memory(root) as mem:
            wait(launch(root, argv, nodes=args.nodes, per_node=args.per_node, env={"OMP_NUM_THREADS": "1"}),
                 timeout=3600)
        wall = time.monotonic() - t0
        ds = lmprobe.load(f"hf://datasets/{name}")
        assert int(ds.column("num_tokens").sum()) == args.tokens
        files = len([p for p in server.files(name) if p.endswith(".safetensors")])
        dataset_files = len([p for p in server.files(name) if not p.split("/")[-1].startswith(".")])
        commits = [(t, s) for r, t, s in server.state.commit_log if r == name]
        shas = {e.sha256 for p, e in server.files(name).items() if p.startswith("tensors/hidden") and e.sha256}
        last_upload = max(t for sha, t in server.state.uploaded if sha in shas)  # the last shard's content
        tail = commits[-1][0] - last_upload
        from lmprobe.extraction.plan import COMMIT_SECONDS

        real_pace = args.hour == 3600 and args.commit_delay == COMMIT_SECONDS  # the Hub's clock: the tails compare
        print(f"  wall {wall:.0f} s; {files:,} shard files; dataset complete")
        rows = [
            ("tail (last shard uploaded -> dataset complete)",
             f"{tail:.1f} s" + (f" = {tail / args.hour:.2f} scaled hours" if args.hour != 3600 else ""),
             plan and (f"{plan['tail_seconds']:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in
                                                             plan.get("tail_parts", {}).items()) + ")"
                       + (f": measured / plan {tail / plan['tail_seconds']:.2f}" if real_pace else
                          " at the Hub's pace, not this scaled clock's"))),
            ("files (shards, statistics, index, card)", f"{dataset_files:,}", plan and f"{plan.get('files'):,}"),
            ("commits", f"{len(commits)} ({server.state.refused_commits} refused with 429)",
             plan and str(plan.get("commits"))),
            ("commits after the last shard reached the Hub", str(sum(1 for t, _ in commits if t > last_upload)),
             plan and str(plan.get("tail_commits"))),
            ("staging peak (everything staged, one node)", f"{peak.peak / MiB:.2f} MiB",
             plan and f"{plan.get('staging_bytes_per_node', float('nan')) / MiB:.2f} MiB"),
            ("rank 0 peak RSS / growth during the tail", f"{mem.hwm / MiB:.0f} MiB / "
             f"{mem.growth_after(last_upload) / MiB:.0f} MiB", "growth bounded, whatever the tokens (<= 1 GiB)"),
        ]
        for what, measured, predicted in rows:
            print(f"  {what:48s} measured {measured:36s} plan {predicted or '(no --dry-run json on this tree)'}")
        print("  the commits after the last shard reached the Hub (seconds after it: summary):")
        for t, summary in commits:
            if t > last_upload:
                print(f"    +{t - last_upload:6.1f} s  {summary[:110]}")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
