"""Many ranks, one source (issue 34): each rank reads only its own records, and a token budget stays exact.

Ranks are simulated with threads: ``all_gather`` is a barrier over a shared list, as
``torch.distributed.all_gather_object`` is over a process group.
"""

from __future__ import annotations

import doctest
import json
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmprobe.errors import PromptError
from lmprobe.extraction import sources
from lmprobe.extraction.sources import open_source


def write_folder(root: Path) -> Path:
    """A folder of every kind of file: 58 records, blank lines and parquet row groups of 4 included."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.jsonl").write_text("".join(json.dumps({"text": f"j{i}", "n": i}) + "\n" + ("\n" if i % 3 == 0 else "")
                                          for i in range(13)))
    pq.write_table(pa.table({"text": [f"p{i}" for i in range(29)], "n": list(range(29))}), root / "b.parquet",
                   row_group_size=4)
    pd.DataFrame({"text": [f"c{i}" for i in range(9)], "n": range(9)}).to_csv(root / "c.csv", index=False)
    (root / "d.txt").write_text("".join(f"t{i}\n" for i in range(7)))
    return root


# ---------------------------------------------------------------- dealing records


def test_the_dealing_arithmetic():
    assert [sources.owner(i, 3) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    for world in range(1, 9):
        for start in range(20):
            for rank in range(world):
                f = sources.first_owned(start, rank, world)
                assert f >= start and f % world == rank and f - start < world
    for bad in [(0, 0), (2, 2), (-1, 3), (True, 2), (0, 1.0)]:
        with pytest.raises(ValueError):
            sources.check_share(*bad)


@pytest.mark.parametrize("kind", ["folder", "jsonl", "parquet", "csv", "txt", "memory"])
def test_every_rank_reads_its_own_records_with_their_index_in_the_whole_source(tmp_path, kind):
    folder = write_folder(tmp_path / "src")
    spec = {"folder": folder, "jsonl": folder / "a.jsonl", "parquet": folder / "b.parquet",
            "csv": folder / "c.csv", "txt": folder / "d.txt",
            "memory": [{"text": f"m{i}"} for i in range(11)]}[kind]
    src = open_source(spec)
    whole = [(r.index, r.file, r.at, r.values) for r in src.records()]
    assert [i for i, *_ in whole] == list(range(len(whole)))
    for world in (1, 2, 3, 5, 8):
        for start in sorted({0, 1, 5, 12, 13, 14, 41, 42, len(whole) - 1, len(whole), len(whole) + 3}):
            shares = [[(r.index, r.file, r.at, r.values) for r in src.records(start, rank=rank, world=world)]
                      for rank in range(world)]
            for rank, share in enumerate(shares):
                assert all(i % world == rank for i, *_ in share)
                assert [i for i, *_ in share] == sorted(i for i, *_ in share)
            assert sorted(x for share in shares for x in share) == whole[start:], (world, start)


def test_a_rank_parses_only_its_own_json_lines_and_decodes_only_its_own_text_lines(tmp_path, monkeypatch):
    parsed = []
    real = sources.loads
    monkeypatch.setattr(sources, "loads", lambda raw, **kw: parsed.append(raw) or real(raw, **kw))
    folder = write_folder(tmp_path / "src")
    list(open_source(folder / "a.jsonl").records(rank=1, world=3))
    assert [json.loads(x)["n"] for x in parsed] == [1, 4, 7, 10]
    # a line no one parses cannot fail: the broken line is rank 1's, and only rank 1 says so
    f = tmp_path / "broken.jsonl"
    f.write_text('{"text": "a"}\n{"text": "b"\n{"text": "c"}\n{"text": "d"}\n')
    src = open_source(f)
    assert [r.values["text"] for r in src.records(rank=0, world=2)] == ["a", "c"]
    with pytest.raises(PromptError, match=r"broken.jsonl, line 2 is not valid JSON"):
        list(src.records(rank=1, world=2))
    t = tmp_path / "latin1.txt"
    t.write_bytes(b"one\ncaf\xe9\nthree\nfour\n")
    assert [r.values["text"] for r in open_source(t).records(rank=0, world=2)] == ["one", "three"]
    with pytest.raises(PromptError, match=r"latin1.txt, line 2: not valid UTF-8"):
        list(open_source(t).records(rank=1, world=2))


def test_a_rank_materialises_only_its_own_parquet_and_csv_rows(tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "src")
    seen: list[int] = []
    real = sources._materialise

    def materialise(batch, first, step):
        rows = real(batch, first, step)
        seen.extend(r["n"] for r in rows)
        return rows

    monkeypatch.setattr(sources, "_materialise", materialise)
    groups: list[int] = []
    real_batches = pq.ParquetFile.iter_batches

    def iter_batches(self, *a, row_groups=None, **kw):
        groups.extend(row_groups)
        return real_batches(self, *a, row_groups=row_groups, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
    src = open_source(folder / "b.parquet")
    assert [r.index for r in src.records(10, rank=2, world=3)] == [11, 14, 17, 20, 23, 26]
    assert seen == [11, 14, 17, 20, 23, 26]
    assert groups == [2, 3, 4, 5, 6]  # rows 0-7 (groups 0 and 1) lie before the start: never read
    # with more ranks than a row group's rows, groups that hold none of a rank's rows are not read either
    seen.clear(), groups.clear()
    assert [r.index for r in src.records(0, rank=5, world=8)] == [5, 13, 21]
    assert groups == [1, 3, 5] and seen == [5, 13, 21]
    # a folder resumed past a parquet file does not read its row groups: the footer counts them
    groups.clear()
    assert [r.index for r in open_source(folder).records(45, rank=1, world=2)] == [45, 47, 49, 51, 53, 55, 57]
    assert groups == []

    rows: list[int] = []
    real_rows = sources._csv_rows
    monkeypatch.setattr(sources, "_csv_rows", lambda df, ks: rows.extend(ks) or real_rows(df, ks))
    got = [(r.index, r.at, r.values) for r in open_source(folder / "c.csv").records(1, rank=0, world=4)]
    assert got == [(4, "line 6", {"text": "c4", "n": 4}), (8, "line 10", {"text": "c8", "n": 8})]
    assert rows == [4, 8]


def test_hub_dataset_ranks_skip_the_others_examples_in_the_stream(hub, tmp_path):
    from huggingface_hub import HfApi

    repo = f"tester/ranks-{uuid.uuid4().hex[:8]}"
    api = HfApi()
    api.create_repo(repo, repo_type="dataset")
    for k, (lo, hi) in enumerate([(0, 23), (23, 40)]):
        local = tmp_path / f"part{k}.parquet"
        pq.write_table(pa.table({"text": [f"h{i}" for i in range(lo, hi)]}), local, row_group_size=5)
        api.upload_file(path_or_fileobj=str(local), path_in_repo=f"data/train-0000{k}-of-00002.parquet",
                        repo_id=repo, repo_type="dataset")
    src = open_source(f"hf://datasets/{repo}")
    for world, start in [(1, 0), (2, 0), (3, 7), (4, 22), (8, 39)]:
        for rank in range(world):
            got = [(r.index, r.at, r.values["text"]) for r in src.records(start, rank=rank, world=world)]
            want = [(i, f"record {i}", f"h{i}") for i in range(start, 40) if i % world == rank]
            assert got == want, (world, start, rank)


def test_the_modules_examples_run():
    from lmprobe.extraction import windows

    for module in (sources, windows):
        assert doctest.testmod(module).failed == 0

