"""Many ranks, one source: each rank reads only its own records, and a token budget stays exact.

Ranks are simulated with threads: ``all_gather`` is a barrier over a shared list, as
``torch.distributed.all_gather_object`` is over a process group.
"""

from __future__ import annotations

import json
import threading
import traceback
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from support.ranks import Ranks, WordTokenizer, key

from lmprobe.errors import ExtractionError, PromptError
from lmprobe.extraction import sources
from lmprobe.extraction.corpus import CorpusPlan, plan_budget, progress_after, stream_windows
from lmprobe.extraction.prompts import read_prompts
from lmprobe.extraction.ranks import Position, ahead, merge_counts, progress_record, start_plan
from lmprobe.extraction.sources import MemorySource, open_source
from lmprobe.extraction.windows import (
    Affixes,
    Budget,
    Cutoff,
    affixes_of,
    find_cutoff,
    stored_tokens,
    windows,
)


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


def test_a_rank_of_a_folder_turns_only_its_own_records_into_values(tmp_path, monkeypatch):
    """Every kind of file in one folder: the records a rank turns into Python values are its own, one each."""
    folder = write_folder(tmp_path / "src")
    made: list[str] = []
    for name in ("_line_values", "_materialise", "_csv_rows"):
        real = getattr(sources, name)

        def counted(*a, _real=real, **kw):
            out = _real(*a, **kw)
            made.extend(str(r["text"]) for r in (out if isinstance(out, list) else [out]))
            return out

        monkeypatch.setattr(sources, name, counted)
    got = [r.values["text"] for r in open_source(folder).records(rank=1, world=3)]
    assert len(got) == 19 and sorted(made) == sorted(got)


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


# ---------------------------------------------------------------- the budget over many ranks


def make_plan(docs, prefix, suffix, per_window, limit):
    return CorpusPlan(MemorySource(docs, text_column="text"), Affixes(tuple(prefix), tuple(suffix)),
                      per_window + len(prefix) + len(suffix), limit, None)


def rank_windows(plan, tok, world, *, mode="ahead", round_size=None, resume=None, stop_after=None):
    """Every rank's windows (stored ones only, with ``stop_after[rank]``), and its progress after them."""
    ranks = Ranks(world)

    def one(rank, gather):
        progress = resume[rank] if resume else None
        end = None
        if mode == "two-pass" and plan.max_tokens is not None:
            end = plan_budget(plan, tok, "text", rank=rank, world=world, all_gather=gather, resume=progress,
                              round_size=round_size)
        stream = stream_windows(plan, tok, "text", resume=progress, rank=rank, world=world,
                                all_gather=gather if mode == "ahead" else None, end=end, round_size=round_size)
        stored = []
        limit = None if stop_after is None else stop_after[rank]
        try:
            for w in stream:
                if limit is not None and len(stored) == limit:
                    break  # pulled, never stored: the rank dies before its next checkpoint
                stored.append(w)
        except ExtractionError as exc:  # another rank stopped
            if stop_after is None:
                raise
            assert "stopped before the extraction ended" in str(exc)
        finally:
            stream.close()
        return stored, (progress_after(stored) if stored else progress)

    return ranks.run(one)


docs_strategy = st.lists(st.tuples(st.integers(0, 30), st.booleans()), max_size=25)


def build_docs(spec, seed=0):
    """Documents of the given lengths: text ("w5 w9 ...", possibly empty) or pretokenized ids."""
    docs = []
    for i, (n, pretokenized) in enumerate(spec):
        ids = [(seed + 7 * i + 3 * j) % 50 + 10 for j in range(n)]
        docs.append({"input_ids": ids} if pretokenized and n else {"text": " ".join(f"w{t}" for t in ids)})
    return docs


@settings(max_examples=60)
@given(spec=docs_strategy, prefix=st.lists(st.integers(1, 3), max_size=2), suffix=st.lists(st.integers(1, 3), max_size=1),
       per_window=st.integers(1, 8), limit=st.one_of(st.none(), st.integers(1, 400)), world=st.integers(1, 8),
       round_factor=st.integers(0, 3), mode=st.sampled_from(["ahead", "two-pass"]), fast=st.booleans())
@example(spec=[(5, False), (0, False), (7, True)], prefix=[1], suffix=[], per_window=2, limit=9, world=3,
         round_factor=1, mode="ahead", fast=True)
def test_the_ranks_windows_are_the_single_process_windows(spec, prefix, suffix, per_window, limit, world, round_factor,
                                                           mode, fast):
    docs = build_docs(spec)
    plan = make_plan(docs, prefix, suffix, per_window, limit)
    tok = WordTokenizer(fast)
    single = [key(w) for w in stream_windows(plan, tok, "text", resume=None)]
    if limit is not None:
        assert sum(len(k[3]) for k in single) == min(limit, sum(
            stored_tokens(len(tok([d["text"]])["input_ids"][0]) if "text" in d else len(d["input_ids"]),
                          per_window, len(prefix) + len(suffix)) for d in docs))
    results, errors = rank_windows(plan, tok, world, mode=mode, round_size=round_factor * world or None)
    assert errors == [None] * world
    for rank, (stored, _) in enumerate(results):
        assert all(w.document % world == rank for w in stored)
        assert [(w.document, w.index) for w in stored] == sorted((w.document, w.index) for w in stored)
    assert sorted(key(w) for stored, _ in results for w in stored) == sorted(single)


@settings(max_examples=80)
@given(spec=docs_strategy, prefix=st.lists(st.integers(1, 3), max_size=2), per_window=st.integers(1, 6),
       limits=st.tuples(st.one_of(st.none(), st.integers(1, 300)), st.integers(1, 300)), change=st.booleans(),
       world=st.integers(2, 5), stops=st.lists(st.integers(0, 12), min_size=5, max_size=5),
       round_factor=st.integers(0, 2), modes=st.tuples(*[st.sampled_from(["ahead", "two-pass"])] * 2))
@example(spec=[(9, False)] * 6, prefix=[1], per_window=3, limits=(20, 20), change=False, world=2, stops=[1, 2, 0, 0, 0],
         round_factor=1, modes=("ahead", "ahead"))
@example(spec=[(9, False)] * 4, prefix=[1], per_window=3, limits=(None, 14), change=True, world=2,
         stops=[0, 1, 0, 0, 0], round_factor=1, modes=("ahead", "ahead"))  # the last stored window is 14's cut one
@example(spec=[(9, False)] * 4, prefix=[1], per_window=3, limits=(100, 14), change=True, world=2,
         stops=[0, 1, 0, 0, 0], round_factor=1, modes=("two-pass", "ahead"))  # the same after a plan with no cut
def test_ranks_killed_anywhere_resume_to_the_single_process_windows(spec, prefix, per_window, limits, change, world,
                                                                     stops, round_factor, modes):
    """Every rank stops at a random window (what it stored is what its writer checkpointed), then every rank
    resumes from its progress, with the same budget or another (or one where there was none): the result is
    the single process's windows with the budget of the second run, or, when a part already holds what that
    budget does not (past its end, or a last window cut otherwise), the same error on every rank."""
    docs = build_docs(spec, seed=3)
    first, second = limits[0], limits[1] if change else limits[0]
    tok = WordTokenizer()
    round_size = round_factor * world or None
    results, errors = rank_windows(make_plan(docs, prefix, [], per_window, first), tok, world, mode=modes[0],
                                   round_size=round_size, stop_after=stops[:world])
    assert errors == [None] * world
    stored = [key(w) for part, _ in results for w in part]
    want = sorted(key(w) for w in stream_windows(make_plan(docs, prefix, [], per_window, second), tok, "text",
                                                 resume=None))
    again, errors = rank_windows(make_plan(docs, prefix, [], per_window, second), tok, world, mode=modes[1],
                                 round_size=round_size, resume=[progress for _, progress in results])
    event("stored nothing" if not stored else "stored all" if sorted(stored) == want else "stored some")
    if not set(stored) <= set(want):
        event("refused")
        assert all(isinstance(e, ExtractionError) for e in errors), errors
        assert len({str(e) for e in errors}) == 1
        assert "--max-tokens" in str(errors[0]) and "--overwrite" in str(errors[0])
        return
    assert errors == [None] * world
    assert sorted(stored + [key(w) for part, _ in again for w in part]) == want


def test_a_finished_job_run_again_exchanges_once_and_stores_nothing():
    docs = build_docs([(12, False)] * 30)
    plan = make_plan(docs, [1], [], 4, 150)
    tok = WordTokenizer()
    results, errors = rank_windows(plan, tok, 3)
    assert errors == [None] * 3
    cut = [p for _, p in results if "cut_document" in p]
    assert cut and all(p["cut_limit"] == 150 for p in cut)  # the rank that stored the cut window knows the end
    ranks = Ranks(3)

    def again(rank, gather):
        return list(stream_windows(plan, tok, "text", resume=results[rank][1], rank=rank, world=3, all_gather=gather))

    got, errors = ranks.run(again)
    assert errors == [None] * 3 and got == [[], [], []]
    assert ranks.gathers == [1, 1, 1]


def test_a_bad_record_stops_every_rank_with_its_message(tmp_path):
    f = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": " ".join(f"w{j}" for j in range(i % 7 + 1))}) for i in range(300)]
    lines[133] = '{"text": "w1 w2"'  # rank 1's (133 % 3), in the third round
    f.write_text("\n".join(lines) + "\n")
    plan = CorpusPlan(open_source(f), Affixes((1,)), 4, 10_000, None)
    results, errors = Ranks(3).run(lambda rank, gather: list(stream_windows(
        plan, WordTokenizer(), "text", resume=None, rank=rank, world=3, all_gather=gather)))
    assert all(isinstance(e, PromptError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1 and "docs.jsonl, line 134 is not valid JSON" in str(errors[0])


def test_real_tokenizer_ranks_store_the_single_process_windows(llama_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    text = ("The cat sat on the mat and looked at the bird. A quick brown fox jumps over the lazy dog. "
            "Numbers like 12, 345 and 6789 appear in text as well. ")
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": text * (i % 4) + f"doc {i}"}) + "\n" for i in range(40)))
    plan = CorpusPlan(open_source(f), affixes_of(tok, special_tokens=True), 16, 777, None)
    single = sorted(key(w) for w in stream_windows(plan, tok, "text", resume=None))
    assert sum(len(k[3]) for k in single) == 777
    for mode in ("ahead", "two-pass"):
        results, errors = rank_windows(plan, tok, 3, mode=mode)
        assert errors == [None] * 3
        assert sorted(key(w) for stored, _ in results for w in stored) == single


# ---------------------------------------------------------------- the pure parts of the plan


@given(counts=st.lists(st.integers(0, 40), max_size=30), per_window=st.integers(1, 9), n_affixes=st.integers(0, 3),
       limit=st.integers(1, 500), used=st.integers(0, 100))
def test_find_cutoff_agrees_with_a_budget_taking_window_after_window(counts, per_window, n_affixes, limit, used):
    """The cutoff from counts alone is where a single process's Budget stops, window after window."""
    context_len = per_window + n_affixes
    if used >= limit:
        return
    budget, want = Budget(limit, used), None
    for d, c in enumerate(counts):
        for w, (a, b) in enumerate(windows(c, per_window)):
            n = budget.take(b - a + n_affixes)
            if n and budget.spent and want is None:
                want = (d, w, n)
    stored = [(d, stored_tokens(c, per_window, n_affixes)) for d, c in enumerate(counts)]
    cutoff, before = find_cutoff(stored, used=used, limit=limit, context_len=context_len)
    assert (None if cutoff is None else (cutoff.document, cutoff.window, cutoff.tokens)) == want
    if cutoff is None:
        assert before == used + sum(n for _, n in stored)
    else:
        assert before == used + sum(n for d, n in stored if d < cutoff.document)
        assert cutoff.limit == limit


def test_merge_counts_finds_the_source_end_and_refuses_ranks_that_disagree():
    assert merge_counts([{"counts": [5, 7]}, {"counts": [6, 0]}], 10, 14, 2) == [(10, 5), (11, 6), (12, 7), (13, 0)]
    assert merge_counts([{"counts": []}, {"counts": []}, {"counts": []}], 3, 9, 3) == []
    with pytest.raises(ExtractionError, match="document 10 is missing on rank 0 but rank 1 has document 11"):
        merge_counts([{"counts": []}, {"counts": [6]}], 10, 14, 2)


def test_positions_survive_the_writer_and_a_plan_restarts_at_the_lowest():
    cut = Cutoff(9, 2, 3, 500)
    for p in (Position(), Position(7, 2, 300, 12), Position(9, 3, None, 3, cut)):
        progress = progress_record(p.document, p.window, tokens_before=p.tokens_before, last_tokens=p.last_tokens,
                                   cutoff=p.cutoff) if p.window else None
        assert Position.from_progress(progress) == p
        assert Position.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert Position.from_progress({"document": 4, "window": 1}).tokens_before is None  # a single process's
    start = start_plan([Position(40, 1, 900, 12), Position(35, 2, 870, 8), Position()], 5000)
    assert (start.cutoff, start.document, start.tokens_before) == (None, 0, 0)
    start = start_plan([Position(40, 1, 900, 12), Position(35, 2, 870, 8)], 5000)
    assert (start.cutoff, start.document, start.tokens_before) == (None, 35, 870)
    start = start_plan([Position(40, 1, None, 12), Position(35, 2, 870, 8)], 5000)
    assert (start.document, start.tokens_before) == (0, 0)  # a rank that cannot say: from the start
    assert start_plan([Position(9, 3, None, 3, cut), Position(8, 1, 400, 9)], 500).cutoff == cut
    assert start_plan([Position(9, 3, None, 3, cut), Position(8, 1, 400, 9)], 600).cutoff is None  # another budget
    with pytest.raises(ExtractionError, match="source changed"):
        start_plan([Position(8, 1, 400, 9), Position(8, 2, 401, 9)], 600)
    with pytest.raises(ExtractionError, match="different ends"):
        start_plan([Position(9, 3, None, 3, cut), Position(9, 3, None, 3, Cutoff(9, 2, 4, 500))], 500)
    with pytest.raises(ExtractionError, match="impossible end"):
        Position.from_progress({"document": 1, "window": 1, "cut_document": 1, "cut_window": 0, "cut_tokens": 0,
                                "cut_limit": 5})


def test_ahead_raises_the_threads_error_with_its_traceback_and_stops_when_closed():
    def failing():
        yield 1
        raise KeyError("boom")

    it = ahead(failing)
    assert next(it) == 1
    with pytest.raises(KeyError, match="boom") as err:
        next(it)
    assert any(f.name == "failing" for f in traceback.extract_tb(err.value.__traceback__))
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    it = ahead(endless)
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    it.close()
    assert closed.wait(5)


# ---------------------------------------------------------------- prompts, one share a rank

value = st.one_of(st.none(), st.integers(-5, 5), st.sampled_from([1.5, -0.25]), st.sampled_from(["a", "b"]),
                  st.booleans())
prompt_record = st.fixed_dictionaries(
    {"text": st.sampled_from(["The cat sat.", "A dog ran.", "Hi"])},
    optional={"label": st.one_of(st.none(), st.integers(0, 3), st.sampled_from(["pos", "neg"]), st.just(2.0)),
              "x": st.one_of(st.none(), st.integers(0, 9)), "y": value})
#: what makes one record bad (or, with "label", another kind of label than the others')
POISON = {"empty": {"text": "  "}, "reserved": {"num_tokens": 1}, "list": {"z": [1, 2]}, "big": {"label": 2**40},
          "kind": {"label": "other"}, "float": {"label": 1.5}, "mixed": {"x": "nine"}}


def read_shares(items, world, **kw):
    return Ranks(world).run(lambda rank, gather: read_prompts(items, rank=rank, world=world, all_gather=gather,
                                                              **kw))


@settings(max_examples=80)
@given(items=st.lists(prompt_record, max_size=14), world=st.integers(2, 6), label=st.sampled_from(["label"] * 3 + ["y"]),
       poison=st.one_of(st.none(), st.tuples(st.sampled_from(sorted(POISON)), st.integers(0, 13))))
@example(items=[{"text": "Hi", "label": 1}, {"text": "Hi", "label": "pos"}], world=2, label="label", poison=None)
@example(items=[{"text": "Hi", "y": 1}, {"text": "Hi", "y": 1.5}, {"text": "Hi"}], world=3, label="label", poison=None)
def test_the_ranks_prompts_are_the_whole_sets_with_its_columns_types_and_errors(items, world, label, poison):
    """Read in shares, the prompts are the whole set's, with its column order, column types and label type,
    and a set that one process refuses is refused by every rank, with one message."""
    if poison and items:
        name, at = poison
        items[at % len(items)] = {**items[at % len(items)], **POISON[name]}
    kw = {"label_column": label}
    try:
        whole = read_prompts(items, **kw)
    except PromptError:
        whole = None
    shares, errors = read_shares(items, world, **kw)
    event("refused" if whole is None else "read")
    if whole is None:
        assert all(isinstance(e, PromptError) for e in errors), errors
        assert len({str(e) for e in errors}) == 1  # the same message on every rank
        return
    assert errors == [None] * world
    identity = whole.set_identity()
    for rank, p in enumerate(shares):
        idx = list(range(rank, len(items), world))
        assert p.indices == idx and p.share == (rank, world) and p.total == len(items)
        assert p.texts == [whole.texts[i] for i in idx]
        assert p.labels == (None if whole.labels is None else [whole.labels[i] for i in idx])
        assert (p.label_type, p.column_types) == (whole.label_type, whole.column_types)
        assert list(p.columns) == list(whole.columns)
        assert p.columns == {c: [v[i] for i in idx] for c, v in whole.columns.items()}
        assert p.locations == [whole.locations[i] for i in idx]
        assert p.set_identity() == identity
    assert len({p.fingerprint() for p in shares}) == world  # each share its own


def test_a_share_parses_only_its_own_lines_and_the_identity_ignores_the_number_of_ranks(tmp_path, monkeypatch):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"text": f"prompt {i}", "label": i % 2}) + "\n" for i in range(10)))
    parsed = []
    real = sources.loads
    monkeypatch.setattr(sources, "loads", lambda raw, **kw: parsed.append(raw) or real(raw, **kw))
    shares, errors = read_shares(f, 3)
    assert errors == [None] * 3 and len(parsed) == 10  # each line parsed once, by its rank
    assert [p.indices for p in shares] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    whole = read_prompts(f)
    assert {p.set_identity() for p in shares} == {whole.set_identity()}
    assert {p.set_identity() for p in read_shares(f, 4)[0]} == {whole.set_identity()}
    assert whole.fingerprint() == read_prompts(f).fingerprint() != whole.set_identity()  # a whole set's is as before
    other = tmp_path / "other.jsonl"
    other.write_text(f.read_text().replace("prompt 7", "prompt 77"))
    assert {p.set_identity() for p in read_shares(other, 3)[0]} != {whole.set_identity()}
    # more ranks than prompts: a rank may hold none
    shares, errors = read_shares(["a", "b"], 3)
    assert errors == [None] * 3 and [len(p) for p in shares] == [1, 1, 0]
    assert shares[2].column_types == {} and shares[2].set_identity() == read_prompts(["a", "b"]).set_identity()
    _, errors = read_shares([], 2)
    assert all(isinstance(e, PromptError) and "no prompts found" in str(e) for e in errors)


def test_ahead_raises_an_error_of_the_maker_itself():
    def broken():
        raise OSError("no source")

    with pytest.raises(OSError, match="no source"):
        list(ahead(broken))


def test_every_message_of_a_rank_names_the_rank_whatever_module_logs_it(capsys):
    """Under torchrun each node shows its own rank's lines: a message of any lmprobe module (a child logger of
    ``lmprobe``) starts with ``[rank R/W]``; other libraries' records are left as they are."""
    import logging

    from lmprobe.base.progress import messages_shown
    from lmprobe.extraction import torchrun

    make = logging.getLogRecordFactory()
    try:
        torchrun._name_ranks(1, 2)
        torchrun._name_ranks(1, 2)  # named once: one prefix
        with messages_shown():
            logging.getLogger("lmprobe.storage.commits").info("pushed %s file(s)", 3)
            logging.getLogger("lmprobe").warning("done")
        other = logging.getLogRecordFactory()("urllib3", logging.INFO, __file__, 1, "x", (), None)
    finally:
        logging.setLogRecordFactory(make)
    assert capsys.readouterr().err == "[rank 1/2] pushed 3 file(s)\n[rank 1/2] done\n"
    assert other.msg == "x"
