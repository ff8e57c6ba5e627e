"""Many ranks, one source: what one rank's share costs to read, and what planning a budget over ranks costs.

    python benchmarks/bench_ranks.py             # 100,000 records, 8 ranks; a 20,000-document corpus, 4 ranks
    python benchmarks/bench_ranks.py --quick     # 20,000 records; 4,000 documents

1. Reading: a .jsonl, .parquet (row groups of 5,000), .csv and .txt file of the same records. For
   each, the time one rank of W takes to read its share (``records(rank=0, world=W)``), against
   reading the whole file in the same run. A rank parses only its own records, so the ratio
   should sit near 1/W plus what finding every record costs (line boundaries, CSV parsing).
2. Planning ``--max-tokens`` over ranks: the windows of a corpus (the packaged tiny tokenizer,
   windows of 128, a budget of 80% of the corpus) streamed by one process, against W ranks
   simulated by threads in this process that plan while extracting (one exchange a round) or
   count first (``plan_budget``, then ``end=``). Threads share two cores and the GIL, so the
   ratio is the protocol's whole cost (exchanges, the planner thread, a second tokenization for
   the counting pass) against one process doing all the work, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ("the cat sat on a mat and looked at the bird while researchers study activations of language models "
         "numbers like 12 345 and 6789 appear in text as well").split()


def make_records(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(40 + i % 60)) for i in range(n)]


def write_files(folder: Path, texts: list[str]) -> dict[str, Path]:
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {"jsonl": folder / "c.jsonl", "parquet": folder / "c.parquet", "csv": folder / "c.csv",
             "txt": folder / "c.txt"}
    files["jsonl"].write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), files["parquet"], row_group_size=5000)
    pd.DataFrame({"text": texts, "id": range(len(texts))}).to_csv(files["csv"], index=False)
    files["txt"].write_text("".join(t + "\n" for t in texts))
    return files


def best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_reading(n: int, world: int) -> None:
    from lmprobe.extraction.sources import open_source

    print(f"1. reading one rank's share of {n:,} records, {world} ranks (best of 3)")
    print(f"   {'file':8} {'whole':>8} {'share':>8} {'share/whole':>12} {'ideal':>6}")
    with tempfile.TemporaryDirectory() as d:
        for kind, path in write_files(Path(d), make_records(n)).items():
            src = open_source(path)
            whole = best(lambda src=src: sum(1 for _ in src.records()))
            share = best(lambda src=src: sum(1 for _ in src.records(rank=0, world=world)))
            print(f"   {kind:8} {whole:7.3f}s {share:7.3f}s {share / whole:12.2f} {1 / world:6.2f}")


class ThreadRanks:
    def __init__(self, world: int):
        self.world, self.barrier, self.slots = world, threading.Barrier(world), [None] * world

    def gather(self, rank: int):
        def all_gather(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            got = list(self.slots)
            self.barrier.wait()
            return got

        return all_gather

    def run(self, fn) -> list:
        out: list = [None] * self.world
        threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(r, self.gather(r))))
                   for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


def bench_planning(n: int, world: int) -> None:
    from transformers import AutoTokenizer

    from lmprobe.extraction.corpus import CorpusPlan, plan_budget, stream_windows
    from lmprobe.extraction.sources import open_source
    from lmprobe.extraction.windows import affixes_of

    tok = AutoTokenizer.from_pretrained(ROOT / "lmprobe" / "models" / "tiny")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_records(n)))
        affixes = affixes_of(tok, special_tokens=True)
        full = CorpusPlan(open_source(path), affixes, 128, None, None)
        total = sum(len(w.input_ids) for w in stream_windows(full, tok, "text", resume=None))
        plan = CorpusPlan(open_source(path), affixes, 128, int(total * 0.8), None)
        print(f"\n2. planning --max-tokens {plan.max_tokens:,} over {n:,} documents ({total:,} tokens), windows of 128")

        def single():
            return sum(len(w.input_ids) for w in stream_windows(plan, tok, "text", resume=None))

        def ranks(mode):
            def one(rank, gather):
                end = plan_budget(plan, tok, "text", rank=rank, world=world, all_gather=gather) if mode else None
                return sum(len(w.input_ids) for w in stream_windows(
                    plan, tok, "text", resume=None, rank=rank, world=world, all_gather=gather, end=end))
            return sum(ThreadRanks(world).run(one))

        t_single = best(single, 2)
        assert single() == plan.max_tokens
        print(f"   one process                     {t_single:7.3f}s  1.00")
        for name, mode in ((f"{world} ranks, planning ahead", False), (f"{world} ranks, counting first", True)):
            assert ranks(mode) == plan.max_tokens
            t = best(lambda mode=mode: ranks(mode), 2)
            print(f"   {name:31} {t:7.3f}s  {t / t_single:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    bench_reading(20_000 if args.quick else 100_000, 8)
    bench_planning(4_000 if args.quick else 20_000, 4)


if __name__ == "__main__":
    main()
