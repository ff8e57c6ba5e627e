"""Training from a remote dataset in a bounded, node-shared cache: the Hub and S3 (local servers), request economy,
no read amplification across ranks, mixing, the shared cache under concurrent and killed readers, faults waited
out, checksums, hangs, full disks."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from support.datasets import write_dataset, write_sorted_labels
from support.paths import SUPPORT

import lmprobe
from lmprobe.errors import FormatError, HubError, InvalidArgumentError, ObjectStoreError, OutOfSpaceError
from lmprobe.storage.cache import BoundedCache, cache_budget
from lmprobe.storage.cache import cache_root as stream_root
from lmprobe.storage.hub import HubFiles
from lmprobe.stream import RemoteRows, ShardStream

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
    files = _SlowFiles(sizes, lambda: holder["cache"].folder)
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
    assert not cache.folder.exists()  # a finished reader leaves nothing behind


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


def test_readers_of_one_machine_share_a_folder_download_each_piece_once_and_keep_one_budget(tmp_path):
    """Two readers (ranks of one node) of the same remote: a piece both need at once is downloaded once, the other
    waits for it; the folder as a whole stays within the budget; a piece is visible only once complete."""
    sizes = {f"p{i}": 1000 for i in range(30)}
    calls: dict[str, int] = {}
    lock = threading.Lock()
    seen_incomplete = []

    def download(name, dst):
        with lock:
            calls[name] = calls.get(name, 0) + 1
        with open(dst, "wb") as f:
            for _ in range(4):
                f.write(b"\2" * 250)
                f.flush()
                for p in (tmp_path / "acts").glob("pieces/*"):  # what any reader may open: whole files only
                    try:
                        if p.stat().st_size != 1000:
                            seen_incomplete.append(p.name)
                    except FileNotFoundError:  # released and deleted meanwhile
                        pass
                time.sleep(0.003)

    a = BoundedCache(download, 4000, key="acts", sizes=sizes, root=tmp_path, share=2)
    b = BoundedCache(download, 4000, key="acts", sizes=sizes, root=tmp_path, share=2)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.wait(0.001):
            peak[0] = max(peak[0], a.folder_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    order = [f"p{i}" for i in range(30)]

    together = threading.Barrier(2)

    def consume(cache):  # ranks in step, as data-parallel training keeps them: both hold a piece at once
        cache.schedule(order)
        for name in order:
            assert cache.get(name).read_bytes() == b"\2" * 1000
            together.wait(30)
            cache.release(name)

    threads = [threading.Thread(target=consume, args=(c,)) for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    done.set()
    sampler.join()
    assert all(n == 1 for n in calls.values()) and len(calls) == 30  # each piece once for the machine
    assert a.downloaded + b.downloaded == 30 and a.shared + b.shared == 30
    assert peak[0] <= 4000 and not seen_incomplete
    a.close()
    assert b.folder.exists()  # b still reads from it
    b.close()
    assert not b.folder.exists()


def test_default_budgets_count_the_other_readers_of_the_machine(tmp_path, monkeypatch):
    """Two jobs starting on one node: the second's default budget leaves room for the first's (finding 12)."""
    import shutil

    free = 40 * 2**30
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free))
    first = cache_budget(None, "job 1", announce=False)
    second = cache_budget(None, "job 2", announce=False)  # while the first job's budget still holds
    assert first <= free // 2
    assert first + second <= 0.75 * free, (first, second)  # not half of the same free space twice
    assert second < first


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


def test_stream_from_the_hub(hub, tmp_path, rng, fresh_hf_cache):
    src = write_dataset(tmp_path / "ds", rng, n=20, layers=(0,), dim=4, storage="full_sequence", shard_size="256B")
    repo = f"tester/stream-{uuid.uuid4().hex[:8]}"
    lmprobe.push_to_hub(tmp_path / "ds", repo, quiet=True)
    got = np.concatenate(list(ShardStream(f"hf://datasets/{repo}", 0, 7, seed=1)))
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(src["hidden"][0], axis=0))


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
    monkeypatch.setattr(HubFiles, "read_range",
                        lambda self, rel, a, b, **kw: ranges.append(b - a) or real_range(self, rel, a, b, **kw))
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


def test_the_default_cache_is_bounded_and_said(hub, tmp_path, rng, fresh_hf_cache, capsys, messages):
    _, url = _push(hub, tmp_path, rng, n=20)
    stream = ShardStream(url, 0, 5)
    assert 0 < stream.cache_budget <= 20 * 2**30
    assert "through a local cache of at most" in capsys.readouterr().err
    local = ShardStream(tmp_path / "ds", 0, 5)
    assert local.cache_budget is None  # a local dataset is read in place


def _tensor_gets(hub, since: int) -> list[tuple[str, str, int, int]]:
    """The file answers for shard files since transfer ``since``: (method, path, status, bytes)."""
    return [t for t in hub.transfers[since:] if t[0] == "GET" and "/resolve/" in t[1] and "tensors" in t[1]]


def _layer_bytes(url: str) -> int:
    return sum(f.bytes for f in lmprobe.load(url).meta.files() if f.rel.startswith("tensors/hidden"))


def test_a_pass_reads_each_shard_with_one_request_and_headers_only_when_needed(hub, tmp_path, rng, fresh_hf_cache):
    """Point 1: no header is read up front; a shard that fits in a piece is one request (header and rows); a rank
    reads only its own shards; bytes per request, every request counted, is about a piece."""
    _, url = _push(hub, tmp_path, rng, n=300, shard_size="1KiB")
    n_files = len([f for f in lmprobe.load(url).meta.files() if f.rel.startswith("tensors/hidden")])
    log0, t0 = len(hub.log), len(hub.transfers)
    stream = ShardStream(url, 0, 8, seed=0, cache="64KiB", memory="64KiB")
    assert not _tensor_gets(hub, t0)  # nothing of a shard until the pass needs it
    rows = np.concatenate(list(stream))
    requests = hub.log[log0:]  # repo description, index, shards: everything this reader asked for
    served = sum(b for _, _, _, b in hub.transfers[t0:])
    gets = _tensor_gets(hub, t0)
    assert len(gets) == n_files and len({p for _, p, _, _ in gets}) == n_files  # one request per shard file
    assert len(rows) == sum(lmprobe.load(url).hidden_desc().shard_rows(s) for s in range(n_files))
    assert served / len(requests) >= 0.5 * _layer_bytes(url) / n_files
    stream.close()
    t1 = len(hub.transfers)
    quarter = ShardStream(url, 0, 8, seed=0, cache="64KiB", memory="64KiB", rank=1, world_size=4)
    list(quarter)
    # its own shards only: about a quarter, and where a dealing cut splits a shard with the next rank, the
    # shard's header and the rank's part of its rows (two cuts at most)
    assert len(_tensor_gets(hub, t1)) <= -(-n_files // 4) + 4


@pytest.mark.parametrize("piece", [None, "256B"])  # shards read whole; shards cut into pieces dealt apart
def test_four_ranks_download_the_layer_once_between_them_and_see_every_vector_once(hub, tmp_path, rng,
                                                                                   fresh_hf_cache, piece):
    """Point 2: pieces, not rows, are dealt to the ranks: together they download at most 1.15x the layer's bytes."""
    src, url = _push(hub, tmp_path, rng, n=400, shard_size="1KiB")
    kw = {"piece": piece} if piece else {}
    t0 = len(hub.transfers)
    shares = [np.concatenate(list(ShardStream(url, 0, 8, seed=5, rank=r, world_size=4, cache="32KiB",
                                              memory="64KiB", **kw))) for r in range(4)]
    served = sum(b for _, _, _, b in _tensor_gets(hub, t0))
    assert served <= 1.15 * _layer_bytes(url), (served, _layer_bytes(url))
    np.testing.assert_array_equal(np.sort(np.concatenate(shares), axis=0), np.sort(src["hidden"][0], axis=0))
    assert max(map(len, shares)) - min(map(len, shares)) <= 2 * 16  # balanced within a block per cut


def test_batches_of_a_label_sorted_dataset_mix_like_uniform_sampling_with_a_quarter_of_it_cached(hub, tmp_path):
    """Point 3: a cache of a quarter of the data; each resident group of pieces spans the whole dataset."""
    write_sorted_labels(tmp_path / "ds", 65536, 16, "64KiB")  # 4 MiB, 256 pieces of 16 KiB
    repo = f"tester/sorted-{uuid.uuid4().hex[:8]}"
    lmprobe.push_to_hub(tmp_path / "ds", repo, quiet=True)
    b = 256
    stream = ShardStream(f"hf://datasets/{repo}", 0, b, seed=0, drop_last=True, cache="1MiB", piece="16KiB",
                         memory="16MiB")
    batches = list(stream)
    spread = np.array([x[:, 0].mean() for x in batches]).std() / np.sqrt(0.25 / b)
    assert stream.resident == 32 and spread <= 1.5, spread
    rows = np.concatenate(batches)[:, 1]
    assert len(np.unique(rows)) == len(rows) == 65536  # every vector once


def test_a_storm_of_429_and_503_answers_is_waited_out(hub, tmp_path, rng, fresh_hf_cache, monkeypatch):
    """Point 5: a fifth of the range requests answered 429 or 503: the epoch completes, every vector once."""
    import lmprobe.storage.hub as hub_mod

    monkeypatch.setattr(hub_mod, "BASE_WAIT", 0.01)
    src, url = _push(hub, tmp_path, rng, n=300, shard_size="1KiB")
    storm = hub.storm(0.2, pattern=r"/resolve/.*tensors", headers={"Retry-After": "0"}, seed=1)
    try:
        shares = [np.concatenate(list(ShardStream(url, 0, 8, seed=1, rank=r, world_size=2, cache="32KiB",
                                                  memory="64KiB", piece="256B"))) for r in range(2)]
    finally:
        hub.clear_faults()
    assert storm.hits >= 5
    np.testing.assert_array_equal(np.sort(np.concatenate(shares), axis=0), np.sort(src["hidden"][0], axis=0))


def test_wrong_bytes_of_the_right_length_are_an_error_naming_the_shard(hub, tmp_path, rng, fresh_hf_cache):
    """Finding 6: a proxy flips a byte of a shard: its recorded sha256 catches it before any of its rows is used."""
    _, url = _push(hub, tmp_path, rng, n=200, shard_size="1KiB")
    hub.corrupt(r"/resolve/.*tensors/hidden_layer000_shard0*3\.safetensors")
    served = []
    try:
        with pytest.raises(FormatError, match=r"hidden_layer000_shard0*3\.safetensors.*sha256") as err:
            for batch in ShardStream(url, 0, 4, seed=0, cache="64KiB", memory="64KiB", shuffle=False):
                served.append(batch)
    finally:
        hub.clear_faults()
    assert "\n" not in str(err.value)


def _run_in_thread(fn, seconds: float):
    """``fn()`` on a thread, given ``seconds``: (finished, its result or exception)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), out


def test_a_retry_after_of_a_day_gives_up_with_one_line_at_the_deadline(hub, tmp_path, rng, fresh_hf_cache, caplog,
                                                                      monkeypatch):
    """Finding 10: `Retry-After: 100000` on every range request: the reader says what it waits for, caps the wait,
    and gives up with one line after its deadline instead of sleeping a day."""
    import huggingface_hub.constants as c

    _, url = _push(hub, tmp_path, rng, n=60, shard_size="1KiB")
    stream = ShardStream(url, 0, 4, seed=0, cache="64KiB", memory="64KiB", deadline=6)
    monkeypatch.setattr(c, "ENDPOINT", c.ENDPOINT.replace("http://", "http://someone:SECRETKEY@"))
    hub.fail("GET", r"/resolve/.*tensors", 429, times=10**6, headers={"Retry-After": "100000"})
    t = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING):
            finished, out = _run_in_thread(lambda: list(stream), 60)
    finally:
        hub.clear_faults()
    assert finished, "the reader hung on a Retry-After of 100000 s"
    assert isinstance(out.get("error"), HubError), out
    message = str(out["error"])
    assert "\n" not in message and "429" in message and "tensors/" in message and "6 s" in message
    assert "SECRETKEY" not in message  # an endpoint is printed without its credentials
    assert time.monotonic() - t < 30
    assert any("waiting" in r.getMessage() or "trying again in 6 s" in r.getMessage() for r in caplog.records)
    assert any("asked for 100000 s" in r.getMessage() for r in caplog.records)


def test_a_stalled_range_request_times_out_and_is_tried_again(hub, tmp_path, rng, fresh_hf_cache, monkeypatch):
    """Finding 10: a range request whose answer never comes: timed out, tried again, the pass completes."""
    import lmprobe.storage.hub as hub_mod

    monkeypatch.setattr(hub_mod, "READ_TIMEOUT", 1.0, raising=False)
    monkeypatch.setattr(hub_mod, "BASE_WAIT", 0.01, raising=False)
    src, url = _push(hub, tmp_path, rng, n=60, shard_size="1KiB")
    stream = ShardStream(url, 0, 4, seed=0, cache="64KiB", memory="64KiB")
    hub.stall(r"/resolve/.*tensors", 40, times=1)
    try:
        finished, out = _run_in_thread(lambda: np.concatenate(list(stream)), 20)
    finally:
        hub.clear_faults()
    assert finished, "a stalled range request hung the reader"
    np.testing.assert_array_equal(np.sort(out["value"], axis=0), np.sort(src["hidden"][0], axis=0))


@pytest.mark.parametrize("command", ["pull", "export-saev"])
def test_commands_cap_a_servers_retry_after_and_do_not_multiply_tries(hub, tmp_path, rng, fresh_hf_cache,
                                                                     monkeypatch, capsys, command):
    """Finding 10: `pull` and `export-saev` against 429s asking for 45 s: a passing storm is waited out, and a
    lasting one ends in one line after a few tries (lmprobe's tries do not multiply huggingface_hub's)."""
    from lmprobe.cli import main as cli_main

    _, url = _push(hub, tmp_path, rng, n=40, shard_size="1KiB")
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", lambda s: waits.append(float(s)))
    shard = r"/resolve/.*tensors/hidden_layer000_shard0*1\.safetensors"

    def run(out):
        args = ["pull", url, "--out", str(out)] if command == "pull" else \
            ["export-saev", url, "--out", str(out), "--cache", "1MiB", "--context-len", "4"]
        return cli_main([*args, "--quiet"] if command == "pull" else args)

    hub.fail("*", shard, 429, times=2, headers={"Retry-After": "45"})
    try:
        assert run(tmp_path / "a") == 0
    finally:
        hub.clear_faults()
    assert waits and max(waits) <= 61, waits
    capsys.readouterr()
    waits.clear()
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf-cache-2"))  # nothing cached from the first run
    before = len(hub.log)
    hub.fail("*", shard, 429, times=10**6, headers={"Retry-After": "45"})
    try:
        assert run(tmp_path / "b") == 2
    finally:
        hub.clear_faults()
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "429" in errors[0] and "Traceback" not in errors[0], errors
    tries = [p for m, p in hub.log[before:] if re.search(shard, p)]
    assert len(tries) <= 12, len(tries)  # one tool's tries, not four times five
    assert max(waits) <= 61


@pytest.mark.parametrize("command", ["pull", "export-saev"])
def test_a_retry_after_of_a_day_stops_a_command_at_once_and_says_when_to_come_back(hub, tmp_path, rng,
                                                                                  fresh_hf_cache, monkeypatch,
                                                                                  capsys, command):
    """`Retry-After: 100000` during `pull` and `export-saev` was waited out at 61 s a try,
    5 tries. A command that cannot go on within a minute says so at once, in one line: the server's time, and
    running the same command again then."""
    from lmprobe.cli import main as cli_main

    _, url = _push(hub, tmp_path, rng, n=40, shard_size="1KiB")
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", lambda s: waits.append(float(s)))
    shard = r"/resolve/.*tensors/hidden_layer000_shard0*1\.safetensors"
    args = ["pull", url, "--out", str(tmp_path / "a"), "--quiet"] if command == "pull" else \
        ["export-saev", url, "--out", str(tmp_path / "a"), "--cache", "1MiB", "--context-len", "4"]
    before = len(hub.log)
    hub.fail("*", shard, 429, times=10**6, headers={"Retry-After": "100000"})
    try:
        assert cli_main(args) == 2
    finally:
        hub.clear_faults()
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    line = errors[0]
    assert "100000 s" in line and "UTC" in line and "429" in line, line
    assert "run the same" in line and "again" in line, line
    assert sum(waits) < 5, waits  # no minute-long waits at all
    tries = [p for m, p in hub.log[before:] if re.search(shard, p)]
    assert len(tries) == 1, tries
    # after the server's time the same command goes on
    assert cli_main(args) == 0


def test_a_retry_after_of_a_day_on_the_repo_itself_stops_a_pull_at_once(hub, tmp_path, rng, fresh_hf_cache,
                                                                       monkeypatch, capsys):
    """The first request of a pull (the repo's description) asking for a day: one line, not 'cannot reach'."""
    from lmprobe.cli import main as cli_main

    _, url = _push(hub, tmp_path, rng, n=40, shard_size="1KiB")
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", lambda s: waits.append(float(s)))
    hub.fail("GET", r"/api/datasets/", 429, times=10**6, headers={"Retry-After": "100000"})
    try:
        assert cli_main(["pull", url, "--out", str(tmp_path / "a"), "--quiet"]) == 2
    finally:
        hub.clear_faults()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "100000 s" in err and "run the same pull again" in err, err
    assert "cannot reach" not in err and sum(waits) < 5, (err, waits)


def test_a_full_disk_under_the_cache_is_one_line(hub, tmp_path, rng, fresh_hf_cache, monkeypatch, capsys):
    """Finding 12: the disk fills while a piece is written: one line naming the cache and what to do."""
    from lmprobe.cli import main as cli_main

    _, url = _push(hub, tmp_path, rng, n=40, shard_size="1KiB")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(HubFiles, "read_range", full)
    monkeypatch.setattr(HubFiles, "download", full)
    with pytest.raises(OutOfSpaceError, match="full") as err:
        list(ShardStream(url, 0, 4, cache="64KiB", memory="64KiB"))
    assert "\n" not in str(err.value) and "cache" in str(err.value)
    for args in (["export-saev", url, "--out", str(tmp_path / "saev"), "--cache", "1MiB"],
                 ["report", url, "--out", str(tmp_path / "report"), "--cache", "1MiB"]):
        capsys.readouterr()
        assert cli_main(args) == 2, args
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error" in line]
        assert len(errors) == 1 and "full" in errors[0] and "Traceback" not in err, err


def _reader_script(url: str, **kw) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    return (f"from lmprobe.stream import ShardStream\n"
            f"s = ShardStream({url!r}, 0, 4, seed=0, {args})\n"
            "print('reading', flush=True)\n"
            "for b in s:\n    pass\n"
            "print('done', flush=True)\n")


def _files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name != ".lock"]


def test_what_killed_and_finished_readers_leave_is_removed_by_the_next_reader(hub, tmp_path, rng, fresh_hf_cache):
    """Findings 15 and point 4: a reader killed mid-download leaves a half-written part (never visible as a piece)
    and its holds; one that ends without close() leaves its pieces' folder; the next reader removes both."""
    src, url = _push(hub, tmp_path, rng, n=300, shard_size="1KiB")
    env = {**os.environ}
    hub.throttle(2000, r"/resolve/.*tensors")  # 2 KB/s: a shard takes a while to arrive
    try:
        p = subprocess.Popen([sys.executable, "-c", _reader_script(url, cache="8KiB", memory="64KiB")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not [f for f in _files_under(stream_root()) if "hidden" in f.name]:
            time.sleep(0.05)
        assert [f for f in _files_under(stream_root()) if "hidden" in f.name], \
            p.stderr.read() if p.poll() is not None else "no download"
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    finally:
        hub.throttle(None)
    for piece in stream_root().rglob("pieces/*"):  # whatever is visible is whole
        assert piece.stat().st_size == next(f.bytes for f in lmprobe.load(url).meta.files()
                                            if piece.name.startswith(f.rel.replace("/", "%2F")))
    r = subprocess.run([sys.executable, "-c", _reader_script(url, cache="8KiB", memory="64KiB")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr[-2000:]  # ended without close()
    assert _files_under(stream_root())  # left behind: nobody removed them yet
    stream = ShardStream(url, 0, 4, seed=0, cache="8KiB", memory="64KiB")  # the next reader
    mine = stream.engine.source.cache()
    left = [p for p in _files_under(stream_root()) if mine.folder not in p.parents or "readers" in p.parts
            and mine._reg.rid not in p.parts]
    assert not left, left
    np.testing.assert_array_equal(np.sort(np.concatenate(list(stream)), axis=0), np.sort(src["hidden"][0], axis=0))
    stream.close()
    assert not _files_under(stream_root())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_four_ranks_on_two_nodes_share_a_cache_per_node_cover_every_vector_once_and_resume_exactly(
        hub, tmp_path, rng, fresh_hf_cache):
    """Training from a remote dataset on many nodes, end to end: torchrun, gloo, c10d rendezvous on 127.0.0.1; two simulated nodes of two ranks, each
    node with its own working, temporary and cache folders. Together the ranks see every vector once and download
    the layer about once; each node's cache stays within its budget while its ranks read at once; ranks stopped
    mid-epoch and started again from their states serve exactly the batches of an uninterrupted run; nothing is
    left in the caches afterwards."""
    src, url = _push(hub, tmp_path, rng, n=1500, shard_size="8KiB")
    budget = 32 * 1024
    out = tmp_path / "out"
    out.mkdir()

    def launch(mode: str) -> None:
        port, run_id = _free_port(), uuid.uuid4().hex[:8]
        procs = []
        for node in (0, 1):
            home = tmp_path / f"node{node}"
            (home / "tmp").mkdir(parents=True, exist_ok=True)
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
            env.update(LMPROBE_CACHE=str(home / "cache"), TMPDIR=str(home / "tmp"), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                 "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                 "--rdzv_id", run_id, "--rdzv_conf", f"is_host={int(node == 0)}", str(SUPPORT / "_remote_rank.py"),
                 url, str(out), mode, str(budget)], cwd=home, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
        for p in procs:
            text = p.communicate(timeout=600)[0]
            assert p.returncode == 0, text[-4000:]

    t0 = len(hub.transfers)
    launch("whole")
    served = sum(b for _, _, _, b in _tensor_gets(hub, t0))
    assert served <= 1.15 * _layer_bytes(url), (served, _layer_bytes(url))
    whole = [np.load(out / f"whole{r}.npy") for r in range(4)]
    np.testing.assert_array_equal(np.sort(np.concatenate(whole), axis=0), np.sort(src["hidden"][0], axis=0))
    launch("first")
    launch("resume")
    for r in range(4):
        np.testing.assert_array_equal(np.concatenate([np.load(out / f"first{r}.npy"), np.load(out / f"resume{r}.npy")]),
                                      whole[r])
    for mode in ("whole", "first", "resume"):
        for r in range(4):
            info = json.loads((out / f"{mode}{r}.json").read_text())
            assert 0 < info["peak"] <= budget, (mode, r, info)
    for node in (0, 1):
        assert not _files_under(tmp_path / f"node{node}" / "cache" / "stream")


# ----------------------------------------------------------------------------- from S3


def _s3fs():
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return s3fs.S3FileSystem()


def test_streaming_reader_from_s3(s3, tmp_path, rng):
    from support.datasets import write_dataset

    from lmprobe.stream import ShardStream

    src = write_dataset(tmp_path / "ds", rng, n=12, layers=(0,), dim=4, storage="full_sequence", shard_size="128B")
    url = f"s3://acts/stream-{uuid.uuid4().hex[:6]}"
    fs = _s3fs()
    fs.put(str(tmp_path / "ds") + "/", url, recursive=True)
    got = np.concatenate(list(ShardStream(url, 0, 5, seed=2)))
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(src["hidden"][0], axis=0))


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




@pytest.mark.slow
def test_processes_sharing_the_object_store_cache_do_not_trip_over_each_other(tmp_path, rng, s3):
    """Finding 11: ten processes read one s3:// dataset at once through $LMPROBE_CACHE/remote: each file is
    downloaded under a name of the process's own and renamed in, under a lock per file: all of them succeed."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    src = write_dataset(tmp_path / "ds", rng, n=200, layers=(0, 1), dim=8, shard_size="1KiB")
    url = f"s3://acts/shared-{uuid.uuid4().hex[:6]}"
    fs.put(str(tmp_path / "ds") + "/", url, recursive=True)
    script = ("import sys, numpy as np, lmprobe\n"
              "ds = lmprobe.load(sys.argv[1])\n"
              "np.save(sys.argv[2], np.concatenate([ds.hidden(0), ds.hidden(1)]))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, url, str(tmp_path / f"out{i}.npy")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(10)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    failed = [err[-1500:] for code, err in results if code != 0]
    assert not failed, failed[0]
    want = np.concatenate([src["hidden"][0], src["hidden"][1]])
    for i in range(10):
        np.testing.assert_array_equal(np.load(tmp_path / f"out{i}.npy"), want)
    assert not [p for p in (Path(os.environ["LMPROBE_CACHE"]) / "remote").rglob("*") if p.name.endswith(".part")]


# ----------------------------------------------------------------------------- commands that read a remote dataset


def test_export_saev_from_the_hub_reads_through_a_bounded_cache(hub, tmp_path, rng, fresh_hf_cache, capsys):
    from lmprobe.cli import main as cli_main
    from lmprobe.storage.lrufiles import LruFiles

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


@pytest.mark.slow  # three streams of a Hub dataset, 5-10 s on a loaded machine
def test_three_streams_sharing_a_small_cache_serve_every_row(hub, tmp_path, rng, fresh_hf_cache, monkeypatch):
    """End to end: three readers of one Hub dataset on a machine (not one launch: each thinks it has
    the whole cache) share one folder and budget; each serves every vector once, and none waits out the bound (a
    deadlock would end in OutOfSpaceError after DEFAULT_PATIENCE, made 20 s here)."""
    import lmprobe.storage.cache as cache_mod

    monkeypatch.setattr(cache_mod, "DEFAULT_PATIENCE", 20.0)
    src, url = _push(hub, tmp_path, rng, n=200, shard_size="512B")
    budget = 4 * max(f.bytes for f in lmprobe.load(url).meta.files() if f.rel.startswith("tensors/hidden"))
    got: dict[int, list] = {i: [] for i in range(3)}
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def read(i):
        try:
            stream = ShardStream(url, 0, 7, seed=i, cache=budget, memory="2KiB")
            start.wait(30)
            for batch in stream:
                got[i].append(batch.copy())
                time.sleep(0.002)  # the three streams hold their windows at once
            stream.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert time.monotonic() - t0 < 20
    for i in range(3):
        np.testing.assert_array_equal(_rows(got[i]), np.sort(src["hidden"][0], axis=0))


def test_links_planted_in_the_node_cache_make_a_stream_delete_nothing_outside(hub, tmp_path, rng, fresh_hf_cache):
    """Links as another user left them: `stream/x -> dir`, `stream/y/pieces -> dir`, `stream/z/parts -> dir` planted by
    another user of the node; a remote ShardStream deletes none of the 15 files and creates no `.lock` there."""
    src, url = _push(hub, tmp_path, rng)
    root = stream_root()
    victims = {}
    for link in ("x", "y/pieces", "z/parts"):
        victim = tmp_path / f"victim-{link.replace('/', '-')}"
        victim.mkdir()
        for i in range(5):
            (victim / f"file{i}.txt").write_text(f"mine {i}")
        victims[victim] = sorted(p.name for p in victim.iterdir())
        (root / link).parent.mkdir(parents=True, exist_ok=True)
        (root / link).symlink_to(victim, target_is_directory=True)
    got = _rows(list(ShardStream(url, 0, 7, seed=1, cache="64KiB", memory="64KiB")))
    np.testing.assert_array_equal(got, np.sort(src["hidden"][0], axis=0))
    for victim, names in victims.items():
        assert sorted(p.name for p in victim.iterdir()) == names, victim  # 15 files, no .lock
