"""The data path at GPU rate: device statistics, hashing off the critical path, bfloat16 at memory speed.

The training reader's bfloat16 and float32 batches are tested with the reader, in test_stream.py."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from support.datasets import PROMPTS, write_dataset

import lmprobe
from lmprobe.errors import InvalidArgumentError
from lmprobe.format import shards as shards_module
from lmprobe.format.statistics import RunningStats, batch_statistics
from lmprobe.format.values import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from lmprobe.format.writer import DatasetWriter

# ----------------------------------------------------------------------------- bfloat16 -> float32


def _shift_formula(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_bfloat16_conversion_is_bit_exact_on_every_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every bfloat16, NaN payloads included
    want = _shift_formula(bits).view(np.uint32)
    assert bfloat16_bits_to_float32(bits).view(np.uint32).tolist() == want.tolist()  # torch's vectorised cast
    small = [bfloat16_bits_to_float32(c) for c in np.split(bits, 64)]  # below the threshold: numpy's shift
    assert np.concatenate(small).view(np.uint32).tolist() == want.tolist()
    rows = np.tile(bits, (256, 1))  # large enough to be split between the converter threads
    assert (bfloat16_bits_to_float32(rows).view(np.uint32) == np.tile(want, (256, 1))).all()
    # into a strided view of a bigger buffer (a pool's site, an export block), both paths
    for n_rows in (2, 1 << 10):
        b = np.resize(bits, (n_rows, 64)).copy()
        out = np.full((n_rows, 3, 64), 7.0, dtype=np.float32)
        bfloat16_bits_to_float32(b, out=out[:, 1])
        assert out[:, 1].view(np.uint32).tolist() == _shift_formula(b).view(np.uint32).tolist()
        assert (out[:, [0, 2]] == 7.0).all()


def test_bfloat16_conversion_rejects_the_wrong_input():
    with pytest.raises(TypeError, match="uint16"):
        bfloat16_bits_to_float32(np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="float32 of shape"):
        bfloat16_bits_to_float32(np.zeros(3, dtype=np.uint16), out=np.zeros(4, dtype=np.float32))


# ----------------------------------------------------------------------------- statistics


def _reference(x64: np.ndarray) -> dict:
    return {"count": len(x64), "mean": x64.mean(0), "std": x64.std(0),
            "mean_norm": float(np.linalg.norm(x64, axis=1).mean())}


def _assert_close(got: RunningStats, want: dict) -> None:
    r = got.result()
    assert r["count"] == want["count"]
    np.testing.assert_allclose(r["mean"], want["mean"], rtol=1e-6)
    np.testing.assert_allclose(r["std"], want["std"], rtol=1e-6)
    assert r["mean_norm"] == pytest.approx(want["mean_norm"], rel=1e-6)


def _offset_data(rng, n=1500, dim=2048, offset=300.0):
    """A large mean offset over a small spread: what naive float32 sums of squares get wrong."""
    return (rng.normal(size=(n, dim)) + offset + rng.normal(size=dim) * 50).astype(np.float32)


def test_naive_float32_sums_of_squares_fail_on_this_data(rng):
    x = _offset_data(rng)
    t = torch.from_numpy(x)
    n = len(x)
    naive_var = (t.square().sum(0) / n - (t.sum(0) / n) ** 2).clamp(min=0).numpy()
    err = np.abs(np.sqrt(naive_var) - x.astype(np.float64).std(0)) / x.astype(np.float64).std(0)
    assert err.max() > 1e-3  # the reason for centring each chunk: this data is a real test


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_batch_statistics_equal_a_float64_reference(rng, dtype):
    x = _offset_data(rng)  # 1500 rows of 2048: three chunks of 512 rows on a CPU
    if dtype == "bfloat16":
        bits = float32_to_bfloat16_bits(x)
        stored = _shift_formula(bits).astype(np.float64)
        _assert_close(batch_statistics(bits, bfloat16_bits=True), _reference(stored))
        tensor = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        _assert_close(batch_statistics(tensor), _reference(stored))  # a torch tensor, as a backend hands it
    else:
        a = x.astype(dtype)
        _assert_close(batch_statistics(a), _reference(a.astype(np.float64)))
        _assert_close(batch_statistics(torch.from_numpy(a)), _reference(a.astype(np.float64)))


def test_statistics_merge_across_batches_and_chunks(rng):
    x = _offset_data(rng, n=3001, dim=1024)
    s = RunningStats.empty(1024)
    for part in np.split(x, [1, 2, 1000, 1001, 2500]):  # uneven batches, one of a single row
        s = s.merge(batch_statistics(part))
    _assert_close(s, _reference(x.astype(np.float64)))
    assert batch_statistics(x[:0]).count == 0


def test_writer_statistics_equal_the_reference_in_bfloat16(tmp_path, rng):
    x = _offset_data(rng, n=600, dim=1024)
    with DatasetWriter(tmp_path / "ds", layers=[0], dim=1024, model_name="m", dtype="bfloat16",
                       statistics=True) as w:
        for a in range(0, 600, 150):
            w.add_batch(texts=["t"] * 150, num_tokens=[1] * 150, hidden={0: x[a : a + 150]})
    ds = lmprobe.load(tmp_path / "ds")
    stored = ds.hidden(0).astype(np.float64)
    got = ds.statistics(0)
    want = _reference(stored)
    np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-6)
    np.testing.assert_allclose(got["std"], want["std"], rtol=1e-6)
    assert got["mean_norm"] == pytest.approx(want["mean_norm"], rel=1e-6)


def test_writer_takes_partial_statistics_and_checks_them(tmp_path, rng):
    x = rng.normal(size=(8, 4)).astype(np.float32)
    with DatasetWriter(tmp_path / "ds", layers=[0], dim=4, model_name="m", statistics=True) as w:
        with pytest.raises(InvalidArgumentError, match="8 stored vectors"):
            w.add_batch(texts=["t"] * 8, num_tokens=[1] * 8, hidden={0: x}, statistics={0: batch_statistics(x[:5])})
        assert w.num_prompts == 0  # refused before any byte was written
        w.add_batch(texts=["t"] * 8, num_tokens=[1] * 8, hidden={0: x}, statistics={0: batch_statistics(x)})
    ds = lmprobe.load(tmp_path / "ds")
    assert ds.num_prompts == 8
    _assert_close(RunningStats.from_result(ds.statistics(0)), _reference(x.astype(np.float64)))
    with DatasetWriter(tmp_path / "off", layers=[0], dim=4, model_name="m") as w:
        with pytest.raises(InvalidArgumentError, match="statistics=False"):
            w.add_batch(texts=["t"], num_tokens=[1], hidden={0: x[:1]}, statistics={0: batch_statistics(x[:1])})


def test_extraction_statistics_come_from_the_backend(llama_dir, tmp_path, monkeypatch):
    """The transformers backend computes the partials in torch (here on the CPU device); the writer only merges."""
    def host_statistics(*_a, **_k):
        raise AssertionError("the writer computed statistics that the backend should have handed it")

    monkeypatch.setattr(RunningStats, "of", classmethod(host_statistics))
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "ds", layers="1,3", storage="full_sequence",
                         dtype="bfloat16", batch_size=3, quiet=True)
    for layer in (1, 3):
        stored = np.concatenate([ds.token_hidden(i, layer) for i in range(ds.num_prompts)]).astype(np.float64)
        got, want = ds.statistics(layer), _reference(stored)
        assert got["count"] == want["count"]
        np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-6, atol=1e-6 * float(want["std"].max()))
        np.testing.assert_allclose(got["std"], want["std"], rtol=1e-6)
        assert got["mean_norm"] == pytest.approx(want["mean_norm"], rel=1e-6)


# ----------------------------------------------------------------------------- hashing


def _sha256sum(paths) -> dict[str, str]:
    out = subprocess.run(["sha256sum", *map(str, paths)], check=True, capture_output=True, text=True).stdout
    return {line.split()[1]: line.split()[0] for line in out.splitlines()}


def _recorded_hashes(root) -> dict[str, str]:
    """Every file's sha256 as the dataset's metadata records it (shards, logits, statistics)."""
    return {str(root / f.rel): f.sha256 for f in lmprobe.load(root).meta.files()}


def test_recorded_hashes_equal_sha256sum_of_the_finished_files(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=40, layers=(0, 3), dim=8, storage="full_sequence", shard_size="256B",
                  logits_topk=3, statistics=True)
    recorded = _recorded_hashes(tmp_path / "ds")
    shard_files = sorted((tmp_path / "ds").rglob("*.safetensors"))
    assert len(shard_files) > 10 and set(map(str, shard_files)) == set(recorded)
    assert _sha256sum(shard_files) == recorded


def test_checkpoints_do_not_wait_for_hashes_and_a_resume_rehashes_only_those(tmp_path, rng, monkeypatch):
    gate = threading.Event()
    hashed = []
    real = shards_module.sha256_file

    def held_back(f):  # the hasher is slower than the writer: nothing finishes until the gate opens
        gate.wait(30)
        hashed.append(f.name)
        return real(f)

    monkeypatch.setattr(shards_module, "sha256_file", held_back)
    x = rng.normal(size=(60, 8)).astype(np.float32)
    out = tmp_path / "ds"
    w = DatasetWriter(out, layers=[0, 1], dim=8, model_name="m", shard_size=8 * 4 * 10)  # 10 rows a shard
    w.add_batch(texts=["t"] * 25, num_tokens=[1] * 25, hidden={0: x[:25], 1: x[:25]})
    w.checkpoint()  # returns although two shards per layer are still waiting for their hash
    state = json.loads((out / ".lmprobe-staging" / "state.json").read_text())
    closed = [f for d in state["streams"]["last"]["closed"] for f in d["files"].values()]
    assert len(closed) == 4 and not any("sha256" in f for f in closed)
    gate.set()
    w.abort()  # a crash now: the checkpoint on disk lacks these hashes
    hashed.clear()
    monkeypatch.setattr(shards_module, "sha256_file", lambda f: hashed.append(f.name) or real(f))
    with DatasetWriter(out, layers=[0, 1], dim=8, model_name="m", shard_size=8 * 4 * 10) as w:
        assert w.num_prompts == 25
        w.add_batch(texts=["t"] * 35, num_tokens=[1] * 35, hidden={0: x[25:], 1: x[25:]})
    # the four closed shards whose hash the checkpoint lacked, then the four new shards per layer
    assert len(hashed) == 4 + 8
    assert len(set(hashed)) == 12
    recorded = _recorded_hashes(out)
    assert _sha256sum(sorted(recorded)) == recorded
    np.testing.assert_array_equal(lmprobe.load(out).hidden(1), x)


# ----------------------------------------------------------------------------- bfloat16 reads


def test_bfloat16_reads_convert_piece_by_piece_exactly(tmp_path, rng, monkeypatch):
    """ds.hidden / token_hidden of bfloat16 read small reads whole and larger ones in pieces, converted while
    the next piece is read: across pieces, shards and a scattered row order the values are the stored ones."""
    import torch

    import lmprobe.format.gather as gather

    src = write_dataset(tmp_path / "ds", rng, n=40, layers=(0,), dim=8, dtype="bfloat16", shard_size="128B",
                        storage="full_sequence")
    ds = lmprobe.load(tmp_path / "ds")
    whole = ds.hidden(0, as_torch=True).float().numpy()  # as stored, no conversion path
    want_tokens = [ds.token_hidden(i, 0, as_torch=True).float().numpy() for i in range(ds.num_prompts)]
    rows = rng.permutation(ds.num_prompts)  # scattered: groups out of index order
    for whole_values in (1 << 23, 0):  # small reads read whole, then cast; larger ones piece by piece
        monkeypatch.setattr(gather, "_WHOLE_VALUES", whole_values)
        monkeypatch.setattr(gather, "_PIECE_VALUES", 3 * 8)  # three rows a piece
        np.testing.assert_array_equal(ds.hidden(0), whole)
        np.testing.assert_array_equal(ds.hidden(0, rows=rows), whole[rows])
        for i in range(ds.num_prompts):
            np.testing.assert_array_equal(ds.token_hidden(i, 0), want_tokens[i])
    bf = torch.from_numpy(src["hidden"][0]).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.concatenate([ds.token_hidden(i, 0) for i in range(ds.num_prompts)]), bf)


@pytest.mark.parametrize("shift", [10**6, 2])
def test_bfloat16_prompt_reads_refuse_rows_past_the_shard(tmp_path, rng, shift):
    """A prompt's tokens are one run of rows read with one open file; a damaged index whose run starts, or
    ends, past the shard's rows gets a one-line FormatError, not a short read or a traceback."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmprobe.errors import FormatError
    from lmprobe.format.spec import INDEX_PATH

    write_dataset(tmp_path / "ds", rng, n=6, layers=(0,), dim=8, dtype="bfloat16", storage="full_sequence",
                  min_tokens=4)
    ds = lmprobe.load(tmp_path / "ds")
    last = ds.num_prompts - 1
    ids, offs, _ = ds.shards.token_addresses([last])
    index = tmp_path / "ds" / INDEX_PATH
    table = pq.read_table(index)
    col = table.column("token_shard_offsets").to_pylist()
    col[last] = [o + shift for o in col[last]]  # still consecutive: one run, now past the end of the shard
    table = table.set_column(table.column_names.index("token_shard_offsets"), "token_shard_offsets",
                             pa.array(col, table.schema.field("token_shard_offsets").type))
    pq.write_table(table.replace_schema_metadata(table.schema.metadata), index)
    with pytest.raises(FormatError, match="out of range"):
        lmprobe.load(tmp_path / "ds").token_hidden(last, 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_saev_writes_chunks_in_order_while_reading_the_next(tmp_path, rng, monkeypatch, dtype):
    """export-saev reads a chunk into one block while the other is converted and written: with chunks of one
    example, every shard is the same bytes as with one chunk per shard."""
    import lmprobe.saev as saev
    import lmprobe.saev.export as saev_export

    write_dataset(tmp_path / "ds", rng, n=30, layers=(0, 1), dim=8, dtype=dtype, shard_size="256B",
                  storage="full_sequence", min_tokens=3)
    whole = saev.export_saev(tmp_path / "ds", tmp_path / "a", layers=[0, 1], context_len=4, quiet=True,
                             patches_per_shard=4 * 2 * 5)
    monkeypatch.setattr(saev_export, "_CHUNK_BYTES", 1)  # one example a chunk: both blocks in turn, many writes a shard
    pieces = saev.export_saev(tmp_path / "ds", tmp_path / "b", layers=[0, 1], context_len=4, quiet=True,
                              patches_per_shard=4 * 2 * 5)
    names = sorted(p.name for p in whole.iterdir())
    assert names == sorted(p.name for p in pieces.iterdir()) and sum(n.startswith("acts") for n in names) > 1
    for name in names:
        assert (whole / name).read_bytes() == (pieces / name).read_bytes(), name
    vectors = np.fromfile(pieces / "acts000000.bin", dtype=np.float32).reshape(-1, 2, 4, 8)
    ds = lmprobe.load(tmp_path / "ds")
    tokens = np.concatenate([ds.token_hidden(i, 0) for i in range(3)])  # windows run across prompts
    np.testing.assert_array_equal(vectors[0, 0], tokens[:4])


def test_export_saev_converts_a_bfloat16_chunk_while_the_previous_one_is_written(tmp_path, rng, monkeypatch):
    """The conversion of chunk k does not wait for the write of chunk k - 1: it starts as soon as k is read."""
    import lmprobe.saev as saev
    import lmprobe.saev.export as saev_export

    write_dataset(tmp_path / "ds", rng, n=12, layers=(0,), dim=8, dtype="bfloat16", storage="full_sequence",
                  min_tokens=4)
    monkeypatch.setattr(saev_export, "_CHUNK_BYTES", 1)  # one example a chunk
    events, first_write_going, lock = [], threading.Event(), threading.Lock()
    convert, write = saev_export.bfloat16_to_float32_later, saev_export._write_chunk

    def logged_convert(bits, out):
        with lock:
            events.append("convert")
        return convert(bits, out)

    def slow_write(f, block, conversion, n):
        with lock:
            events.append("write start")
        first_write_going.set()
        time.sleep(0.1)  # a slow disk: the next chunk is read and converted meanwhile
        write(f, block, conversion, n)
        with lock:
            events.append("write end")

    monkeypatch.setattr(saev_export, "bfloat16_to_float32_later", logged_convert)
    monkeypatch.setattr(saev_export, "_write_chunk", slow_write)
    out = saev.export_saev(tmp_path / "ds", tmp_path / "s", layers=[0], context_len=4, quiet=True)
    assert first_write_going.is_set()
    # the second chunk's conversion comes before the first chunk's write ends
    assert events.index("write end") > [i for i, e in enumerate(events) if e == "convert"][1], events
    want = np.concatenate([lmprobe.load(tmp_path / "ds").token_hidden(i, 0) for i in range(12)])
    got = np.fromfile(out / "acts000000.bin", dtype=np.float32).reshape(-1, 8)
    np.testing.assert_array_equal(got[: len(want) // 4 * 4], want[: len(want) // 4 * 4])
