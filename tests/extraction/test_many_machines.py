"""One dataset from many machines: torchrun across simulated nodes on 127.0.0.1 (gloo, c10d), each node
with its own working, temporary and cache folders, writing straight to object storage (moto) or a Hub repo (the local
test server); the result equals a single-process extraction, local disk stays bounded, a killed run resumes."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from support.datasets import PROMPTS
from support.nodes import Peak, disk_use, found, kill_when, launch, run

import lmprobe

pytestmark = pytest.mark.slow  # real processes, rendezvous and model loads

MANY = [dict(p, text=p["text"] + f" #{i}") for i in range(12) for p in PROMPTS]  # 84 prompts


def _single(*args, **kw):
    """A single-process extraction computed as the nodes compute (one thread: the same sums in the same order)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return lmprobe.extract(*args, quiet=True, **kw)
    finally:
        torch.set_num_threads(threads)


def _prompts(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in MANY) + "\n")
    return f


def _same_rows(a, b, layers, *, full):
    assert a.texts == b.texts and a.num_prompts == b.num_prompts
    for layer in layers:
        np.testing.assert_array_equal(a.hidden(layer), b.hidden(layer))
        if full:
            for i in range(a.num_prompts):
                np.testing.assert_array_equal(a.token_hidden(i, layer), b.token_hidden(i, layer))
        sa, sb = a.statistics(layer), b.statistics(layer)
        assert sa["count"] == sb["count"]
        np.testing.assert_allclose(sb["mean"], sa["mean"], rtol=1e-6, atol=1e-6)


def test_two_nodes_write_one_dataset_to_object_storage(s3, llama_dir, tmp_path):
    """Prompt mode, two nodes of one rank, no shared disk: the bucket ends with one dataset equal to one process's
    (float32 on CPU: the same numbers), in prompt order, with nothing left of the parts; each
    node's local disk held a few shards at a time."""
    f = _prompts(tmp_path)
    kw = dict(layers="0,3", storage="full_sequence", logits_topk=3, batch_size=1, shard_size="2KB")
    single = _single(str(llama_dir), f, out=tmp_path / "one", **kw)
    url = f"s3://acts/nodes-{uuid.uuid4().hex[:6]}"
    argv = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", url, "--layers", "0,3", "--storage",
            "full_sequence", "--logits-topk", "3", "--batch-size", "1", "--shard-size", "2KB",
            "--checkpoint-interval", "0", "--quiet"]
    homes = [tmp_path / "node0" / "cache", tmp_path / "node1" / "cache"]
    with Peak(homes) as peak:
        run(tmp_path, argv)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    two = lmprobe.load(url)
    _same_rows(single, two, (0, 3), full=True)
    np.testing.assert_array_equal(two.logits_topk()[1], single.logits_topk()[1])
    keys = s3fs.S3FileSystem().find(url)
    assert not [k for k in keys if ".lmprobe-parts" in k or ".provisional" in k]
    shards = list((tmp_path / "one" / "tensors").glob("*.safetensors"))
    shard = max(p.stat().st_size for p in shards)
    # a few shards per stored site (2 layers) and the logits' and statistics' files, not the dataset
    assert peak.peak <= 2 * 6 * shard, (peak.peak, shard, len(shards))
    assert disk_use(tmp_path / "one" / "tensors") > 4 * peak.peak


def test_a_killed_two_node_run_resumes_and_equals_an_uninterrupted_one(s3, llama_dir, tmp_path):
    f = _prompts(tmp_path)
    single = _single(str(llama_dir), f, out=tmp_path / "one", layers="1", storage="full_sequence", batch_size=1,
                     shard_size="2KB")
    url = f"s3://acts/killed-{uuid.uuid4().hex[:6]}"
    argv = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", url, "--layers", "1", "--storage",
            "full_sequence", "--batch-size", "1", "--shard-size", "2KB", "--checkpoint-interval", "0", "--quiet"]
    procs = launch(tmp_path, argv)
    staging = [tmp_path / f"node{n}" / "cache" / "outputs" for n in (0, 1)]

    def some_progress():  # both ranks checkpointed at least once
        states = [list(s.rglob("state.json")) for s in staging]
        return all(states)

    kill_when(procs, some_progress)
    run(tmp_path, argv)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    _same_rows(single, lmprobe.load(url), (1,), full=True)
    assert not [k for k in s3fs.S3FileSystem().find(url) if ".lmprobe-parts" in k]


def _corpus(tmp_path, n_docs=30):
    f = tmp_path / "corpus.jsonl"
    docs = [" ".join(f"w{(d * 7 + j) % 50}" for j in range(5 + (d * 13) % 40)) for d in range(n_docs)]
    f.write_text("\n".join(json.dumps({"text": t}) for t in docs) + "\n")
    return f


def test_two_nodes_extract_a_corpus_budget_exactly_as_one_process(s3, llama_dir, tmp_path):
    """Corpus mode: documents dealt by rank, --max-tokens exact over both nodes: the same windows (document,
    window_start, tokens, the last one cut the same way) with the same vectors, in source order."""
    f = _corpus(tmp_path)
    kw = dict(layers="2", storage="full_sequence", context_len=16, max_tokens=333, batch_size=1, shard_size="2KB",
              token_ids=True)
    single = _single(str(llama_dir), f, out=tmp_path / "one", **kw)
    url = f"s3://acts/corpus-{uuid.uuid4().hex[:6]}"
    run(tmp_path, ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", url, "--layers", "2",
                   "--storage", "full_sequence", "--context-len", "16", "--max-tokens", "333", "--batch-size", "1",
                   "--shard-size", "2KB", "--token-ids", "--checkpoint-interval", "0", "--quiet"])
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    two = lmprobe.load(url)
    assert int(two.index["num_tokens"].sum()) == 333
    for col in ("document", "window_start", "num_tokens", "token_ids"):
        assert [list(x) if hasattr(x, "__len__") else x for x in two.index[col]] == \
            [list(x) if hasattr(x, "__len__") else x for x in single.index[col]], col
    _same_rows(single, two, (2,), full=True)


def _corpus_folder(tmp_path, n_docs=60):
    """A corpus of four files: two parquet files of row groups of 5 documents, two jsonl files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "corpus"
    root.mkdir()
    docs = [" ".join(f"w{(d * 7 + j) % 50}" for j in range(5 + (d * 13) % 40)) for d in range(n_docs)]
    quarter = n_docs // 4
    for k in range(4):
        part = docs[k * quarter : (k + 1) * quarter]
        if k % 2 == 0:
            pq.write_table(pa.table({"text": part}), root / f"part-{k}.parquet", row_group_size=5)
        else:
            (root / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    return root


@pytest.mark.parametrize("max_tokens", [None, 777])
def test_two_nodes_deal_a_folder_of_files_and_store_one_process_windows(s3, llama_dir, tmp_path, max_tokens):
    """Corpus mode over a folder of parquet and jsonl files, dealt to the nodes by piece (a row group, or a jsonl
    file): the same windows and vectors as one process, --max-tokens exact."""
    folder = _corpus_folder(tmp_path)
    kw = dict(layers="2", storage="full_sequence", context_len=16, batch_size=1, shard_size="2KB", token_ids=True)
    budget = [] if max_tokens is None else ["--max-tokens", str(max_tokens)]
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    single = _single(str(llama_dir), folder, out=tmp_path / "one", **kw)
    url = f"s3://acts/dealt-{uuid.uuid4().hex[:6]}"
    run(tmp_path, ["extract", "--model", str(llama_dir), "--prompts", str(folder), "--out", url, "--layers", "2",
                   "--storage", "full_sequence", "--context-len", "16", *budget, "--batch-size", "1",
                   "--shard-size", "2KB", "--token-ids", "--checkpoint-interval", "0", "--quiet"])
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    two = lmprobe.load(url)
    if max_tokens is not None:
        assert int(two.index["num_tokens"].sum()) == max_tokens
    for col in ("document", "window_start", "num_tokens", "token_ids"):
        assert [list(x) if hasattr(x, "__len__") else x for x in two.index[col]] == \
            [list(x) if hasattr(x, "__len__") else x for x in single.index[col]], col
    _same_rows(single, two, (2,), full=True)


# ---------------------------------------------------------------------------------------------- straight to the Hub


@pytest.fixture
def fast_commits(monkeypatch):
    # the Hub's ~100 commits an hour, on a clock whose hour lasts a second (the local server takes more)
    monkeypatch.setenv("LMPROBE_HUB_HOUR_SECONDS", "1")


def _hub_tree(hub, name):
    repo = hub.state.repos[("dataset", f"user/{name}")]
    return repo.commits[repo.branches["main"]]


def test_two_nodes_write_one_dataset_to_the_hub(hub, fast_commits, llama_dir, tmp_path):
    """Prompt mode to hf://: one dataset equal to one process's, the parts' folders gone, each node's shard data on
    disk a few shards at a time."""
    f = _prompts(tmp_path)
    single = _single(str(llama_dir), f, out=tmp_path / "one", layers="0,3", storage="full_sequence", batch_size=1,
                     shard_size="2KB")
    name = f"nodes-{uuid.uuid4().hex[:6]}"
    argv = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", f"hf://datasets/user/{name}",
            "--layers", "0,3", "--storage", "full_sequence", "--batch-size", "1", "--shard-size", "2KB",
            "--checkpoint-interval", "0", "--quiet"]
    homes = [tmp_path / "node0" / "cache", tmp_path / "node1" / "cache"]
    with Peak(homes) as peak:
        run(tmp_path, argv)
    two = lmprobe.load(f"hf://datasets/user/{name}")
    _same_rows(single, two, (0, 3), full=True)
    tree = _hub_tree(hub, name)
    assert not [p for p in tree if ".lmprobe-parts" in p or ".provisional" in p]
    shards = list((tmp_path / "one" / "tensors").glob("*.safetensors"))
    shard = max(p.stat().st_size for p in shards)
    assert peak.peak <= 2 * 8 * shard, (peak.peak, shard, len(shards))
    assert disk_use(tmp_path / "one" / "tensors") > 4 * peak.peak


def test_a_killed_two_node_corpus_run_to_the_hub_resumes(hub, fast_commits, llama_dir, tmp_path):
    """Corpus mode to hf://, both nodes killed once each had checkpointed: the same command again finishes with the
    windows and vectors of an uninterrupted single process."""
    f = _corpus(tmp_path, n_docs=120)  # long enough a run that both nodes are caught mid-way
    kw = dict(layers="2", storage="full_sequence", context_len=16, max_tokens=1333, batch_size=1, shard_size="2KB")
    single = _single(str(llama_dir), f, out=tmp_path / "one", **kw)
    name = f"corpus-{uuid.uuid4().hex[:6]}"
    argv = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", f"hf://datasets/user/{name}",
            "--layers", "2", "--storage", "full_sequence", "--context-len", "16", "--max-tokens", "1333",
            "--batch-size", "1", "--shard-size", "2KB", "--checkpoint-interval", "0", "--quiet"]
    procs = launch(tmp_path, argv)
    staging = [tmp_path / f"node{n}" / "cache" / "outputs" for n in (0, 1)]
    kill_when(procs, lambda: all(found(s, "state.json") for s in staging))
    run(tmp_path, argv)
    two = lmprobe.load(f"hf://datasets/user/{name}")
    assert int(two.index["num_tokens"].sum()) == 1333
    for col in ("document", "window_start", "num_tokens"):
        assert list(two.index[col]) == list(single.index[col]), col
    _same_rows(single, two, (2,), full=True)
    assert not [p for p in _hub_tree(hub, name) if ".lmprobe-parts" in p]


def test_one_process_commits_for_all_ranks_within_the_hubs_rate(hub, llama_dir, tmp_path):
    """Two nodes of two ranks to hf://, the server enforcing 100 commits an "hour" of 10 s: every
    shard and part index is committed by rank 0's committer (no rank commits its own part), none is refused, and
    the job takes a handful of commits, not one per rank and per 50 files."""
    f = _prompts(tmp_path)
    name = f"one-committer-{uuid.uuid4().hex[:6]}"
    argv = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", f"hf://datasets/user/{name}",
            "--layers", "0,3", "--storage", "full_sequence", "--batch-size", "1", "--shard-size", "2KB",
            "--checkpoint-interval", "0", "--quiet"]
    hub.limit_commits(100, hour=10)
    try:
        run(tmp_path, argv, per_node=2, env={"LMPROBE_HUB_HOUR_SECONDS": "10"})
    finally:
        refused = hub.state.refused_commits
        hub.limit_commits(None)
    summaries = [s for r, _, s in hub.state.commit_log if r == f"user/{name}"]
    ours = [s for s in summaries if "rank 0 for the job's 4 ranks" in s]
    merge = [s for s in summaries if "merge" in s or "rename" in s]
    marker = [s for s in summaries if "starts writing here" in s]  # rank 0 claims the folder for the job (finding 3)
    assert refused == 0 and len(marker) == 1 and len(ours) + len(merge) + 1 == len(summaries), summaries
    shards = [p for p in _hub_tree(hub, name) if p.endswith(".safetensors")]
    # (ranks waiting for their last files to land make a partial commit or two beside the ladder's)
    assert len(shards) > 100 and len(summaries) <= 10, (len(shards), "\n".join(summaries))
    assert lmprobe.load(f"hf://datasets/user/{name}").num_prompts == len(MANY)


def test_two_nodes_killed_in_their_commit_tail_finish_on_the_same_command(hub, fast_commits, llama_dir, tmp_path):
    """Every process killed once a rank's writer had closed (its index staged) while commits take a
    second: the same command again finishes from what is staged and uploaded, equal to one process."""
    f = _prompts(tmp_path)
    single = _single(str(llama_dir), f, out=tmp_path / "one", layers="1", storage="full_sequence", batch_size=1,
                     shard_size="2KB")
    name = f"tail-{uuid.uuid4().hex[:6]}"
    argv = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", f"hf://datasets/user/{name}",
            "--layers", "1", "--storage", "full_sequence", "--batch-size", "1", "--shard-size", "2KB",
            "--checkpoint-interval", "0", "--quiet"]
    staging = [tmp_path / f"node{n}" / "cache" / "outputs" for n in (0, 1)]
    hub.delay_commits(1.0)
    try:
        kill_when(launch(tmp_path, argv), lambda: any(found(s, "train-*.parquet") for s in staging))
    finally:
        hub.delay_commits(0.0)
    before = len([p for m, p in hub.log if m == "PUT" and "/lfs-upload/" in p])
    run(tmp_path, argv)
    _same_rows(single, lmprobe.load(f"hf://datasets/user/{name}"), (1,), full=True)
    again = len([p for m, p in hub.log if m == "PUT" and "/lfs-upload/" in p]) - before
    shards = len(list((tmp_path / "one" / "tensors").glob("*.safetensors")))
    assert again < shards // 2, (again, shards)  # what went up before the kill did not go up again
    assert not [p for p in _hub_tree(hub, name) if ".lmprobe-parts" in p or ".provisional" in p]


def test_a_jobs_sequence_shards_are_copied_once_by_the_merge_not_renamed_in_the_tail(hub, fast_commits, llama_dir,
                                                                                     tmp_path):
    """A rank's sequence shards go up under provisional names (their numbers are known at the
    end); the merge copies them straight to their place in the dataset. No part renames its shards before (a copy
    and a delete each: at W1's size ~24 more commits in the tail), so no file leaves the repo before the merge's
    commit, which removes the parts' folder."""
    f = _prompts(tmp_path)
    single = _single(str(llama_dir), f, out=tmp_path / "one", layers="1", storage="full_sequence", batch_size=1,
                     shard_size="2KB")
    name = f"no-renames-{uuid.uuid4().hex[:6]}"
    argv = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", f"hf://datasets/user/{name}",
            "--layers", "1", "--storage", "full_sequence", "--batch-size", "1", "--shard-size", "2KB",
            "--checkpoint-interval", "0", "--quiet"]
    run(tmp_path, argv)
    _same_rows(single, lmprobe.load(f"hf://datasets/user/{name}"), (1,), full=True)
    trees = list(hub.state.repos[("dataset", f"user/{name}")].commits.values())
    removed = [sorted(set(a) - set(b)) for a, b in zip(trees, trees[1:], strict=False)]
    assert not [r for r in removed[:-1] if r], [r[:3] for r in removed if r]
    assert any(".provisional" in p for p in removed[-1])


def _resumed(outs):
    """Each node's "resuming after N rows ..., recomputing the last K of them" (N, K), from the announce lines."""
    import re

    found = []
    for out in outs:
        for m in re.finditer(r"resuming after (\d+) rows? \([\d,]+ tokens?\)(?:, recomputing the last (\d+) rows?)?",
                             out):
            found.append((int(m.group(1)), int(m.group(2) or 0)))
    return found


def _rank1_copy_holds(hub, name: str, *, rows: int):
    """When to kill a job: once rank 1's checkpoint copy on the Hub (copied once the shards it names were
    committed) holds ``rows`` rows, well into its part."""
    import pyarrow.parquet as pq

    copy = ".lmprobe-parts/part-00001/.lmprobe-resume/checkpoint.parquet"

    def holds() -> bool:
        try:
            tree = _hub_tree(hub, name)
        except KeyError:  # (the repo is not made yet)
            return False
        if copy not in tree:
            return False
        meta = pq.read_schema(hub.state.lfs_path(tree[copy].sha256)).metadata[b"lmprobe:resume"]
        return json.loads(meta)["state"]["num_prompts"] >= rows

    return holds


def test_a_rank_resuming_on_another_node_resumes_from_what_the_hub_holds(hub, fast_commits, llama_dir, tmp_path):
    """Both nodes killed once rank 1's checkpoint was on the Hub (after some of its shards were
    committed), then the job run again on two fresh nodes (empty working, temporary and cache folders: c10d placed
    the ranks elsewhere). Each rank resumes from its part's checkpoint on the Hub, recomputing only the rows of the
    shards that had not landed, and the dataset's shards are byte for byte an uninterrupted job's."""
    import shutil

    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in MANY + MANY) + "\n")  # 168 prompts: long enough to be caught
    args = ["--model", str(llama_dir), "--prompts", str(f), "--layers", "1", "--storage", "full_sequence",
            "--batch-size", "1", "--shard-size", "2KB", "--checkpoint-interval", "0"]
    whole, name = f"whole-{uuid.uuid4().hex[:6]}", f"moved-{uuid.uuid4().hex[:6]}"
    run(tmp_path / "uninterrupted", ["extract", *args, "--out", f"hf://datasets/user/{whole}", "--quiet"])
    argv = ["extract", *args, "--out", f"hf://datasets/user/{name}"]
    kill_when(launch(tmp_path / "first", argv + ["--quiet"]), _rank1_copy_holds(hub, name, rows=12))
    assert not [p for p in _hub_tree(hub, name) if p.startswith("index/")]  # (caught before the merge)
    outs = run(tmp_path / "elsewhere", argv)  # other nodes: nothing of the first run's staging is there
    resumed = _resumed(outs)
    # rank 1 did not compute again the rows of the shards that were committed: only those of its open shards
    assert any(n >= 12 and n - k >= 10 for n, k in resumed), (resumed, [o[-3000:] for o in outs])
    shutil.rmtree(tmp_path / "first")

    a, b = lmprobe.load(f"hf://datasets/user/{whole}"), lmprobe.load(f"hf://datasets/user/{name}")
    _same_rows(a, b, (1,), full=True)
    assert a.index.equals(b.index)
    shards = [{p: e.sha256 for p, e in _hub_tree(hub, repo).items() if p.endswith(".safetensors")} for repo in (whole, name)]
    assert len(shards[0]) > 20 and shards[0] == shards[1]
    assert not [p for p in _hub_tree(hub, name) if ".lmprobe-parts" in p or ".lmprobe-resume" in p]


def test_a_corpus_ranks_resuming_on_another_node_replay_its_source_from_what_the_hub_holds(hub, fast_commits,
                                                                                        llama_dir, tmp_path):
    """A corpus job: a local multi-file parquet source dealt to two ranks by piece, an exact
    --max-tokens. Both nodes killed once rank 1's checkpoint copy was well into its part, then the job run again on
    two fresh nodes: each rank resumes after its copy's rows, replaying its source from where the shards the copy
    left open began, and the dataset's shards and index are an uninterrupted job's."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [p["text"] + f" number {i} of the corpus, with a few more words to make windows." for i in range(8)
            for p in PROMPTS]
    folder = tmp_path / "corpus"
    folder.mkdir()
    for k in range(3):  # six pieces (two row groups a file): three a rank
        pq.write_table(pa.table({"text": docs[k::3]}), folder / f"train-{k}.parquet", row_group_size=10)
    args = ["--model", str(llama_dir), "--prompts", str(folder), "--layers", "1", "--storage", "full_sequence",
            "--context-len", "10", "--max-tokens", "1200", "--token-ids", "--batch-size", "2", "--shard-size", "2KB",
            "--checkpoint-interval", "0"]
    whole, name = f"corpus-whole-{uuid.uuid4().hex[:6]}", f"corpus-moved-{uuid.uuid4().hex[:6]}"
    run(tmp_path / "uninterrupted", ["extract", *args, "--out", f"hf://datasets/user/{whole}", "--quiet"])
    argv = ["extract", *args, "--out", f"hf://datasets/user/{name}"]
    kill_when(launch(tmp_path / "first", argv + ["--quiet"]), _rank1_copy_holds(hub, name, rows=16))
    assert not [p for p in _hub_tree(hub, name) if p.startswith("index/")]  # (caught before the merge)
    outs = run(tmp_path / "elsewhere", argv)  # other nodes: nothing of the first run's staging is there
    resumed = _resumed(outs)
    # rank 1 replayed only the windows of its open shards, not those of the shards that were committed
    assert any(n >= 16 and n - k >= 10 for n, k in resumed), (resumed, [o[-3000:] for o in outs])
    shutil.rmtree(tmp_path / "first")

    a, b = lmprobe.load(f"hf://datasets/user/{whole}"), lmprobe.load(f"hf://datasets/user/{name}")
    assert int(a.column("num_tokens").sum()) == 1200
    _same_rows(a, b, (1,), full=True)
    assert a.index.equals(b.index)
    shards = [{p: e.sha256 for p, e in _hub_tree(hub, repo).items() if p.endswith(".safetensors")} for repo in (whole, name)]
    assert len(shards[0]) > 20 and shards[0] == shards[1]
    assert not [p for p in _hub_tree(hub, name) if ".lmprobe-parts" in p or ".lmprobe-resume" in p]
