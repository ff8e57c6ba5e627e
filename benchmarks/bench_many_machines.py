"""Two ranks extracting a corpus straight to the Hub against the same two ranks writing to a local folder.

    python benchmarks/bench_many_machines.py            # 300k tokens, float32 then bfloat16 (~4 min)
    python benchmarks/bench_many_machines.py --quick    # 100k tokens, float32 only

Two simulated nodes of one rank each (torchrun, c10d rendezvous on 127.0.0.1, each node with its own working,
temporary and cache folders: tests/support/nodes.py) run ``lmprobe extract`` over the same corpus (a random llama of
hidden size 256, 4 layers, layers 1 and 3, full sequences, windows of 128 tokens, --max-tokens exact):

- baseline: ``--out DIR``, a local folder both nodes see (the shared-filesystem case): each rank writes its part
  there, rank 0 renames the parts into one dataset. No byte leaves the machine.
- lmprobe to the Hub: ``--out hf://datasets/bench/NAME`` on the local Hub test server (tests/support/hub_server.py,
  0.5 s per commit like the Hub's, LMPROBE_HUB_HOUR_SECONDS=100: 100 commits in any 100 s for the job): shards upload
  while the model computes, each rank's parts are merged by server-side copies, the index goes last.

Printed: wall time of each (until every rank has exited, the dataset complete), the ratio baseline / Hub
(target >= 0.9), and each rank's peak local shard data (``*.safetensors*`` under its staging, polled every 20 ms)
against the shard size and against the whole dataset, with the bound the code keeps: the shards the writer is
filling, up to 2 closed ones waiting for the checkpoint that hands them over, plus at most 8 uploading
(docs/publishing.md).
The pair runs twice, alternating; the faster of each is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
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
    words = [f"w{i}" for i in range(400)] + ["the", "cat", "sat", "on", "a", "mat", "and", "dog"]
    with open(path, "w") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(50, 600)))}) + "\n")
    return path


def one_run(root: Path, argv: list[str]) -> tuple[float, list[int]]:
    from support.nodes import Peak, launch, wait

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    caches = [root / f"node{n}" / "cache" for n in (0, 1)]
    t0 = time.perf_counter()
    with Peak(caches) as peak:
        wait(launch(root, argv, env={"OMP_NUM_THREADS": "1"}), timeout=1800)
    return time.perf_counter() - t0, peak.peaks


def _own_cpu() -> float:
    """CPU seconds this process (the Hub test server's threads included) has used."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="100k tokens, float32 only")
    ap.add_argument("--tokens", type=int, default=None, help="--max-tokens (default 300k, 100k with --quick)")
    ap.add_argument("--shard-size", default="4MB")
    args = ap.parse_args()
    tokens = args.tokens or (100_000 if args.quick else 300_000)
    tmp = Path(tempfile.mkdtemp(prefix="lmprobe-nodes-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"HF_HOME": str(tmp / "hf-home"), "HF_ENDPOINT": f"http://127.0.0.1:{port}",
                       "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                       "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "LMPROBE_HUB_HOUR_SECONDS": "100",
                       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        os.environ.pop(var, None)
    from support.hub_server import HubServer
    from support.tiny_models import build_llama

    import lmprobe
    from lmprobe.base.units import parse_size

    server = HubServer(tmp / "hub", port=port).start()
    server.delay_commits(0.5)
    try:
        model = build_llama(tmp / "llama", hidden=256, layers=4)
        src = corpus(tmp / "corpus.jsonl", n_docs=tokens // 100)
        shard = parse_size(args.shard_size)
        print(f"2 nodes x 1 rank, a llama of hidden size 256 (4 layers), layers 1 and 3, {tokens:,} tokens in windows "
              f"of 128, shards of {args.shard_size}; the Hub test server takes 0.5 s per commit")
        for dtype in ("float32",) if args.quick else ("float32", "bfloat16"):
            common = ["extract", "--model", str(model), "--prompts", str(src), "--layers", "1,3", "--storage",
                      "full_sequence", "--context-len", "128", "--max-tokens", str(tokens), "--dtype", dtype,
                      "--shard-size", args.shard_size, "--batch-size", "16", "--quiet"]
            base_runs, hub_runs, peaks, base_cpu, hub_cpu = [], [], [], [], []
            size = 0
            for i in range(2):
                out = tmp / f"shared-{dtype}-{i}"
                cpu0 = _own_cpu()
                t, _ = one_run(tmp / "run", [*common, "--out", str(out)])
                base_cpu.append(_own_cpu() - cpu0)
                base_runs.append(t)
                size = sum(p.stat().st_size for p in (out / "tensors").rglob("*.safetensors"))
                shutil.rmtree(out)
                name = f"bench/nodes-{uuid.uuid4().hex[:8]}"
                cpu0 = _own_cpu()
                t, peak = one_run(tmp / "run", [*common, "--out", f"hf://datasets/{name}"])
                hub_cpu.append(_own_cpu() - cpu0)
                hub_runs.append(t)
                peaks.append(peak)
                assert lmprobe.load(f"hf://datasets/{name}").column("num_tokens").sum() == tokens
            base, hub = min(base_runs), min(hub_runs)
            worst = max(max(p) for p in peaks)
            print(f"{dtype}: dataset {size / MiB:.0f} MiB")
            print(f"  baseline, 2 ranks to a shared local folder:  {base:6.1f} s   runs "
                  f"{', '.join(f'{t:.1f}' for t in base_runs)}")
            print(f"  lmprobe, 2 ranks straight to the Hub:        {hub:6.1f} s   runs "
                  f"{', '.join(f'{t:.1f}' for t in hub_runs)}")
            print(f"  ratio baseline / Hub: {base / hub:.2f} (target >= 0.9)")
            print(f"  CPU of this process (the Hub test server receiving every byte, and the disk poller): "
                  f"{max(hub_cpu):.1f} s in a Hub run, {max(base_cpu):.1f} s in a baseline run, on the cores the "
                  f"ranks use ({os.cpu_count()} here)")
            print(f"  peak local shard data of a rank: {worst / MiB:.1f} MiB = {worst / shard:.1f} shards "
                  f"({worst / shard / 2:.1f} per stored layer), {worst / size:.1%} of the dataset "
                  f"(a local folder holds all of it)")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
