"""Object storage: extract to s3:// while shards upload in the background, and load back, against moto on 127.0.0.1."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest
from support.datasets import PROMPTS, write_dataset

import lmprobe


def _s3fs():
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return s3fs.S3FileSystem()


def test_extract_to_s3_and_load_back(s3, llama_dir, tmp_path):
    url = f"s3://acts/run-{uuid.uuid4().hex[:6]}"
    local = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "local", layers="0,2", storage="full_sequence",
                            shard_size="2KB", logits_topk=3, quiet=True)
    _s3fs()
    remote = lmprobe.extract(str(llama_dir), PROMPTS, out=url, layers="0,2", storage="full_sequence",
                             shard_size="2KB", logits_topk=3, quiet=True)
    fs = _s3fs()
    keys = sorted(k.split("/", 2)[2] for k in fs.find(url))
    local_files = sorted(p.relative_to(tmp_path / "local").as_posix() for p in (tmp_path / "local").rglob("*")
                         if p.is_file())
    assert keys == local_files
    fresh = lmprobe.load(url)
    for layer in (0, 2):
        np.testing.assert_array_equal(fresh.hidden(layer), local.hidden(layer))
        np.testing.assert_array_equal(fresh.token_hidden(3, layer), local.token_hidden(3, layer))
    np.testing.assert_array_equal(remote.logits_topk()[1], local.logits_topk()[1])
    s1, s2 = local.statistics(2), fresh.statistics(2)
    np.testing.assert_allclose(s1["mean"], s2["mean"])
    # uploaded shards do not stay in the local staging folder
    from lmprobe.storage.objectstore import cache_dir

    staged = cache_dir(url, "outputs")
    assert not list((staged / "tensors").glob("hidden_*.safetensors"))
    # a second run is a no-op
    again = lmprobe.extract(str(llama_dir), PROMPTS, out=url, layers="0,2", storage="full_sequence",
                            shard_size="2KB", logits_topk=3, quiet=True)
    assert again.num_prompts == len(PROMPTS)


def test_upload_failures_are_retried(s3, llama_dir, monkeypatch):
    import s3fs

    from lmprobe.base.retry import RetryPolicy
    from lmprobe.storage import objectstore

    class InjectedReset(ConnectionError):
        pass

    url = f"s3://acts/flaky-{uuid.uuid4().hex[:6]}"
    real_put = s3fs.S3FileSystem.put_file
    fails = {"n": 0}

    def flaky_put(self, *args, **kwargs):
        fails["n"] += 1
        if fails["n"] in (1, 3):
            raise InjectedReset("connection reset by peer")
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "put_file", flaky_put)
    # the fault is transient because the policy says so, and the retries do not wait
    monkeypatch.setattr(objectstore, "object_store_policy",
                        lambda **kw: RetryPolicy(retry_on_exceptions=(InjectedReset,), max_retries=3, base_wait=0.0))
    _s3fs()
    lmprobe.extract(str(llama_dir), PROMPTS, out=url, layers="1", quiet=True)
    assert fails["n"] >= 3
    assert lmprobe.load(url).num_prompts == len(PROMPTS)


def test_missing_remote_dataset_is_a_clear_error(s3):
    _s3fs()
    with pytest.raises(FileNotFoundError, match="holds no complete lmprobe dataset"):
        lmprobe.load("s3://acts/nothing-here")
    json.dumps({})


def _other_prompts():
    return [dict(p, text=p["text"] + " (again)") for p in PROMPTS]


def test_an_interrupted_overwrite_never_pairs_the_old_index_with_new_shards(s3, llama_dir, monkeypatch):
    from lmprobe.errors import DatasetNotFoundError
    from lmprobe.extraction import backend_hf

    url = f"s3://acts/overwrite-{uuid.uuid4().hex[:6]}"
    _s3fs()
    lmprobe.extract(str(llama_dir), PROMPTS, out=url, layers="0", shard_size="256B", batch_size=2, quiet=True)
    real, calls = backend_hf.TransformersBackend.run, {"n": 0}

    def dying(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(backend_hf.TransformersBackend, "run", dying)
    with pytest.raises(KeyboardInterrupt):
        lmprobe.extract(str(llama_dir), _other_prompts(), out=url, layers="0", shard_size="256B", batch_size=2,
                        checkpoint_interval=0, overwrite=True, quiet=True)
    monkeypatch.setattr(backend_hf.TransformersBackend, "run", real)
    with pytest.raises(DatasetNotFoundError):
        lmprobe.load(url)  # the old index is gone before any new shard went up
    ds = lmprobe.extract(str(llama_dir), _other_prompts(), out=url, layers="0", shard_size="256B", batch_size=2,
                         quiet=True)
    assert ds.texts == [p["text"] for p in _other_prompts()]


def test_the_read_cache_notices_a_replaced_dataset(s3, tmp_path, rng):
    url = f"s3://acts/replaced-{uuid.uuid4().hex[:6]}"
    fs = _s3fs()
    write_dataset(tmp_path / "a", rng, n=6, layers=(0,), dim=4)
    write_dataset(tmp_path / "b", rng, n=6, layers=(0,), dim=4)
    fs.put(str(tmp_path / "a") + "/", url, recursive=True)
    np.testing.assert_array_equal(lmprobe.load(url).hidden(0), lmprobe.load(tmp_path / "a").hidden(0))
    fs.rm(url, recursive=True)
    fs.put(str(tmp_path / "b") + "/", url, recursive=True)  # same shapes, same sizes, other values
    np.testing.assert_array_equal(lmprobe.load(url).hidden(0), lmprobe.load(tmp_path / "b").hidden(0))


def test_the_bucket_not_a_local_leftover_decides_whether_the_output_exists(s3, llama_dir):
    from lmprobe.storage.objectstore import cache_dir

    url = f"s3://acts/leftover-{uuid.uuid4().hex[:6]}"
    fs = _s3fs()
    lmprobe.extract(str(llama_dir), PROMPTS, out=url, layers="0", quiet=True)
    assert not cache_dir(url, "outputs").exists()  # a finished upload leaves no staging copy behind
    fs.rm(url, recursive=True)
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=url, layers="1", quiet=True)
    assert ds.layers == [1]


def _interrupted(llama_dir, url, monkeypatch, after=3, **kw):
    """An extraction to ``url`` stopped (as by kill -9, the writer never closing) after ``after`` batches, once a
    shard has reached the bucket (uploads run on a thread of their own: on a busy machine none may have yet)."""
    from lmprobe.extraction import backend_hf

    real, calls = backend_hf.TransformersBackend.run, {"n": 0}

    def dying(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > after:
            deadline = time.monotonic() + 120
            while not _s3fs().find(url) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(backend_hf.TransformersBackend, "run", dying)
    with pytest.raises(KeyboardInterrupt):
        lmprobe.extract(str(llama_dir), PROMPTS, out=url, layers="0", shard_size="256B", batch_size=2,
                        checkpoint_interval=0, quiet=True, **kw)
    monkeypatch.setattr(backend_hf.TransformersBackend, "run", real)


@pytest.mark.parametrize("late_uploads", [False, True])
def test_a_resumed_run_whose_bucket_lost_uploaded_shards_is_an_error_not_a_broken_dataset(s3, llama_dir, monkeypatch,
                                                                                          capsys, tmp_path,
                                                                                          late_uploads):
    """Kill, wipe the bucket's prefix, re-run: an error, never exit 0 with 3 shards missing (also when the upload
    thread starts late, as on a busy machine: the kill then comes once a shard is up)."""
    from lmprobe.cli import main as cli_main
    from lmprobe.storage import objectstore

    worker = objectstore.BackgroundWorker

    class LateWorker(worker):
        def _run(self):
            time.sleep(2)
            return super()._run()

    url = f"s3://acts/wiped-{uuid.uuid4().hex[:6]}"
    _s3fs()
    if late_uploads:
        monkeypatch.setattr(objectstore, "BackgroundWorker", LateWorker)
    _interrupted(llama_dir, url, monkeypatch)
    monkeypatch.setattr(objectstore, "BackgroundWorker", worker)
    fs = _s3fs()
    assert fs.find(url)  # shards went up before the stop
    fs.rm(url, recursive=True)
    _s3fs()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    args = ["extract", "--model", str(llama_dir), "--prompts", str(prompts), "--out", url,
            "--layers", "0", "--shard-size", "256B", "--batch-size", "2", "--quiet"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overwrite" in err[0] and "missing" in err[0], err
    from lmprobe.errors import DatasetNotFoundError

    with pytest.raises(DatasetNotFoundError):
        lmprobe.load(url)  # no index: never a dataset with holes
    assert cli_main([*args, "--overwrite"]) == 0
    ds = lmprobe.load(url)
    keys = {k.split("/", 2)[2] for k in _s3fs().find(url)}
    assert ds.num_prompts == len(PROMPTS) and {f.rel for f in ds.meta.files()} <= keys


def test_an_overwrite_over_a_stale_partial_staging_folder_starts_clean(s3, llama_dir, monkeypatch):
    """The matrix: kill, the prefix finished elsewhere with other settings, then --overwrite: a traceback."""
    import time

    from lmprobe.storage import objectstore

    url = f"s3://acts/stale-{uuid.uuid4().hex[:6]}"
    _s3fs()
    _interrupted(llama_dir, url, monkeypatch)
    _s3fs()
    real_put = objectstore.UploadSink.put
    monkeypatch.setattr(objectstore.UploadSink, "put", lambda self, rel: time.sleep(0.2) or real_put(self, rel))
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=url, layers="0,1", shard_size="512B", batch_size=3,
                         overwrite=True, quiet=True)
    ref = lmprobe.extract(str(llama_dir), PROMPTS, out=url.replace("stale", "ref"), layers="0,1",
                          shard_size="512B", batch_size=3, quiet=True)
    for layer in (0, 1):
        np.testing.assert_array_equal(ds.hidden(layer), ref.hidden(layer))
