"""The merge's index (lmprobe/format/merge.py): the same rows as a merge that holds every part's index in memory,
written a bounded table at a time, in memory that does not grow with the parts' tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.datasets import write_dataset
from support.paths import ROOT

import lmprobe
from lmprobe.format import index, merge
from lmprobe.format.merge import merge_datasets, plan_merge
from lmprobe.format.reader import open_local
from lmprobe.format.spec import INDEX_PATH
from lmprobe.format.validate import validate


def held_merge(parts: list[Path], order: str) -> pa.Table:
    """The obviously-correct merge: every part's whole index read at once, addresses shifted, rows sorted."""
    dss = [open_local(p) for p in parts]
    n = len(dss)
    n_last = [d.meta.hidden.last_token_shards for d in dss]
    n_seq = [len(d.meta.hidden.shards) - d.meta.hidden.last_token_shards for d in dss]
    n_logits = [len(d.meta.logits.shards) if d.meta.logits else 0 for d in dss]
    tables, keys = [], []
    for k, p in enumerate(parts):
        t = pq.read_table(p / INDEX_PATH).replace_schema_metadata(None)
        cols = {name: t.column(name).to_pylist() for name in t.column_names}
        cols["shard_index"] = [s + sum(n_last[:k]) for s in cols["shard_index"]]
        if "token_shard_ids" in cols:
            seq0 = sum(n_last) + sum(n_seq[:k])
            cols["token_shard_ids"] = [[s + sum(n_last[:k]) if s < n_last[k] else s - n_last[k] + seq0 for s in row]
                                       for row in cols["token_shard_ids"]]
        if "shard_index_logits" in cols:
            cols["shard_index_logits"] = [s + sum(n_logits[:k]) for s in cols["shard_index_logits"]]
        tables.append(pa.table(cols, schema=t.schema))
        if order == "documents":
            keys += list(zip(cols["document"], cols["window_start"], strict=True))
        else:
            keys += [(i * n + k) if order == "positions" else (k, i) for i in range(t.num_rows)]
    whole = pa.concat_tables(tables)
    return whole.take(pa.array(sorted(range(len(keys)), key=keys.__getitem__)))


def small_budgets(monkeypatch) -> None:
    """Row groups and read-ahead a few rows long, so that a test's small parts cross every boundary."""
    monkeypatch.setattr(index, "ROW_GROUP_TOKENS", 9)
    monkeypatch.setattr(index, "ROW_GROUP_ROWS", 4)
    monkeypatch.setattr(merge, "_READ_AHEAD_BYTES", 3000)
    monkeypatch.setattr(merge, "_READ_BYTES", 500)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("storage", ["pooled", "full_sequence"])
@pytest.mark.parametrize("order", ["concat", "positions"])
def test_merged_index_and_shards_equal_a_merge_that_holds_the_whole_index(tmp_path, rng, monkeypatch, storage,
                                                                           dtype, order):
    small_budgets(monkeypatch)
    sizes = [9, 8, 8]  # prompts dealt round-robin to 3 parts: part k holds prompts k, k + 3, ...
    srcs = [write_dataset(tmp_path / f"p{k}", rng, n=m, layers=(0, 2), dim=4, storage=storage, dtype=dtype,
                          shard_size="64B", logits_topk=2, token_ids=storage == "full_sequence", statistics=True)
            for k, m in enumerate(sizes)]
    parts = [tmp_path / f"p{k}" for k in range(3)]
    want = held_merge(parts, order)
    out = tmp_path / "m"
    out.mkdir()
    dss = [open_local(p) for p in parts]
    plan = plan_merge(dss, order=order)
    for k, src, dst in plan.moves:
        (out / dst).parent.mkdir(parents=True, exist_ok=True)
        os.link(parts[k] / src, out / dst)
    plan.finish(dss, out)

    got = pq.read_table(out / INDEX_PATH)
    assert got.replace_schema_metadata(None).equals(want)
    assert pq.ParquetFile(out / INDEX_PATH).metadata.num_row_groups > 3  # written a bounded group at a time
    assert validate(out).ok, str(validate(out))
    ds = lmprobe.load(out)
    # every prompt's vectors are the ones its part stored
    merged_rows = [(k, i) for i in range(max(sizes)) for k in range(3) if i < sizes[k]] if order == "positions" \
        else [(k, i) for k in range(3) for i in range(sizes[k])]
    for row, (k, i) in enumerate(merged_rows):
        src = srcs[k]
        if storage == "full_sequence":
            a, b = src["tok_start"][i], src["tok_start"][i + 1]
            np.testing.assert_array_equal(ds.token_hidden(row, 2), dss[k].token_hidden(i, 2))
            np.testing.assert_array_equal(dss[k].token_hidden(i, 2).astype(np.float32),
                                          lmprobe.load(parts[k]).token_hidden(i, 2).astype(np.float32))
            assert b - a == len(ds.token_hidden(row, 2))
        np.testing.assert_array_equal(ds.hidden(0, [row]), dss[k].hidden(0, [i]))
    assert ds.statistics(0)["count"] == sum(open_local(p).statistics(0)["count"] for p in parts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_corpus_parts_merge_back_in_document_order_as_a_held_merge_would(tmp_path, rng, monkeypatch, dtype):
    """A multi-process corpus extraction deals documents round-robin; its parts merge back by (document,
    window_start), read a few rows at a time."""
    from lmprobe.format.writer import DatasetWriter

    small_budgets(monkeypatch)
    n_parts, windows = 3, {}
    for k in range(n_parts):
        with DatasetWriter(tmp_path / f"p{k}", layers=[0], dim=4, model_name="m", storage="full_sequence",
                           corpus=True, dtype=dtype, shard_size="64B", token_ids=True) as w:
            for doc in range(k, 20, n_parts):  # documents k, k + 3, ... with 1 to 3 windows each
                n_win = 1 + doc % 3
                counts = rng.integers(2, 6, size=n_win)
                h = rng.normal(size=(int(counts.sum()), 4)).astype(np.float32)
                windows.update({(doc, 8 * j): h[counts[:j].sum():counts[: j + 1].sum()] for j in range(n_win)})
                w.add_batch(texts=[f"doc {doc} window {j}" for j in range(n_win)], num_tokens=counts,
                            hidden={0: h}, document=[doc] * n_win, window_start=[8 * j for j in range(n_win)],
                            token_ids=[list(range(c)) for c in counts])
    parts = [tmp_path / f"p{k}" for k in range(n_parts)]
    dss = [open_local(p) for p in parts]
    plan = plan_merge(dss, order="documents")
    out = tmp_path / "m"
    for k, src, dst in plan.moves:
        (out / dst).parent.mkdir(parents=True, exist_ok=True)
        os.link(parts[k] / src, out / dst)
    plan.finish(dss, out)
    assert pq.read_table(out / INDEX_PATH).replace_schema_metadata(None).equals(held_merge(parts, "documents"))
    ds = lmprobe.load(out)
    assert list(zip(ds.column("document"), ds.column("window_start"), strict=True)) == sorted(windows)
    where = {(int(d), int(w)): (k, i) for k, part in enumerate(dss)
             for i, (d, w) in enumerate(zip(part.column("document"), part.column("window_start"), strict=True))}
    for row, key in enumerate(sorted(windows)):
        got = ds.token_hidden(row, 0)
        k, i = where[key]
        np.testing.assert_array_equal(got, dss[k].token_hidden(i, 0))  # the part's stored vectors, bit for bit
        if dtype == "float32":
            np.testing.assert_array_equal(got, windows[key])
        assert len(got) == len(windows[key])


def test_merge_datasets_writes_the_index_with_delta_and_zstd(tmp_path, rng):
    for k in range(2):
        write_dataset(tmp_path / f"p{k}", rng, n=6, layers=(0,), dim=4, storage="full_sequence", token_ids=True)
    out = merge_datasets([tmp_path / "p0", tmp_path / "p1"], tmp_path / "m")
    md = pq.ParquetFile(out / INDEX_PATH).metadata
    by_path = {md.row_group(0).column(i).path_in_schema: md.row_group(0).column(i) for i in range(md.num_columns)}
    for name in ("shard_index", "row_offset", "token_offset", "token_shard_ids.list.element",
                 "token_shard_offsets.list.element", "token_ids.list.element"):
        assert "DELTA_BINARY_PACKED" in by_path[name].encodings, name
    assert {c.compression for c in by_path.values()} == {"ZSTD"}
    assert not by_path["text"].is_stats_set  # a corpus's window text stays out of the footer


#: tokens in the parts of the memory test: both sizes past the merge's read-ahead, one 8 times the other
SMALL, BIG = 6e5, 4.8e6

WRITE = r"""
import sys
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[1])
from lmprobe.format.writer import DatasetWriter
work, n_tokens = Path(sys.argv[2]), int(float(sys.argv[3]))
per, n_parts = 256, 4
for k in range(n_parts):  # full_sequence, one layer of width 1: cheap shards, a full-size index
    with DatasetWriter(work / f"p{k}", layers=[0], dim=1, model_name="m", storage="full_sequence",
                       shard_size="64MB", checksums=False, token_ids=True) as w:
        h = np.zeros((per * 64, 1), np.float32)
        for s in range(0, n_tokens // n_parts // per, 64):
            w.add_batch(texts=[f"window {k} {s + i} " * 40 for i in range(64)], num_tokens=[per] * 64,
                        hidden={0: h}, token_ids=[np.arange(per) for _ in range(64)])
"""

MERGE = r"""
import json, resource, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from lmprobe.format.merge import plan_merge
from lmprobe.format.reader import open_local
work, order = Path(sys.argv[2]), sys.argv[3]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
dss = [open_local(work / f"p{k}") for k in range(4)]
(work / order).mkdir()
plan_merge(dss, order=order).finish(dss, work / order)
print(json.dumps({"growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}))
"""


@pytest.fixture(scope="module")
def sized_parts(tmp_path_factory):
    """4 parts holding SMALL tokens in all, and 4 holding BIG (with token ids and 600 bytes of text a row)."""
    made = {}
    for n_tokens in (SMALL, BIG):
        work = tmp_path_factory.mktemp(f"parts-{n_tokens:g}")
        r = subprocess.run([sys.executable, "-c", WRITE, str(ROOT), str(work), str(n_tokens)], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        made[n_tokens] = work
    return made


def merge_peak(work: Path, order: str) -> float:
    """The merge's peak RSS above its process's baseline (imports done), in a fresh process, in MiB."""
    r = subprocess.run([sys.executable, "-c", MERGE, str(ROOT), str(work), order], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["growth_mib"]


@pytest.mark.slow  # subprocesses writing and merging 5.4 M tokens of index
@pytest.mark.parametrize("order", ["concat", "positions"])
def test_merge_memory_does_not_grow_with_the_tokens(sized_parts, order):
    """Holding the bigger index would take 24 bytes a token for its three lists and ~2.3 for its text (~120 MiB),
    the smaller ~15 MiB. The merge's peak is the same for both, up to the allocator's noise (arrow's mimalloc
    keeps freed pages a while: 0-25 MiB from run to run); the merge that held the index grew ~350 MiB."""
    small = merge_peak(sized_parts[SMALL], order)
    big = merge_peak(sized_parts[BIG], order)

    assert big - small < 40, (small, big)


def test_bounded_tables_come_from_any_row_groups(tmp_path, rng):
    """A part written by anyone (here: one row group of every row) is still read a bounded table at a time."""
    write_dataset(tmp_path / "p", rng, n=40, layers=(0,), dim=4, storage="full_sequence", token_ids=True)
    path = tmp_path / "p" / INDEX_PATH
    t = pq.read_table(path)
    pq.write_table(t, path, row_group_size=len(t))
    ds = open_local(tmp_path / "p")
    tables = list(ds.iter_index(max_bytes=2000))
    assert len(tables) > 5
    assert all(x.nbytes <= 2000 + 500 for x in tables)
    assert pa.concat_tables(tables).equals(t)


def test_row_groups_are_bounded_by_rows_and_entries_and_keep_every_row(monkeypatch):
    monkeypatch.setattr(index, "ROW_GROUP_TOKENS", 10)
    monkeypatch.setattr(index, "ROW_GROUP_ROWS", 4)
    lengths = [0, 3, 12, 1, 1, 1, 1, 1, 5, 5, 0, 0, 0, 0, 0, 2]  # 12: one row over the bound, alone in its group
    tables = [pa.table({"l": pa.array([[7] * n for n in lengths[i : i + 3]], pa.list_(pa.int64()))})
              for i in range(0, len(lengths), 3)]
    groups = list(index.row_groups(iter(tables), index.list_entries))
    assert pa.concat_tables(groups).equals(pa.concat_tables(tables))
    assert [g.num_rows for g in groups] == [2, 1, 4, 2, 4, 3]
    assert all(g.num_rows == 1 or index.list_entries(g).sum() <= 10 for g in groups)


@pytest.mark.parametrize("storage", ["pooled", "full_sequence"])
def test_an_index_past_max_row_groups_gets_larger_groups_not_more(tmp_path, rng, monkeypatch, storage):
    """A parquet writer holds every row group's metadata until it closes (~8 KB each): at the default group size
    a 10^10-token index would be 150,000 groups, 1.2 GB in the process that writes it. Both the writer's index
    and the merge's keep to about MAX_ROW_GROUPS (twice at worst: a group closes early when the next row does
    not fit), with every row; at the test's default bounds they would have 12 or more."""
    small_budgets(monkeypatch)
    monkeypatch.setattr(index, "MAX_ROW_GROUPS", 3, raising=False)
    for k in range(2):
        write_dataset(tmp_path / f"p{k}", rng, n=20, layers=(0,), dim=4, storage=storage, token_ids=True)
        assert pq.ParquetFile(tmp_path / f"p{k}" / INDEX_PATH).metadata.num_row_groups <= 2 * 3
    out = merge_datasets([tmp_path / "p0", tmp_path / "p1"], tmp_path / "m")
    assert pq.ParquetFile(out / INDEX_PATH).metadata.num_row_groups <= 2 * 3
    want = pa.concat_tables([pq.read_table(tmp_path / f"p{k}" / INDEX_PATH, columns=["text", "num_tokens"])
                             .replace_schema_metadata(None) for k in range(2)])
    assert pq.read_table(out / INDEX_PATH, columns=["text", "num_tokens"]).replace_schema_metadata(None).equals(want)
