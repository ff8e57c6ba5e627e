"""The streaming training reader (ShardStream) on a local dataset: every stored vector once per pass, shuffled,
seeded, ranks, resume, normalisation, filters, bfloat16 or float32 batches, and the plan of a pass.

Reading a remote dataset (the Hub, S3) through the bounded cache is tested in test_remote_stream.py."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from support.datasets import write_dataset
from support.paths import ROOT

import lmprobe
from lmprobe.errors import InvalidArgumentError
from lmprobe.format.values import float32_to_bfloat16_bits
from lmprobe.stream import ShardStream


def _all_vectors(src, layer):
    return src["hidden"][layer]


def test_every_vector_once_shuffled_and_seeded(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=40, layers=(0, 2), dim=4, storage="full_sequence", shard_size="256B")
    stream = ShardStream(tmp_path / "ds", 2, 16, seed=5, memory="4KB", block_rows=2)
    batches = list(stream)
    got = np.concatenate(batches)
    want = _all_vectors(src, 2)
    assert len(stream) == len(want) == len(got)
    assert all(len(b) == 16 for b in batches[:-1])
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(want, axis=0))
    assert not np.array_equal(got, want)
    np.testing.assert_array_equal(np.concatenate(list(ShardStream(tmp_path / "ds", 2, 16, seed=5, memory="4KB", block_rows=2))),
                                  got)
    other = np.concatenate(list(ShardStream(tmp_path / "ds", 2, 16, seed=6, memory="4KB", block_rows=2)))
    assert not np.array_equal(other, got)


def test_torch_workers_split_the_shards(tmp_path, rng):
    import torch

    src = write_dataset(tmp_path / "ds", rng, n=30, layers=(1,), dim=3, storage="full_sequence", shard_size="128B")
    stream = ShardStream(tmp_path / "ds", 1, 8, seed=0)
    loader = torch.utils.data.DataLoader(stream.torch_dataset(), batch_size=None, num_workers=2)
    got = torch.cat(list(loader)).numpy()
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(src["hidden"][1], axis=0))


def test_pooled_dataset_streams_last_tokens(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=25, layers=(0,), dim=4, dtype="bfloat16", shard_size="64B")
    got = np.concatenate(list(ShardStream(tmp_path / "ds", 0, 10, shuffle=False)))
    np.testing.assert_array_equal(got, lmprobe.load(tmp_path / "ds").hidden(0))
    assert len(src["texts"]) == len(got)


# ------------------------------------------------------------------ the training reader

N_SORTED = 12000


def _sorted_dataset(path, *, storage="pooled", n=N_SORTED, tokens=1, dim=6, layers=(0, 1), token_ids=False):
    """Rows stored sorted by label (all 0s, then all 1s); component 0 of every vector is its token's global id,
    component 1 its label, component 2 its position in the prompt; layer L adds L to component 3."""
    from lmprobe.format.writer import DatasetWriter

    with DatasetWriter(path, layers=list(layers), dim=dim, model_name="synthetic", storage=storage,
                       shard_size=dim * 4 * 200, statistics=True, label_type="int", token_ids=token_ids) as w:
        gid = 0
        for start in range(0, n, 500):
            b = min(500, n - start)
            counts = np.full(b, tokens)
            rows = int(counts.sum()) if storage == "full_sequence" else b
            base = np.zeros((rows, dim), np.float32)
            labels = [int(i >= n // 2) for i in range(start, start + b)]
            base[:, 0] = np.arange(gid, gid + rows)
            per = np.repeat(labels, tokens) if storage == "full_sequence" else np.array(labels)
            base[:, 1] = per
            base[:, 2] = np.tile(np.arange(tokens), b) if storage == "full_sequence" else tokens - 1
            base[:, 4:] = np.random.default_rng(start).normal(size=(rows, dim - 4))
            gid += rows
            hidden = {}
            for layer in layers:
                h = base.copy()
                h[:, 3] = layer
                hidden[layer] = h
            kw = {"token_ids": [list(range(100, 100 + tokens)) for _ in range(b)]} if token_ids else {}
            w.add_batch(texts=["t"] * b, num_tokens=counts, hidden=hidden, labels=labels, **kw)
    return lmprobe.load(path)


def test_a_shuffled_pass_is_as_mixed_as_uniform_sampling(tmp_path):
    ds = _sorted_dataset(tmp_path / "ds")
    bs = 200
    stream = ShardStream(ds, 0, bs, seed=3, memory="1MB", drop_last=True)
    batches = list(stream)
    fractions = np.array([b[:, 1].mean() for b in batches])
    spread, binomial = fractions.std(), np.sqrt(0.25 / bs)
    assert abs(spread / binomial - 1) < 0.25, (spread, binomial)
    shard = ds.column("shard_index")
    shards_per_batch = [len(np.unique(shard[b[:, 0].astype(np.int64)])) for b in batches]
    assert min(shards_per_batch) >= 0.75 * len(np.unique(shard))  # each batch draws from (nearly) every shard
    # the budget holds whatever the dataset: a window is at most memory / 2 bytes of rows
    assert stream.engine.pool_rows * 6 * 4 <= 2**20 / 2
    got = np.concatenate(batches)[:, 0]
    assert len(np.unique(got)) == len(got) == N_SORTED // bs * bs


def test_ranks_are_disjoint_and_complete_and_epochs_reshuffle(tmp_path):
    ds = _sorted_dataset(tmp_path / "ds", n=3000)
    shares = [np.concatenate(list(ShardStream(ds, 1, 64, seed=1, rank=r, world_size=3, memory="64KB")))[:, 0]
              for r in range(3)]
    everything = np.concatenate(shares)
    assert len(everything) == len(np.unique(everything)) == 3000
    assert sum(len(ShardStream(ds, 1, 64, rank=r, world_size=3)) for r in range(3)) == 3000
    stream = ShardStream(ds, 1, 64, seed=1, memory="64KB")
    first, second = (np.concatenate(list(stream))[:, 0] for _ in range(2))
    assert stream.epoch == 2 and not np.array_equal(first, second)
    np.testing.assert_array_equal(np.sort(first), np.sort(second))
    with pytest.raises(InvalidArgumentError, match="rank must be in 0..world_size-1"):
        ShardStream(ds, 1, 64, rank=3, world_size=3)


@pytest.mark.parametrize("stop_after", [1, 7, 30])  # inside the first window, and past window boundaries
def test_a_resumed_reader_continues_exactly(tmp_path, stop_after):
    ds = _sorted_dataset(tmp_path / "ds", n=3000)
    whole = [b.copy() for b in ShardStream(ds, 0, 50, seed=4, memory="40KB")]
    stream = ShardStream(ds, 0, 50, seed=4, memory="40KB")
    head = []
    for b in stream:
        head.append(b.copy())
        if len(head) == stop_after:
            break
    state = json.loads(json.dumps(stream.state_dict()))  # plain JSON: saved beside a training checkpoint
    resumed = ShardStream(ds, 0, 50, seed=4, memory="40KB")
    resumed.load_state_dict(state)
    rest = [b.copy() for b in resumed]
    assert len(head) + len(rest) == len(whole)
    for a, b in zip(head + rest, whole, strict=True):
        np.testing.assert_array_equal(a, b)


def test_normalisation_uses_the_stored_statistics(tmp_path):
    ds = _sorted_dataset(tmp_path / "ds", n=2000)
    x = np.concatenate(list(ShardStream(ds, 0, 128, normalize="mean_norm")))
    np.testing.assert_allclose(np.linalg.norm(x, axis=1).mean(), np.sqrt(6), rtol=1e-5)
    stream = ShardStream(ds, 0, 128, normalize="mean_norm")
    np.testing.assert_allclose(stream.scale[0, 0], np.sqrt(6) / ds.statistics(0)["mean_norm"], rtol=1e-6)
    z = np.concatenate(list(ShardStream(ds, 0, 128, normalize="standardize")))
    np.testing.assert_allclose(z[:, [0, 1, 4, 5]].mean(axis=0), 0, atol=1e-4)
    np.testing.assert_allclose(z[:, [0, 1, 4, 5]].std(axis=0), 1, rtol=1e-4)


def test_filters_drop_exactly_what_they_say(tmp_path):
    ds = _sorted_dataset(tmp_path / "ds", storage="full_sequence", n=300, tokens=5, token_ids=True)
    total = 300 * 5
    x = np.concatenate(list(ShardStream(ds, 0, 64, skip_first_tokens=2)))
    assert len(x) == len(ShardStream(ds, 0, 64, skip_first_tokens=2)) == total - 2 * 300
    assert x[:, 2].min() == 2 and np.unique(x[:, 0]).size == len(x)
    # token ids are 100..104 at positions 0..4: skipping id 103 drops position 3 only
    y = np.concatenate(list(ShardStream(ds, 0, 64, skip_special_tokens=[103])))
    assert len(y) == total - 300 and not (y[:, 2] == 3).any()


def test_the_norm_filter_drops_outliers_and_counts_them(tmp_path):
    from lmprobe.format.writer import DatasetWriter

    rng = np.random.default_rng(0)
    h = rng.normal(size=(1000, 8)).astype(np.float32)
    h[[5, 500, 999]] *= 100  # attention-sink-like outliers
    with DatasetWriter(tmp_path / "ds", layers=[0], dim=8, model_name="m", shard_size=8 * 4 * 128) as w:
        w.add_batch(texts=["t"] * 1000, num_tokens=[1] * 1000, hidden={0: h})
    stream = ShardStream(tmp_path / "ds", 0, 100, max_norm_ratio=10)
    x = np.concatenate(list(stream))
    assert len(x) == 997 == len(ShardStream(tmp_path / "ds", 0, 100, max_norm_ratio=10))
    assert stream.dropped_by_norm == 3 and np.linalg.norm(x, axis=1).max() < 20


def test_several_sites_give_the_same_tokens(tmp_path):
    ds = _sorted_dataset(tmp_path / "ds", n=500, layers=(0, 1, 3))
    batches = list(ShardStream(ds, batch_size=64, layers=[0, 3], memory="64KB"))
    b = batches[0]
    assert b.shape == (64, 2, 6)
    np.testing.assert_array_equal(b[:, 0, 0], b[:, 1, 0])  # same token
    assert (b[:, 0, 3] == 0).all() and (b[:, 1, 3] == 3).all()
    assert sum(len(x) for x in batches) == 500


def test_bad_reader_arguments_are_clear(tmp_path):
    ds = _sorted_dataset(tmp_path / "ds", n=100)
    with pytest.raises(InvalidArgumentError, match="normalize must be"):
        ShardStream(ds, 0, 8, normalize="l2")
    with pytest.raises(InvalidArgumentError, match="holds less than one batch"):
        ShardStream(ds, 0, 4096, memory="64KB")
    with pytest.raises(InvalidArgumentError, match="stores none"):
        ShardStream(ds, 0, 8, skip_special_tokens=[1])


def test_the_train_sae_example_runs_end_to_end(tmp_path):
    """examples/train_sae.py: reader -> top-k SAE -> export-sae -> sae-topk, with the normalisation folded in."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "examples/train_sae.py", "--out", str(tmp_path), "--epochs", "3"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)  # as the docs run it
    assert r.returncode == 0, r.stderr[-2000:]
    assert "epoch   2: FVU" in r.stdout and r.stdout.count("top 5 features for prompt") == 3
    first, last = (float(line.split("FVU ")[1].split()[0]) for line in r.stdout.splitlines() if "FVU" in line)
    assert last < first  # it trained


def test_filters_on_a_pooled_dataset_look_at_the_one_stored_token(tmp_path):
    from lmprobe.format.writer import DatasetWriter

    lengths = [1, 2, 3, 4, 2, 1]
    ids = [[100 + j for j in range(n)] for n in lengths]  # the last token's id is 99 + num_tokens
    h = np.arange(6, dtype=np.float32)[:, None].repeat(4, axis=1)
    with DatasetWriter(tmp_path / "ds", layers=[0], dim=4, model_name="m", token_ids=True) as w:
        w.add_batch(texts=["t"] * 6, num_tokens=lengths, hidden={0: h}, token_ids=ids)
    got = np.concatenate(list(ShardStream(tmp_path / "ds", 0, 4, shuffle=False, skip_first_tokens=2)))[:, 0]
    assert got.tolist() == [2, 3]  # stored at positions 2 and 3; the others sit before position 2
    got = np.concatenate(list(ShardStream(tmp_path / "ds", 0, 4, shuffle=False, skip_special_tokens=[101])))[:, 0]
    assert got.tolist() == [0, 2, 3, 5]  # prompts 1 and 4 end with id 101


def _stopped_state(stream, after):
    for i, _ in enumerate(stream, start=1):
        if i == after:
            break
    return json.loads(json.dumps(stream.state_dict()))


@pytest.mark.parametrize(("changed", "named"), [
    ({"memory": "20KB"}, "memory"),
    ({"skip_first_tokens": 1}, "skip_first_tokens"),
    ({"block_rows": 3}, "block_rows"),
    ({"normalize": "mean_norm"}, "normalize"),
    ({"drop_last": True}, "drop_last"),
    ({"shuffle": False}, "shuffle"),
    ({"seed": 5}, "seed"),
    ({"batch_size": 40}, "batch_size"),
])
def test_a_state_is_refused_by_a_reader_that_would_serve_another_sequence(tmp_path, changed, named):
    ds = _sorted_dataset(tmp_path / "ds", storage="full_sequence", n=300, tokens=5, token_ids=True)
    base = {"seed": 4, "memory": "40KB", "batch_size": 50}
    state = _stopped_state(ShardStream(ds, 0, **base), 7)
    other = ShardStream(ds, 0, **{**base, **changed})
    with pytest.raises(InvalidArgumentError, match=rf"^this reader state was saved by a reader with {named}=.*; "
                                                   r"this reader has .*the same settings"):
        other.load_state_dict(state)
    # the error left the reader as it was: a full fresh pass
    assert sum(len(b) for b in other) == len(other)


def test_a_state_saved_over_another_dataset_is_refused(tmp_path):
    a = _sorted_dataset(tmp_path / "a", n=3000)
    b = _sorted_dataset(tmp_path / "b", n=2999)
    state = _stopped_state(ShardStream(a, 0, 50, seed=4, memory="40KB"), 3)
    with pytest.raises(InvalidArgumentError, match="saved by a reader with dataset="):
        ShardStream(b, 0, 50, seed=4, memory="40KB").load_state_dict(state)
    with pytest.raises(InvalidArgumentError, match="saved by a reader with sites="):
        ShardStream(a, 1, 50, seed=4, memory="40KB").load_state_dict(state)


@pytest.mark.parametrize(("edit", "message"), [
    ({"carry": list(range(60))}, "carry"),
    ({"carry": [1] * 20}, "carry"),
    ({"carry": [2**70]}, "carry"),
    ({"carry": [-1]}, "carry"),
    ({"carry": "x"}, "carry"),
    ({"window": -1}, "window"),
    ({"window": 10**6}, "window"),
    ({"window": 1.5}, "window"),
    ({"epoch": "x"}, "epoch"),
    ({"epoch": True}, "epoch"),
    ({"batches": -5}, "batches"),
    ({"batches": 10**6}, "batches"),
    ({"settings": None}, "settings"),
    ({"fingerprint": "0" * 64}, "fingerprint"),
])
def test_a_tampered_state_is_a_one_line_error(tmp_path, edit, message):
    ds = _sorted_dataset(tmp_path / "ds", n=3000)
    state = _stopped_state(ShardStream(ds, 0, 50, seed=4, memory="40KB"), 30)
    assert state["window"] >= 1 and state["carry"]
    fresh = ShardStream(ds, 0, 50, seed=4, memory="40KB")
    with pytest.raises(InvalidArgumentError, match=message) as err:
        fresh.load_state_dict({**state, **edit})
    assert "\n" not in str(err.value)
    for key in state:
        with pytest.raises(InvalidArgumentError, match=f"'{key}'"):
            fresh.load_state_dict({k: v for k, v in state.items() if k != key})
    with pytest.raises(InvalidArgumentError, match="a dict"):
        fresh.load_state_dict([state])


def test_world_size_zero_is_refused(tmp_path):
    ds = _sorted_dataset(tmp_path / "ds", n=300)
    with pytest.raises(InvalidArgumentError, match="world_size"):
        ShardStream(ds, 0, 50, rank=0, world_size=0)


def test_skip_special_tokens_finds_the_embedded_tokenizer_offline(tmp_path, monkeypatch):
    """`skip_special_tokens=True` on an lmprobe-tiny dataset finds the embedded tokenizer, never asks the Hub for
    `lmprobe-tiny` (retries, ~47 s offline, then an error), as `report` and `ds.prompt()` found the embedded tokenizer."""
    import huggingface_hub
    from huggingface_hub import constants

    from lmprobe.base.tokenizer import resolve_tokenizer

    ds = lmprobe.extract("lmprobe-tiny", ["The cat sat on the mat.", "A dog ran."], out=tmp_path / "ds", layers="-1",
                         storage="full_sequence", token_ids=True, quiet=True)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request would fail
    calls = []
    monkeypatch.setattr(huggingface_hub, "get_session", lambda *a, **k: calls.append(a) or 1 / 0)
    special = set(resolve_tokenizer("lmprobe-tiny").all_special_ids)
    ids = [t for row in ds.index["token_ids"] for t in row]
    assert special & set(ids)  # the tokenizer adds BOS: something to skip
    stream = ShardStream(ds, -1, 4, shuffle=False, skip_special_tokens=True)
    assert len(stream) == sum(t not in special for t in ids) < len(ids)
    assert sum(len(b) for b in stream) == len(stream) and not calls


# ------------------------------------------------------------------ the plan of a remote pass, no I/O

from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lmprobe.stream.plan import GroupPlan, Pieces, deal, groups, whole_share  # noqa: E402


@given(rows=st.lists(st.integers(0, 300), min_size=1, max_size=30), row_bytes=st.integers(1, 64),
       piece_bytes=st.integers(1, 4096))
@example(rows=[9], row_bytes=1, piece_bytes=3)  # equal pieces: 3 + 3 + 3, not 3 + 3 + 3 + 0
def test_pieces_are_equal_within_a_shard_and_never_larger_than_asked(rows, row_bytes, piece_bytes):
    p = Pieces.cut(np.array(rows), row_bytes=row_bytes, piece_bytes=piece_bytes)
    s, lo, hi = p.locate(np.arange(p.n))
    assert (hi > lo).all() and (hi - lo).sum() == sum(rows)
    for shard, n in enumerate(rows):  # consecutive, covering, at most piece_bytes unless one row is larger
        mine = s == shard
        assert lo[mine].tolist() == sorted(lo[mine].tolist()) and (lo[mine][1:] == hi[mine][:-1]).all()
        assert not n or (lo[mine][0] == 0 and hi[mine][-1] == n)
        assert ((hi - lo)[mine] * row_bytes <= max(piece_bytes, row_bytes)).all()
        assert len(set((hi - lo)[mine][:-1].tolist())) <= 1
    assert p.whole(np.arange(p.n)).tolist() == [rows[x] <= max(1, piece_bytes // row_bytes) for x in s.tolist()]


@given(rows=st.lists(st.integers(1, 200), min_size=1, max_size=60), n=st.integers(1, 9),
       block=st.integers(1, 16), seed=st.integers(0, 2**16))
@example(rows=[5], n=4, block=1, seed=0)  # fewer pieces than ranks: the one piece is cut between them
@example(rows=[1, 1, 1, 1, 11], n=3, block=1, seed=0)  # unequal pieces: a taker may get many small ones
def test_dealing_gives_every_row_to_exactly_one_taker_in_balanced_runs(rows, n, block, seed):
    share = whole_share(np.array(rows))
    parts = [deal(share, n, q, block, np.random.default_rng(seed)) for q in range(n)]
    seen = np.zeros(sum(rows), dtype=int)
    base = np.concatenate([[0], np.cumsum(rows)])
    for part in parts:
        assert (np.diff(part.piece) > 0).all()  # in dataset order, one part per piece
        assert ((part.lo % block == 0) | (part.lo == 0)).all()  # cuts fall on block boundaries
        for p, a, b in zip(part.piece.tolist(), part.lo.tolist(), part.hi.tolist(), strict=True):
            seen[base[p] + a : base[p] + b] += 1
        whole = (part.lo == 0) & (part.hi == np.array(rows)[part.piece])
        assert (~whole).sum() <= 2  # whole pieces, and at most two cut ones: one request each
    assert (seen == 1).all()
    sizes = [p.rows for p in parts]
    assert max(sizes) - min(sizes) <= 2 * block  # each cut is rounded to a block boundary


def test_dealing_spreads_each_takers_pieces_over_the_whole_dataset():
    share = whole_share(np.full(400, 10))
    for q in range(8):
        part = deal(share, 8, q, 1, np.random.default_rng(0))
        # one piece out of every 8 consecutive ones: the share spans the dataset evenly
        assert np.array_equal(np.sort(part.piece) // 8, np.arange(50))


@given(n=st.integers(1, 300), k=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_each_resident_group_takes_one_part_from_every_stratum(n, k, seed):
    g = groups(n, k, np.random.default_rng(seed))
    k = min(k, n)
    bounds = np.linspace(0, n, k + 1).round().astype(int)
    stratum = np.searchsorted(bounds, np.arange(n), side="right") - 1
    assert np.bincount(g).max() <= k
    for group in np.unique(g):
        assert len(np.unique(stratum[g == group])) == (g == group).sum()  # no stratum twice in a group
    assert np.bincount(g).max() - np.bincount(g).min() <= 1  # groups as large as one another


@given(rows=st.lists(st.integers(1, 120), min_size=1, max_size=25), k=st.integers(1, 6), block=st.integers(1, 9),
       pool=st.integers(1, 300), seed=st.integers(0, 999))
def test_a_group_plan_reads_its_share_once_in_windows_of_one_group(rows, k, block, pool, seed):
    share = deal(whole_share(np.array(rows)), 2, 1, block, np.random.default_rng(seed))
    plan = GroupPlan(share, groups(len(share), k, np.random.default_rng(seed)), block, max(pool, block), seed=(seed,))
    base = np.concatenate([[0], np.cumsum(rows)])
    seen = []
    for w in range(plan.n_windows):
        shard, start = plan.window(w)
        n = np.minimum(block, share.hi[np.searchsorted(share.piece, shard)] - start)
        assert n.sum() <= max(pool, block)  # a window fits its pool
        assert len({int(plan.group[np.searchsorted(share.piece, x)]) for x in shard.tolist()}) <= 1
        ids = np.concatenate([base[s] + np.arange(a, a + m) for s, a, m in zip(shard, start, n, strict=True)] or [[]])
        seen.append(ids.astype(np.int64))
        # every row's window is found again from its address (what a resumed state's carry is checked with)
        piece = np.searchsorted(base, ids, side="right") - 1
        assert (plan.window_of(piece, ids - base[piece]) == w).all()
    got = np.sort(np.concatenate(seen or [np.zeros(0, np.int64)]))
    want = np.sort(np.concatenate([base[p] + np.arange(a, b) for p, a, b in zip(share.piece, share.lo, share.hi,
                                                                                 strict=True)]))
    np.testing.assert_array_equal(got, want)


def test_the_plan_of_a_pass_stays_small_at_ten_billion_stored_tokens():
    """Reader bookkeeping is a few integers per piece, and one group's blocks: flat in the stored rows."""
    import tracemalloc

    from lmprobe.stream.engine import Engine

    class Rows:  # 10^10 rows of 4096 bfloat16 (80 TB) in 64 MiB shard files: 1.2 M shards, one piece each
        n_sites, dim, dtype = 1, 4096, "bfloat16"
        shard_rows = np.full(1_220_704, 8192, dtype=np.int64)
        shard_rows[-1] = 10**10 - 8192 * (len(shard_rows) - 1)

    tracemalloc.start()
    engine = Engine(Rows(), 4096, seed=0, shuffle=True, rank=3, world=64, memory=2**30, drop_last=False)
    engine.set_resident(20, 20 * 8192)
    plan = engine.pass_plan(0)
    plan.window(0), plan.window(plan.n_windows - 1)
    assert engine.count(0) == pytest.approx(10**10 / 64, rel=1e-4)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 256 * 2**20, peak


def test_windows_stay_small_and_a_fresh_reader_reuses_warm_pool_buffers(tmp_path, rng, monkeypatch):
    """A pass recycles two small pool buffers (not one the size of a small dataset), and a fresh
    reader in the same process takes the buffers the last pass left, whose pages are warm (docs/performance.md)."""
    import lmprobe.stream.engine as engine

    monkeypatch.setattr(engine, "POOL_BYTES", 16 * 1024, raising=False)
    monkeypatch.setattr(engine, "_SPARE_POOLS", [], raising=False)
    src = write_dataset(tmp_path / "ds", rng, n=2000, layers=(0,), dim=16, shard_size="16KiB")  # 125 KiB
    seen: list[list[int]] = [[], []]
    gather = engine.Engine.gather

    def recording(self, shard, rows, lead=0, buffer=None, threads=1):
        pool = gather(self, shard, rows, lead, buffer, threads)
        base = pool.base if pool.base is not None else pool
        seen[which].append(id(base))
        assert base.nbytes <= 16 * 1024 + 16 * 16 * 4 * 2  # a pool of at most POOL_BYTES, and a carried batch
        keep.append(base)
        return pool

    keep: list[np.ndarray] = []
    monkeypatch.setattr(engine.Engine, "gather", recording)
    which = 0
    first = np.concatenate(list(ShardStream(tmp_path / "ds", 0, 16, seed=1, memory="1MiB")))
    which = 1
    second = np.concatenate(list(ShardStream(tmp_path / "ds", 0, 16, seed=1, memory="1MiB")))
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(np.sort(first, axis=0), np.sort(src["hidden"][0], axis=0))
    assert len(seen[0]) >= 8 and len(seen[1]) >= 8  # many windows each
    assert len(set(seen[0]) | set(seen[1])) <= 2  # two buffers in all: the fresh reader took the warm ones


# ------------------------------------------------------------------ dtypes: bfloat16 as stored, float32 converted


def _shift_formula(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits as float32, by the formula test_datapath.py checks the conversion against."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_stream_yields_bfloat16_as_stored_and_float32_converted(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=300, layers=(0, 1), dim=64, dtype="bfloat16", shard_size="8KiB")
    bits = float32_to_bfloat16_bits(src["hidden"][1])
    f32 = list(ShardStream(tmp_path / "ds", 1, 64, seed=3, memory="256KiB"))
    b16 = list(ShardStream(tmp_path / "ds", 1, 64, seed=3, memory="256KiB", dtype="bfloat16"))
    assert all(isinstance(b, np.ndarray) and b.dtype == np.float32 for b in f32)
    assert all(isinstance(b, torch.Tensor) and b.dtype == torch.bfloat16 for b in b16)
    got_bits = np.concatenate([b.view(torch.int16).numpy().view(np.uint16) for b in b16])
    # every stored vector once, as stored
    assert sorted(map(bytes, got_bits)) == sorted(map(bytes, bits))
    got_f32 = np.concatenate(f32)
    assert sorted(map(bytes, got_f32)) == sorted(map(bytes, _shift_formula(bits)))
    # a bfloat16 pool holds twice the rows of a float32 one in the same memory
    s16 = ShardStream(tmp_path / "ds", 1, 64, memory="256KiB", dtype="bfloat16")
    assert s16.engine.pool_rows > ShardStream(tmp_path / "ds", 1, 64, memory="256KiB").engine.pool_rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stream_recycles_its_pools_and_the_batches_kept_stay_intact(tmp_path, rng, monkeypatch, dtype):
    """A pass reads its windows into two pool buffers in turn (a new buffer costs as much as the read: its pages
    fault in), while every batch the caller keeps holds its own rows: all stored vectors, each once."""
    from lmprobe.stream.engine import Engine

    src = write_dataset(tmp_path / "ds", rng, n=400, layers=(0,), dim=16, dtype=dtype, shard_size="2KiB")
    stored = src["hidden"][0]
    if dtype == "bfloat16":
        stored = _shift_formula(float32_to_bfloat16_bits(stored))
    buffers = []
    gather = Engine.gather

    def recording(self, *args, **kwargs):
        pool = gather(self, *args, **kwargs)
        buffers.append(pool.base if pool.base is not None else pool)  # kept alive: identities stay distinct
        return pool

    monkeypatch.setattr(Engine, "gather", recording)
    stream = ShardStream(tmp_path / "ds", 0, 16, seed=2, memory="8KiB")
    kept = list(stream)  # every batch held until the end of the pass
    windows = stream.engine.windows(*stream.engine.blocks(0))
    assert len(windows) >= 6
    assert len({id(b) for b in buffers}) <= 3  # the first window's, and two in turn (not one per window)
    got = np.concatenate(kept)
    assert sorted(map(bytes, got)) == sorted(map(bytes, stored.astype(np.float32)))
    again = np.concatenate(list(ShardStream(tmp_path / "ds", 0, 16, seed=2, memory="8KiB")))
    np.testing.assert_array_equal(again, got)  # the same pass again: same batches in the same order


def test_stream_casts_large_bfloat16_batches_in_two_halves_exactly(tmp_path, rng, monkeypatch):
    """A batch large enough to be split is gathered and cast in two halves on the two converter threads: the
    float32 batches hold every stored vector once, each equal to the shift formula of its bits."""
    import lmprobe.stream.engine as engine

    monkeypatch.setattr(engine, "_CONVERT_ROWS", 4)  # steps of 4 x 4096 / 256 = 64 rows: batches of 300 split
    calls = []
    gather_cast = engine._gather_cast
    monkeypatch.setattr(engine, "_gather_cast", lambda *a: calls.append(len(a[1])) or gather_cast(*a))
    src = write_dataset(tmp_path / "ds", rng, n=1000, layers=(0,), dim=256, dtype="bfloat16", shard_size="64KiB")
    want = _shift_formula(float32_to_bfloat16_bits(src["hidden"][0]))
    got = np.concatenate(list(ShardStream(tmp_path / "ds", 0, 300, seed=1, memory="4MiB")))
    assert sorted(map(bytes, got)) == sorted(map(bytes, want))
    assert calls.count(150) >= 6  # full batches went as two halves of 150 rows


def test_stream_bfloat16_with_normalisation_and_several_sites(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=120, layers=(0, 1), dim=16, dtype="bfloat16", statistics=True)
    f32 = np.concatenate(list(ShardStream(tmp_path / "ds", batch_size=32, layers=[0, 1], seed=1,
                                          normalize="standardize", memory="64KiB")))
    b16 = list(ShardStream(tmp_path / "ds", batch_size=32, layers=[0, 1], seed=1, normalize="standardize",
                           memory="64KiB", dtype="bfloat16"))
    assert b16[0].shape == (32, 2, 16) and b16[0].dtype == torch.bfloat16
    expect = torch.from_numpy(f32).to(torch.bfloat16)
    got = torch.cat(b16)
    assert got.shape == expect.shape
    # same multiset of normalised rows (the pools differ in size, so the order may too)
    key = lambda t: sorted(map(bytes, t.view(torch.int16).reshape(len(t), -1).numpy()))  # noqa: E731
    assert key(got) == key(expect)


def test_stream_pin_memory_without_cuda_warns_and_yields_tensors(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=40, layers=(0,), dim=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = ShardStream(tmp_path / "ds", 0, 16, pin_memory=True, memory="64KiB")
    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        assert all(b.is_pinned() for b in stream)
        return
    assert any("pin_memory=True needs a CUDA device" in str(w.message) for w in caught)
    batches = list(stream)
    assert all(isinstance(b, torch.Tensor) and b.dtype == torch.float32 for b in batches)
    assert sum(len(b) for b in batches) == 40


def test_stream_rejects_an_unknown_dtype(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=10, layers=(0,), dim=4)
    with pytest.raises(InvalidArgumentError, match="dtype must be 'float32' or 'bfloat16'"):
        ShardStream(tmp_path / "ds", 0, 4, dtype="float16")
