"""Many ranks, one source: what one rank's share costs to read, and what planning a budget over ranks costs.

    python benchmarks/bench_ranks.py             # 100,000 records, 8 ranks; a 20,000-document corpus, 4 ranks
    python benchmarks/bench_ranks.py --quick     # 20,000 records; 4,000 documents
    python benchmarks/bench_ranks.py --bytes     # part 3 only: bytes read per rank of 16 files, 4 and 8 ranks

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
3. Bytes read per rank of a corpus of many files (16 parquet files, then 16 jsonl files): every
   byte read through the source's ``open`` counted, for W = 4 and 8 ranks (threads), without a
   budget and with ``--max-tokens`` at 80% of the corpus. Dealt by piece (a row group or a file:
   what a folder or a Hub dataset of many files gets), the largest rank's bytes / the corpus's
   bytes should sit near 1/W (a rank reads the footers of 1/W of the parquet files, then its own
   pieces); dealt by record (a single file, or lmprobe before dealing by piece), every rank reads every
   byte: 1.00 (parquet: more, as pyarrow reads the last 64 KiB of every small file first).
   The windows stored by the ranks are checked against one process's, their tokens against the
   budget.
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


def counting_source(folder: Path):
    """A folder source whose every byte read is counted (``src.tally``)."""
    import io

    from lmprobe.extraction.sources import FilesSource

    class Counted(io.RawIOBase):
        def __init__(self, path, tally):
            self._f, self._tally = open(path, "rb", buffering=0), tally  # noqa: SIM115 - closed with this object

        def readable(self):
            return True

        def seekable(self):
            return True

        def readinto(self, b):
            n = self._f.readinto(b) or 0
            self._tally[0] += n
            return n

        def seek(self, offset, whence=0):
            return self._f.seek(offset, whence)

        def tell(self):
            return self._f.tell()

        def close(self):
            self._f.close()
            super().close()

    class CountingSource(FilesSource):
        def __init__(self, path):
            super().__init__(path, text_column="text")
            self.tally = [0]

        def open(self, f):
            return io.BufferedReader(Counted(f, self.tally), buffer_size=1 << 16)

    return CountingSource(folder)


def bench_bytes(docs_per_file: int, worlds: tuple[int, ...]) -> None:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from lmprobe.extraction.corpus import CorpusPlan, stream_windows
    from lmprobe.extraction.windows import affixes_of

    tok = AutoTokenizer.from_pretrained(ROOT / "lmprobe" / "models" / "tiny")
    affixes = affixes_of(tok, special_tokens=True)
    rng = random.Random(0)  # words drawn at random: the files compress as text does, not as a repeated pattern
    texts = [" ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(40 + i % 60))
             for i in range(16 * docs_per_file)]
    print(f"\n3. bytes read per rank of a corpus of 16 files ({len(texts):,} documents), windows of 128, over the")
    print("   corpus's bytes (footers included)")
    print(f"   {'files':8} {'ranks':>5} {'budget':>6} {'corpus':>8} {'by piece: max':>15} {'mean':>6} "
          f"{'by record':>10} {'ideal':>6}")
    with tempfile.TemporaryDirectory() as d:
        for kind in ("parquet", "jsonl"):
            folder = Path(d) / kind
            folder.mkdir()
            for k in range(16):
                part = texts[k * docs_per_file : (k + 1) * docs_per_file]
                if kind == "parquet":
                    pq.write_table(pa.table({"text": part, "id": list(range(len(part)))}),
                                   folder / f"part-{k:03d}.parquet", row_group_size=docs_per_file)
                else:
                    (folder / f"part-{k:03d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                                        for t in part))
            corpus = sum(p.stat().st_size for p in folder.iterdir())
            whole = CorpusPlan(counting_source(folder), affixes, 128, None, None)
            total = sum(len(w.input_ids) for w in stream_windows(whole, tok, "text", resume=None))
            for world in worlds:
                for limit in (None, int(total * 0.8)):
                    one = CorpusPlan(counting_source(folder), affixes, 128, limit, None)
                    want = sorted((w.document, w.index, tuple(w.input_ids))
                                  for w in stream_windows(one, tok, "text", resume=None))
                    sources = [counting_source(folder) for _ in range(world)]

                    def rank(r, gather, sources=sources, limit=limit, world=world):
                        plan = CorpusPlan(sources[r], affixes, 128, limit, None)
                        return [(w.document, w.index, tuple(w.input_ids)) for w in stream_windows(
                            plan, tok, "text", resume=None, rank=r, world=world, all_gather=gather)]

                    got = sorted(w for part in ThreadRanks(world).run(rank) for w in part)
                    assert got == want, "the ranks' windows differ from one process's"
                    if limit is not None:
                        assert sum(len(w[2]) for w in got) == limit
                    per_rank = [src.tally[0] / corpus for src in sources]
                    by_record = counting_source(folder)
                    for _ in by_record.records(rank=0, world=world):
                        pass
                    budget = "none" if limit is None else "80%"
                    print(f"   {kind:8} {world:5} {budget:>6} {corpus / 1e6:6.2f}MB {max(per_rank):15.3f} "
                          f"{sum(per_rank) / world:6.3f} {by_record.tally[0] / corpus:10.2f} {1 / world:6.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bytes", action="store_true", help="only part 3, the bytes read per rank")
    args = ap.parse_args()
    if not args.bytes:
        bench_reading(20_000 if args.quick else 100_000, 8)
        bench_planning(4_000 if args.quick else 20_000, 4)
    bench_bytes(100 if args.quick else 300, (4, 8))


if __name__ == "__main__":
    main()
