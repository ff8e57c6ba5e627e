"""A corpus of many files dealt to ranks by piece: each rank opens and reads only its own files
(or parquet row groups), and the ranks' windows together are one process's, with --max-tokens exact.

Ranks are simulated with threads (tests/extraction/test_ranks.py's ``Ranks``), each with a source object of its own
whose file reads are counted.
"""

from __future__ import annotations

import io
import json
import random
import tempfile
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from support.ranks import Ranks, WordTokenizer, key

from lmprobe.errors import ExtractionError, PromptError
from lmprobe.extraction.corpus import CorpusPlan, progress_after, stream_windows
from lmprobe.extraction.pieces import FOOTER_GUESS
from lmprobe.extraction.sources import FilesSource, open_source
from lmprobe.extraction.windows import Affixes


class CountedRaw(io.RawIOBase):
    """A file whose reads are counted in ``tally[name]``."""

    def __init__(self, path: Path, tally: dict[str, int]):
        self._f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed with this object
        self._name, self._tally = path.name, tally

    def readable(self):
        return True

    def seekable(self):
        return True

    def readinto(self, b):
        n = self._f.readinto(b)
        self._tally[self._name] = self._tally.get(self._name, 0) + (n or 0)
        return n

    def seek(self, offset, whence=0):
        return self._f.seek(offset, whence)

    def tell(self):
        return self._f.tell()

    def close(self):
        self._f.close()
        super().close()


class CountingSource(FilesSource):
    """A folder source whose every byte read is counted, by file."""

    def __init__(self, path: Path, **kw):
        super().__init__(path, **kw)
        self.tally: dict[str, int] = {}

    def open(self, f):
        return io.BufferedReader(CountedRaw(f, self.tally), buffer_size=8192)


def doc_text(i: int, n: int) -> str:
    return " ".join(f"w{(7 * i + 3 * j) % 50 + 10}" for j in range(n))


def noisy_text(rng: random.Random, n: int) -> str:
    """Words that compress as real text does (a parquet file of them is as large as its text)."""
    return " ".join(f"w{rng.randrange(10, 100_000)}" for _ in range(n))


def write_parquet_folder(root: Path, n_files: int = 8, docs: int = 40, row_group: int | None = None,
                         words: int = 40) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    i = 0
    for f in range(n_files):
        texts = []
        for _ in range(docs):
            texts.append(noisy_text(rng, 1 + (i * 13) % words))
            i += 1
        pq.write_table(pa.table({"text": texts, "n": list(range(i - docs, i))}), root / f"part-{f:03d}.parquet",
                       row_group_size=row_group or docs)
    return root


def corpus(source, limit, *, context_len=8):
    return CorpusPlan(source, Affixes((1,)), context_len, limit, None)


def rank_run(make_source, world, limit, *, resume=None, stop_after=None, context_len=8):
    """Every rank's stored windows, its progress after them, and its source (with its tally of bytes read)."""
    made = [make_source() for _ in range(world)]

    def one(rank, gather):
        plan = corpus(made[rank], limit, context_len=context_len)
        progress = resume[rank] if resume else None
        stream = stream_windows(plan, WordTokenizer(), "text", resume=progress, rank=rank, world=world,
                                all_gather=gather)
        stored = []
        cap = None if stop_after is None else stop_after[rank]
        try:
            for w in stream:
                if cap is not None and len(stored) == cap:
                    break
                stored.append(w)
        except ExtractionError as exc:
            if stop_after is None:
                raise
            assert "stopped before the extraction ended" in str(exc)
        finally:
            stream.close()
        return stored, (progress_after(stored) if stored else progress)

    results, errors = Ranks(world).run(one)
    return results, errors, made


def single(source, limit, *, context_len=8):
    return [key(w) for w in stream_windows(corpus(source, limit, context_len=context_len), WordTokenizer(), "text",
                                           resume=None)]


@pytest.mark.parametrize("limit", [None, 700_000])
def test_eight_parquet_files_over_four_ranks_each_rank_reads_its_own_files(tmp_path, limit):
    """Past the footers, a rank opens and reads its own files only: once without a budget; under one (here
    ending in the sixth file) at most twice (the planner counts a piece, then the extraction reads it). Dealt
    by record, every rank reads every file."""
    folder = write_parquet_folder(tmp_path / "corpus", docs=1000, words=200)
    files = sorted(p.name for p in folder.iterdir())
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    want = single(open_source(folder), limit)
    if limit is not None:
        assert sum(len(k[3]) for k in want) == limit
    results, errors, sources = rank_run(lambda: CountingSource(folder, text_column="text"), 4, limit)
    assert errors == [None] * 4
    got = [key(w) for stored, _ in results for w in stored]
    assert sorted(got) == sorted(want) and len(got) == len(want)  # the same windows, none twice
    if limit is not None:
        assert sum(len(k[3]) for k in got) == limit  # --max-tokens exact
    total = sum(sizes.values())
    last_file = max(k[0] for k in want) // 1000
    assert last_file == (len(files) - 1 if limit is None else 6)
    for rank, src in enumerate(sources):
        # its files up to the round of the file where the budget ends (the ranks count a round of files at once)
        mine = {files[f] for f in range(rank, len(files), 4) if f // 4 <= last_file // 4}
        assert {files[w.document // 1000] for w in results[rank][0]} <= mine  # its windows come from its files
        dealt = {files[f] for f in range(rank, len(files), 4)}  # its files: it reads their footers
        assert set(src.tally) == dealt  # it opened no other file
        own = sum(sizes[n] for n in mine)
        read = sum(src.tally.values())
        assert own * 0.9 <= read <= own + len(dealt) * FOOTER_GUESS, (rank, src.tally, own)  # once
    # dealt by record, every rank reads every file
    whole = CountingSource(folder, text_column="text")
    list(whole.records(rank=1, world=4))
    assert set(whole.tally) == set(files) and sum(whole.tally.values()) >= 0.9 * total


def test_row_groups_are_dealt_and_a_rank_reads_only_its_row_groups(tmp_path):
    folder = write_parquet_folder(tmp_path / "corpus", n_files=2, docs=48, row_group=8)  # 12 pieces
    src = open_source(folder)
    pieces = src.pieces()
    assert [(p.file, p.row_group, p.first_row, p.rows) for p in pieces[:7]] == [
        (0, g, 8 * g, 8) for g in range(6)] + [(1, 0, 0, 8)]
    want = single(src, 700)
    results, errors, _ = rank_run(lambda: open_source(folder), 5, 700)
    assert errors == [None] * 5
    assert sorted(key(w) for stored, _ in results for w in stored) == sorted(want)
    for rank, (stored, _) in enumerate(results):
        assert {(w.document // 8) % 5 for w in stored} <= {rank}  # document d lies in piece d // 8


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    folder = write_parquet_folder(tmp_path / "corpus", n_files=2)
    (folder / "part-001.parquet").write_bytes(b"PAR1 not really" + b"\0" * 40)
    with pytest.raises(PromptError, match=r"part-001.parquet: not a parquet file"):
        open_source(folder).pieces()
    (folder / "part-001.parquet").write_bytes(b"x" * 30 + (10**6).to_bytes(4, "little") + b"PAR1")
    with pytest.raises(PromptError, match=r"part-001.parquet: not a parquet file"):
        open_source(folder).pieces()
    # read by rank 1 only (file k's footer is rank k % world's): every rank stops with its message
    _, errors, _ = rank_run(lambda: open_source(folder), 2, None)
    assert all(isinstance(e, PromptError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1 and "part-001.parquet: not a parquet file" in str(errors[0])


def test_one_file_and_memory_keep_record_dealing(tmp_path):
    folder = write_parquet_folder(tmp_path / "corpus", n_files=1)
    assert open_source(folder).pieces() is None
    assert open_source(folder / "part-000.parquet").pieces() is None
    assert open_source([{"text": "w1"}] * 3).pieces() is None


def write_mixed(root: Path, spec: list[tuple[str, list[int]]]) -> Path:
    """Files of every kind that a folder may hold; each file's documents of the given lengths."""
    root.mkdir(parents=True, exist_ok=True)
    i = 0
    for f, (kind, lengths) in enumerate(spec):
        texts = []
        for n in lengths:
            texts.append(doc_text(i, n))
            i += 1
        name = root / f"f{f:02d}.{kind}"
        if kind == "parquet":
            pq.write_table(pa.table({"text": texts}), name, row_group_size=3)
        elif kind == "jsonl":
            name.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        elif kind == "csv":
            pd.DataFrame({"text": texts}).to_csv(name, index=False)
        else:
            name.write_text("".join(f"{t}\n" for t in texts))
    return root


file_spec = st.lists(st.tuples(st.sampled_from(["parquet", "jsonl", "csv", "txt"]),
                               st.lists(st.integers(1, 25), min_size=1, max_size=9)), min_size=2, max_size=7)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=file_spec, world=st.integers(2, 6), limit=st.one_of(st.none(), st.integers(1, 400)),
       context_len=st.integers(2, 9))
@example(spec=[("jsonl", [3, 4]), ("parquet", [30, 2, 2, 2]), ("txt", [5])], world=3, limit=37, context_len=4)
def test_the_ranks_of_a_dealt_folder_store_one_process_windows(spec, world, limit, context_len):
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_mixed(Path(tmp) / "c", spec)
        want = single(open_source(folder), limit, context_len=context_len)
        results, errors, _ = rank_run(lambda: open_source(folder), world, limit, context_len=context_len)
        assert errors == [None] * world
        got = [key(w) for stored, _ in results for w in stored]
        assert sorted(got) == sorted(want) and len(got) == len(want)
        pieces = open_source(folder).pieces()
        for rank, (stored, _) in enumerate(results):
            assert [(w.document, w.index) for w in stored] == sorted((w.document, w.index) for w in stored)
            assert all(_piece_of(pieces, folder, w.document) % world == rank for w in stored)


def _piece_of(pieces, folder, document):
    src = open_source(folder)
    first = 0
    for p in pieces:
        n = p.rows if p.rows is not None else sum(1 for _ in src.piece_records(p, 0))
        if document < first + n:
            return p.number
        first += n
    raise AssertionError(document)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=file_spec, world=st.integers(2, 4), limits=st.tuples(st.one_of(st.none(), st.integers(1, 300)),
                                                                  st.integers(1, 300)),
       change=st.booleans(), stops=st.lists(st.integers(0, 10), min_size=4, max_size=4))
@example(spec=[("parquet", [20, 20]), ("jsonl", [9, 9])], world=2, limits=(40, 40), change=False, stops=[1, 2, 0, 0])
def test_dealt_ranks_killed_anywhere_resume_to_one_process_windows(spec, world, limits, change, stops):
    """Every rank stops at a random window, then every rank resumes from its progress, with the same budget or
    another: the single process's windows of the second budget, or one error on every rank when a part holds
    what that budget does not."""
    first, second = limits[0], limits[1] if change else limits[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_mixed(Path(tmp) / "c", spec)
        results, errors, _ = rank_run(lambda: open_source(folder), world, first, stop_after=stops[:world],
                                      context_len=5)
        assert errors == [None] * world
        stored = [key(w) for part, _ in results for w in part]
        want = sorted(single(open_source(folder), second, context_len=5))
        again, errors, _ = rank_run(lambda: open_source(folder), world, second,
                                    resume=[p for _, p in results], context_len=5)
        if not set(stored) <= set(want):
            event("refused")
            assert all(isinstance(e, ExtractionError) for e in errors), errors
            assert len({str(e) for e in errors}) == 1
            assert "--max-tokens" in str(errors[0]) and "--overwrite" in str(errors[0])
            return
        assert errors == [None] * world
        assert sorted(stored + [key(w) for part, _ in again for w in part]) == want


def test_a_part_made_with_records_dealt_one_by_one_is_refused_on_every_rank(tmp_path):
    folder = write_parquet_folder(tmp_path / "corpus", n_files=3, docs=10)
    old = {"document": 4, "window": 1, "tokens_before": 30, "last_tokens": 8}  # an earlier lmprobe's progress
    _, errors, _ = rank_run(lambda: open_source(folder), 2, 200, resume=[None, old])
    assert all(isinstance(e, ExtractionError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1
    assert "dealt one by one" in str(errors[0]) and "--overwrite" in str(errors[0])
    # a dealt part's progress says so
    results, errors, _ = rank_run(lambda: open_source(folder), 2, None)
    assert errors == [None, None] and all(p["pieces"] == 1 for _, p in results)


def test_a_bad_record_of_a_dealt_folder_stops_every_rank_with_its_message(tmp_path):
    folder = tmp_path / "c"
    write_mixed(folder, [("jsonl", [3] * 5), ("jsonl", [3] * 5), ("jsonl", [3] * 5)])
    lines = (folder / "f01.jsonl").read_text().splitlines()
    lines[2] = '{"text": "w1'
    (folder / "f01.jsonl").write_text("\n".join(lines) + "\n")
    _, errors, _ = rank_run(lambda: open_source(folder), 3, 1000)
    assert all(isinstance(e, Exception) for e in errors), errors
    assert len({str(e) for e in errors}) == 1 and "f01.jsonl, line 3 is not valid JSON" in str(errors[0])


def test_a_replayed_file_reads_what_was_kept_and_the_file_for_the_rest(tmp_path):
    from lmprobe.base.replay import Recorder

    f = tmp_path / "x.bin"
    f.write_bytes(bytes(range(256)) * 64)
    opened = []

    def opener(p):
        opened.append(p)
        return open(p, "rb")  # noqa: SIM115 - closed by the reader

    rec = Recorder(opener, limit=1 << 20)
    with rec.open(f) as fh:
        fh.seek(-100, 2)
        tail = fh.read()
        fh.seek(1000)
        mid = fh.read(50)
    assert len(opened) == 1 and rec.size > 0 and not rec.overflow
    replayed = rec.replay(opener)
    with replayed.open(f) as fh:
        fh.seek(-100, 2)
        assert fh.read() == tail and len(opened) == 1  # served from memory, size included
        fh.seek(1000)
        assert fh.read(50) == mid
    data = f.read_bytes()
    with replayed.open(f) as fh:
        assert fh.read() == data  # what was not kept comes from the file
    small = Recorder(opener, limit=10)
    with small.open(f) as fh:
        fh.read()
    assert small.overflow and small.kept == {}


class CountedHubFile:
    """A file of HfFileSystem whose reads are counted in ``tally[name]`` (what pyarrow asks of it)."""

    def __init__(self, f, name, tally):
        self._f, self._name, self._tally = f, name, tally

    def read(self, n=-1):
        out = self._f.read(n)
        self._tally[self._name] = self._tally.get(self._name, 0) + len(out)
        return out

    def __getattr__(self, attr):
        return getattr(self._f, attr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_a_hub_dataset_of_many_parquet_files_is_dealt_by_row_group(hub, tmp_path):
    """The same dealing for a Hub dataset of many parquet files (read with pyarrow through HfFileSystem): each
    rank reads its own row groups past the footers, and the ranks store what one process streaming the dataset
    with `datasets` stores."""
    from huggingface_hub import HfApi

    from lmprobe.extraction.sources import HubDatasetSource

    repo = f"tester/dealt-{uuid.uuid4().hex[:8]}"
    api = HfApi()
    api.create_repo(repo, repo_type="dataset")
    folder = write_parquet_folder(tmp_path / "up", n_files=4, docs=60, words=30)
    for k, f in enumerate(sorted(folder.iterdir())):
        api.upload_file(path_or_fileobj=str(f), path_in_repo=f"data/train-{k:05d}-of-00004.parquet", repo_id=repo,
                        repo_type="dataset")

    class CountingHub(HubDatasetSource):
        def __init__(self):
            super().__init__(repo, config=None, split="train")
            self.tally = {}

        def open(self, f):
            return CountedHubFile(super().open(f), f.rsplit("/", 1)[-1], self.tally)

    def counted():
        src = CountingHub()
        assert len(src.pieces()) == 4
        src.tally.clear()
        return src

    streamed = open_source(f"hf://datasets/{repo}")
    want = single(streamed, 2000)
    assert want == single(open_source(folder), 2000)  # `datasets` streams the files in the same order
    results, errors, _ = rank_run(counted, 3, 2000)
    assert errors == [None] * 3
    assert sorted(key(w) for stored, _ in results for w in stored) == sorted(want)
    results, errors, sources = rank_run(counted, 2, None)
    assert errors == [None, None]
    assert sorted(key(w) for stored, _ in results for w in stored) == sorted(single(streamed, None))
    for rank, src in enumerate(sources):
        assert set(src.tally) == {f"train-{k:05d}-of-00004.parquet" for k in (rank, rank + 2)}, src.tally


def test_a_hub_dataset_of_many_jsonl_files_is_dealt_by_file(hub, tmp_path):
    """A Hub dataset of .jsonl files: dealt by file, the jsonl files counted by their ranks and the counts
    exchanged; the ranks store what one process streaming it with `datasets` stores."""
    from huggingface_hub import HfApi

    from lmprobe.extraction.sources import HubDatasetSource

    repo = f"tester/dealt-json-{uuid.uuid4().hex[:8]}"
    api = HfApi()
    api.create_repo(repo, repo_type="dataset")
    rng = random.Random(1)
    for k in range(5):
        lines = "".join(json.dumps({"text": noisy_text(rng, rng.randrange(1, 60)), "k": k}) + "\n"
                        for _ in range(rng.randrange(3, 30)))
        api.upload_file(path_or_fileobj=lines.encode(), path_in_repo=f"data/train-{k:05d}.jsonl", repo_id=repo,
                        repo_type="dataset")
    src = open_source(f"hf://datasets/{repo}")
    assert [p.rows for p in src.pieces()] == [None] * 5
    for limit in (None, 900):
        want = single(src, limit)

        class CountingHub(HubDatasetSource):
            def __init__(self):
                super().__init__(repo, config=None, split="train")
                self.tally = {}

            def open(self, f):
                return CountedHubFile(super().open(f), f.rsplit("/", 1)[-1], self.tally)

        results, errors, sources = rank_run(CountingHub, 3, limit)
        assert errors == [None] * 3
        assert sorted(key(w) for stored, _ in results for w in stored) == sorted(want)
        for rank, s in enumerate(sources):
            assert set(s.tally) <= {f"train-{k:05d}.jsonl" for k in range(rank, 5, 3)}, s.tally
