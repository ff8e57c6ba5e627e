"""int8 datasets through every reader above the format layer: extraction, ShardStream (float32 and
bfloat16 out), export-saev, export-saelens, merge, probes and the report. Each reads the decoded values
``lmprobe.load`` returns."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.artefacts import read_cache
from support.datasets import write_dataset

import lmprobe
from lmprobe.saev import export_saev
from lmprobe.stream import ShardStream

PROMPTS = [{"text": t, "label": i % 2} for i, t in enumerate([
    "The film was great.", "The service was terrible.", "In the end our hotel was wonderful.",
    "Honestly, the trip was rude and I hated it.", "Everyone said the game was superb.",
    "The coffee was cold.", "I loved the book.", "A dull and boring evening."])]


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    """lmprobe-tiny over the same prompts, stored as float32 and as int8."""
    root = tmp_path_factory.mktemp("int8")
    out = {}
    for dtype in ("float32", "int8"):
        out[dtype] = lmprobe.extract("lmprobe-tiny", PROMPTS, out=root / dtype, layers="0,-1", storage="full_sequence",
                                     dtype=dtype, token_ids=True, shard_size="2KB", batch_size=3, quiet=True)
    return out


def test_extract_int8_stores_half_the_bytes_within_half_a_step(extracted):
    f32, q = extracted["float32"], extracted["int8"]
    assert q.dtype == "int8" and q.meta.raw["format_version"] == "3.0"
    for layer in f32.layers:
        a, b = f32.hidden(layer), q.hidden(layer)
        step = np.abs(a).max(axis=1) / 127
        assert np.all(np.abs(a - b) <= 0.51 * step[:, None] + 1e-6)
        for i in (0, 5):
            ta, tb = f32.token_hidden(i, layer), q.token_hidden(i, layer)
            assert np.all(np.abs(ta - tb) <= 0.51 * np.abs(ta).max(axis=1, keepdims=True) / 127 + 1e-6)
    # the shards: a byte a value and a float32 scale a row, against 4 bytes a value
    dim = f32.dim
    assert q.meta.hidden.row_bytes == dim + 4 and f32.meta.hidden.row_bytes == 4 * dim
    stats = q.statistics(f32.layers[-1])  # of the decoded values
    ids, offs, _ = q.shards.token_addresses()
    shard, off = np.concatenate([q.column("shard_index"), ids]), np.concatenate([q.column("row_offset"), offs])
    uniq = np.unique(np.stack([shard, off], axis=1), axis=0)
    rows = q.shards.read_hidden_rows(f32.layers[-1], uniq[:, 0], uniq[:, 1])
    np.testing.assert_allclose(stats["mean"], rows.astype(np.float64).mean(axis=0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_shardstream_reads_int8_decoded(tmp_path, rng, out_dtype):
    src = write_dataset(tmp_path / "ds", rng, n=40, layers=(0, 3), dim=6, storage="full_sequence", dtype="int8",
                        shard_size=120)
    ds = lmprobe.load(tmp_path / "ds")
    s = ShardStream(ds, layer=3, batch_size=16, dtype=out_dtype, seed=1)
    got = np.concatenate([np.asarray(b.float() if hasattr(b, "float") else b) for b in s])
    total = int(src["n_tok"].sum())
    assert got.shape == (total, 6)
    ids, offs, _ = ds.shards.token_addresses()
    want = ds.shards.read_hidden_rows(3, ids, offs)
    if out_dtype == "bfloat16":
        import torch

        want = torch.from_numpy(want).bfloat16().float().numpy()
    key = np.lexsort(got.T)
    np.testing.assert_array_equal(got[key], want[np.lexsort(want.T)])
    multi = ShardStream(ds, layers=[0, 3], batch_size=8, shuffle=False)
    first = next(iter(multi))
    assert first.shape == (8, 2, 6) and first.dtype == np.float32


@pytest.mark.parametrize("piece", [None, "256B"])  # shards read whole; shards cut into range pieces (codes + scales)
def test_shardstream_reads_int8_from_the_hub_decoded(hub, tmp_path, rng, fresh_hf_cache, piece):
    import uuid

    write_dataset(tmp_path / "ds", rng, n=40, layers=(0, 3), dim=6, storage="full_sequence", dtype="int8",
                  shard_size=300)
    repo = f"tester/int8-{uuid.uuid4().hex[:8]}"
    lmprobe.push_to_hub(tmp_path / "ds", repo, quiet=True)
    local = lmprobe.load(tmp_path / "ds")
    ids, offs, _ = local.shards.token_addresses()
    want = {layer: local.shards.read_hidden_rows(layer, ids, offs) for layer in (0, 3)}
    kw = {"piece": piece} if piece else {}
    s = ShardStream(f"hf://datasets/{repo}", layers=[0, 3], batch_size=16, seed=2, cache="64KiB", memory="1MiB", **kw)
    if piece:
        assert s.engine.source.pieces.n > len(local.meta.hidden.shards)  # range pieces, not whole files
    got = np.concatenate(list(s))
    s.close()
    assert got.shape == (len(want[0]), 2, 6)
    for i, layer in enumerate((0, 3)):
        a, b = got[:, i], want[layer]
        np.testing.assert_array_equal(a[np.lexsort(a.T)], b[np.lexsort(b.T)])


def test_export_saev_writes_decoded_float32(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=20, layers=(1, 4), dim=6, storage="full_sequence", dtype="int8",
                        shard_size=150)
    ds = lmprobe.load(tmp_path / "ds")
    T = 5
    out = export_saev(ds, tmp_path / "dump", context_len=T, patches_per_shard=4 * T * 2, quiet=True)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["dtype"] == "float32"
    stream = {layer: np.concatenate([ds.token_hidden(i, layer) for i in range(20)]) for layer in (1, 4)}
    for ex in (0, 3, meta["n_ex"] - 1):
        shard_idx, ex_in = divmod(ex, 4)
        acts = np.fromfile(out / f"acts{shard_idx:06d}.bin", dtype="<f4").reshape(-1, 2, T, 6)
        for li, layer in enumerate((1, 4)):
            np.testing.assert_array_equal(acts[ex_in, li], stream[layer][ex * T : ex * T + T])
    assert src["n_tok"].sum() >= meta["n_ex"] * T


def test_export_saelens_writes_decoded_float32(tmp_path, rng):
    from lmprobe.saelens import export_saelens

    write_dataset(tmp_path / "ds", rng, n=10, layers=(2,), dim=4, storage="full_sequence", dtype="int8", min_tokens=4,
                  max_tokens=4)
    ds = lmprobe.load(tmp_path / "ds")
    want = np.stack([ds.token_hidden(i, 2) for i in range(10)])
    cache = export_saelens(ds, tmp_path / "cache", hookpoint="resid_post", quiet=True)
    _, batches = read_cache(cache)
    col = [c for c in batches[0].schema.names if c != "token_ids"][0]
    got = np.concatenate([np.asarray(b.column(col).to_pylist(), dtype=np.float32) for b in batches])
    np.testing.assert_array_equal(got, want)


def test_merge_probe_and_report_on_int8(tmp_path, rng, extracted):
    parts = []
    for k in range(2):
        write_dataset(tmp_path / f"p{k}", rng, n=9, layers=(0, 2), dim=4, dtype="int8", shard_size=40)
        parts.append(lmprobe.load(tmp_path / f"p{k}"))
    merged = lmprobe.merge(parts, tmp_path / "merged")
    assert merged.dtype == "int8" and merged.meta.raw["format_version"] == "3.0"
    np.testing.assert_array_equal(merged.hidden(2), np.concatenate([p.hidden(2) for p in parts]))
    assert lmprobe.validate(tmp_path / "merged").ok

    from lmprobe.probe import train_probe

    q = extracted["int8"]
    probe = train_probe(q, layer=q.layers[-1])
    assert probe.predict(q.hidden(q.layers[-1])).shape == (len(PROMPTS),)
    index = lmprobe.report(q, tmp_path / "report", prompts="1", sample=3, quiet=True)
    assert "int8" in index.read_text()


def test_feature_pages_on_int8_score_the_decoded_vectors(tmp_path, extracted):
    from safetensors.numpy import load_file
    from support.artefacts import random_dictionary

    q = extracted["int8"]
    layer = q.layers[-1]
    W, b = random_dictionary(q, tmp_path / "sae", layer)
    out = lmprobe.features(q, tmp_path / "sae", "d", layer, tmp_path / "f", top=3, quiet=True)
    t = load_file(out / "features.safetensors")
    X = np.concatenate([q.token_hidden(p, layer) for p in range(q.num_prompts)])
    np.testing.assert_allclose(t["frequency"], ((X @ W.T + b) > 0).mean(axis=0))


@pytest.mark.parametrize("where", ["local", "hub"])
def test_two_threads_reading_one_int8_shard_see_its_codes_and_scales(hub, tmp_path, rng, fresh_hf_cache, monkeypatch,
                                                                     where):
    """The first window of a pass is read on two threads; both may open the same shard. The second must never see
    the codes mapped without their scales (a KeyError in CI, one run in about thirty)."""
    import threading
    import time
    import uuid

    write_dataset(tmp_path / "ds", rng, n=10, layers=(0,), dim=6, storage="full_sequence", dtype="int8")
    url = tmp_path / "ds"
    if where == "hub":
        repo = f"tester/int8-race-{uuid.uuid4().hex[:8]}"
        lmprobe.push_to_hub(tmp_path / "ds", repo, quiet=True)
        url = f"hf://datasets/{repo}"
    s = ShardStream(url, layer=0, batch_size=4, seed=0)
    src = s.engine.source
    src.prepare([0])
    real = np.memmap

    def slow_memmap(*args, **kw):  # the scales are mapped last: widen the window between the two maps
        m = real(*args, **kw)
        if kw.get("dtype") is np.float32:
            time.sleep(0.2)
        return m

    monkeypatch.setattr(np, "memmap", slow_memmap)
    rows = np.arange(4)
    outs, errors = [np.empty((4, 6), np.float32) for _ in range(2)], []

    def read(out):
        try:
            src.read_rows(0, rows, 0, out)
        except Exception as e:  # noqa: BLE001 - the test reports what the thread raised
            errors.append(e)

    threads = [threading.Thread(target=read, args=(o,)) for o in outs]
    threads[0].start()
    time.sleep(0.05)
    threads[1].start()
    for t in threads:
        t.join()
    s.close()
    assert errors == []
    want = lmprobe.load(tmp_path / "ds").shards.read_hidden_rows(0, np.zeros(4, int), rows)
    for o in outs:
        np.testing.assert_array_equal(o, want)
