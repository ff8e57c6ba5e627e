"""Training from a remote dataset in a bounded cache: the Hub and S3 (local servers), budget, coverage, resume."""

from __future__ import annotations

import os
import threading
import time
import uuid

import numpy as np
import pytest
from conftest import write_dataset

import lmprobe
from lmprobe.errors import InvalidArgumentError, ObjectStoreError
from lmprobe.storage.cache import BoundedCache
from lmprobe.storage.cache import cache_root as stream_root
from lmprobe.storage.hub import HubFiles
from lmprobe.stream import Engine, RemoteRows, ShardStream

# ----------------------------------------------------------------------------- the cache on its own


class _SlowFiles:
    """A remote of fixed-size files; each download takes a moment, and the bytes on disk are sampled."""

    def __init__(self, sizes, cache_dir_of, fail=()):
        self.sizes, self.cache_dir_of, self.fail = sizes, cache_dir_of, set(fail)
        self.on_disk_max = 0
        self.lock = threading.Lock()
        self.order: list[str] = []

    def __str__(self):
        return "slow://files"

    def download(self, rel, dst):
        with self.lock:
            self.order.append(rel)
        if rel in self.fail:
            raise ConnectionError(f"{rel}: the link dropped")
        with open(dst, "wb") as f:
            for _ in range(4):
                f.write(b"\1" * (self.sizes[rel] // 4))
                f.flush()
                with self.lock:  # other workers' files come and go meanwhile: _du tolerates it
                    self.on_disk_max = max(self.on_disk_max, _du(self.cache_dir_of()))
                time.sleep(0.002)


def test_the_cache_never_holds_more_than_its_budget(tmp_path):
    sizes = {f"s{i}.bin": 1000 for i in range(40)}
    holder = {}
    files = _SlowFiles(sizes, lambda: holder["cache"].dir)
    cache = BoundedCache(files.download, budget=3500, sizes=sizes, workers=4, root=tmp_path)
    holder["cache"] = cache
    seq = [f"s{i}.bin" for i in range(40)]
    cache.schedule(seq)
    for rel in seq:  # the consumer: one file at a time, in order
        path = cache.get(rel)
        assert path.read_bytes() == b"\1" * 1000
        cache.release(rel)
        assert not path.exists()  # deleted as soon as nobody needs it
    # downloads in the order of need (four workers may start theirs a moment apart)
    assert sorted(files.order) == sorted(seq)
    assert max(abs(files.order.index(rel) - i) for i, rel in enumerate(seq)) < 4
    assert files.on_disk_max <= 3500 and cache.peak <= 3500
    assert cache.peak == 3000  # it did run ahead: three files at once
    cache.close()
    assert not cache.dir.exists()


def test_the_cache_hands_a_download_error_to_the_consumer_and_rejects_oversized_files(tmp_path):
    sizes = {"a": 12, "b": 12}
    cache = BoundedCache(_SlowFiles(sizes, lambda: tmp_path, fail={"b"}).download, budget=100, sizes=sizes,
                         root=tmp_path)
    cache.schedule(["a", "b"])
    assert cache.get("a").exists()
    with pytest.raises(ConnectionError, match="the link dropped"):
        cache.get("b")
    cache.close()
    with pytest.raises(InvalidArgumentError, match="cannot hold big"):
        BoundedCache(_SlowFiles({"big": 50}, lambda: tmp_path).download, budget=20, sizes={"big": 50}, root=tmp_path)


def test_remote_shuffle_takes_shards_a_group_at_a_time():
    class Rows:
        shard_rows = [100] * 12
        n_sites, dim, dtype = 1, 4, "float32"

    eng = Engine(Rows(), 10, seed=0, shuffle=True, rank=0, world=1, memory=10**6, drop_last=False, block_rows=5)
    eng.resident = 3
    shard, _ = eng.blocks(0)
    groups = [set(shard[i : i + 60].tolist()) for i in range(0, 240, 60)]  # 3 shards x 20 blocks per group
    assert all(len(g) == 3 for g in groups) and set().union(*groups) == set(range(12))
    eng.resident = None
    shard, _ = eng.blocks(0)
    assert len(set(shard[:60].tolist())) > 6  # the global shuffle mixes every shard from the start


# ----------------------------------------------------------------------------- from the Hub


def _push(hub, tmp_path, rng, n=60, shard_size="256B"):
    src = write_dataset(tmp_path / "ds", rng, n=n, layers=(0,), dim=4, storage="full_sequence",
                        shard_size=shard_size)
    repo = f"tester/remote-{uuid.uuid4().hex[:8]}"
    lmprobe.push_to_hub(tmp_path / "ds", repo, quiet=True)
    return src, f"hf://datasets/{repo}"


def _du(root) -> int:
    """Bytes of the files under ``root`` (files may come and go meanwhile: other downloads run)."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                pass
    return total


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMPROBE_CACHE", str(tmp_path / "lmprobe-cache"))


def _rows(batches):
    return np.sort(np.concatenate(batches), axis=0)


def test_hub_stream_in_a_bounded_cache(hub, tmp_path, rng, fresh_hf_cache, monkeypatch):
    src, url = _push(hub, tmp_path, rng)
    ds = lmprobe.load(url)
    sizes = [f.bytes for f in ds.meta.files() if f.rel.startswith("tensors/hidden")]
    budget = 4 * max(sizes)
    on_disk, ranges = [], []
    real, real_range = RemoteRows._download, HubFiles.read_range

    def watched(self, key, dst):  # the bytes on disk after every download, all readers' caches together
        real(self, key, dst)
        on_disk.append(_du(stream_root()))

    monkeypatch.setattr(RemoteRows, "_download", watched)
    monkeypatch.setattr(HubFiles, "read_range", lambda self, rel, a, b: ranges.append(b - a) or real_range(self, rel, a, b))
    stream = ShardStream(url, 0, 7, seed=1, cache=budget, memory="64KiB")
    assert stream.resident >= 2  # pieces: the shards' rows without their headers
    got = _rows(list(stream))
    np.testing.assert_array_equal(got, np.sort(src["hidden"][0], axis=0))  # every vector, once
    assert len(on_disk) >= len(sizes) and max(on_disk) <= budget
    assert sum(ranges) < 2 * sum(sizes)  # headers once, then each row once: nothing read twice
    cache = stream.engine.source.cache()
    assert cache.peak <= budget and cache.bytes == 0  # everything deleted once read
    # the Hugging Face cache holds no shard: it is not a side store for these reads
    assert not [p for p in fresh_hf_cache.rglob("*.safetensors")]
    stream.close()
    assert not cache.dir.exists()


def test_hub_stream_ranks_cover_every_vector_once_and_resume_exactly(hub, tmp_path, rng, fresh_hf_cache):
    src, url = _push(hub, tmp_path, rng)
    budget = 4 * max(f.bytes for f in lmprobe.load(url).meta.files() if f.rel.startswith("tensors/hidden"))
    shares = [np.concatenate(list(ShardStream(url, 0, 5, seed=3, rank=r, world_size=2, cache=budget,
                                              memory="64KiB"))) for r in range(2)]
    np.testing.assert_array_equal(np.sort(np.concatenate(shares), axis=0), np.sort(src["hidden"][0], axis=0))
    whole = [b.copy() for b in ShardStream(url, 0, 5, seed=4, cache=budget, memory="64KiB")]
    first = ShardStream(url, 0, 5, seed=4, cache=budget, memory="64KiB")
    it = iter(first)
    head = [next(it).copy() for _ in range(len(whole) // 2)]
    state = first.state_dict()
    it.close()
    resumed = ShardStream(url, 0, 5, seed=4, cache=budget, memory="64KiB")
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(head) + len(rest) == len(whole)
    for a, b in zip(head + rest, whole, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_cache_smaller_than_two_pieces_is_refused_before_any_download(hub, tmp_path, rng, fresh_hf_cache):
    _, url = _push(hub, tmp_path, rng, n=20)
    with pytest.raises(InvalidArgumentError, match="holds fewer than two pieces"):
        ShardStream(url, 0, 5, cache=100)
    assert not list(stream_root().rglob("*.rows-*"))


def test_the_default_cache_is_bounded_and_said(hub, tmp_path, rng, fresh_hf_cache, capsys):
    _, url = _push(hub, tmp_path, rng, n=20)
    stream = ShardStream(url, 0, 5)
    assert 0 < stream.cache_budget <= 20 * 2**30
    assert "through a local cache of at most" in capsys.readouterr().err
    local = ShardStream(tmp_path / "ds", 0, 5)
    assert local.cache_budget is None  # a local dataset is read in place


# ----------------------------------------------------------------------------- from S3


def test_s3_stream_errors_when_a_shard_changes_mid_pass(tmp_path, rng, s3):
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    write_dataset(tmp_path / "ds", rng, n=40, layers=(0,), dim=4, storage="full_sequence", shard_size="256B")
    url = f"s3://acts/changing-{uuid.uuid4().hex[:6]}"
    fs.put(str(tmp_path / "ds") + "/", url, recursive=True)
    stream = ShardStream(url, 0, 5, seed=0, memory="64KiB")
    victim = sorted(p for p in fs.find(url) if "hidden" in p)[-1]
    data = bytearray(fs.cat_file(victim))
    data[-1] ^= 0xFF  # same size, other bytes: a dataset replaced in place
    fs.pipe_file(victim, bytes(data))
    with pytest.raises(ObjectStoreError, match="changed on the remote"):
        list(stream)
    stream.close()




# ----------------------------------------------------------------------------- commands that read a remote dataset


def test_export_saev_from_the_hub_reads_through_a_bounded_cache(hub, tmp_path, rng, fresh_hf_cache, capsys):
    from lmprobe.cli import main as cli_main
    from lmprobe.storage.cache import LruFiles

    _, url = _push(hub, tmp_path, rng, n=60)
    biggest = max(f.bytes for f in lmprobe.load(url).meta.files() if f.rel.startswith("tensors/hidden"))
    peaks = []
    real = LruFiles.fetch

    def watched(self, rel, *, what="file"):
        path = real(self, rel, what=what)
        peaks.append(_du(self.dir))
        return path

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LruFiles, "fetch", watched)
        assert cli_main(["export-saev", url, "--out", str(tmp_path / "saev"), "--context-len", "4",
                         "--cache", str(3 * biggest)]) == 0
    assert peaks and max(peaks) <= 3 * biggest
    assert not list(fresh_hf_cache.rglob("*.safetensors"))
    from lmprobe.saev import SaevDataset

    (folder,) = [p.parent for p in (tmp_path / "saev").rglob("metadata.json")]
    sv = SaevDataset(folder)
    assert sv.n_ex * sv.tokens_per_ex >= 60  # every prompt's tokens, from the remote copy
    assert cli_main(["export-saev", url, "--out", str(tmp_path / "saev2"), "--cache", "10"]) == 2
    assert "cannot hold" in capsys.readouterr().err


def test_load_with_a_cache_reads_the_same_values_in_bounded_space(hub, tmp_path, rng, fresh_hf_cache):
    src, url = _push(hub, tmp_path, rng, n=40)
    biggest = max(f.bytes for f in lmprobe.load(url).meta.files() if f.rel.startswith("tensors/hidden"))
    ds = lmprobe.load(url, cache=2 * biggest)
    for i in range(ds.num_prompts):
        np.testing.assert_array_equal(ds.token_hidden(i, 0), src["hidden"][0][src["tok_start"][i]:src["tok_start"][i + 1]])
    assert ds.files.peak <= 2 * biggest
    assert not list(fresh_hf_cache.rglob("*.safetensors"))


def test_hub_stream_with_filters_normalisation_len_and_dataloader_workers(hub, tmp_path, rng, fresh_hf_cache):
    import torch

    src = write_dataset(tmp_path / "ds", rng, n=50, layers=(0,), dim=4, storage="full_sequence", shard_size="256B",
                        statistics=True, min_tokens=2)
    repo = f"tester/remote-{uuid.uuid4().hex[:8]}"
    lmprobe.push_to_hub(tmp_path / "ds", repo, quiet=True)
    url = f"hf://datasets/{repo}"
    budget = 4 * max(f.bytes for f in lmprobe.load(url).meta.files() if f.rel.startswith("tensors/hidden"))
    kw = {"skip_first_tokens": 1, "normalize": "standardize", "memory": "64KiB", "seed": 2}
    local = ShardStream(tmp_path / "ds", 0, 6, **kw)
    remote = ShardStream(url, 0, 6, cache=budget, **kw)
    assert len(remote) == len(local) == int((src["n_tok"] - 1).sum())
    np.testing.assert_allclose(_rows(list(remote)), _rows(list(local)), rtol=1e-6)
    loader = torch.utils.data.DataLoader(ShardStream(url, 0, 6, cache=budget, memory="64KiB").torch_dataset(),
                                         batch_size=None, num_workers=2)
    got = torch.cat(list(loader)).numpy()
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(src["hidden"][0], axis=0))
