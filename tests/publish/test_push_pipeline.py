"""A push that keeps up: parallel uploads pipelined with commits, no second hashing, one tree
listing per push, rate limits waited out, the incremental API a writer feeds shard by shard, the Xet
upload path, and server-side renames (copy + delete) without a re-upload. All against the local Hub."""

from __future__ import annotations

import logging
import shutil
import time
import uuid
import zlib

import numpy as np
import pytest
from support.datasets import write_dataset

import lmprobe
from lmprobe import push_to_hub
from lmprobe.errors import InvalidArgumentError, PushError
from lmprobe.format.reader import open_local
from lmprobe.format.spec import CARD_PATH, INDEX_PATH
from lmprobe.publish.push import dataset_files
from lmprobe.storage.commits import HubCommitter, PushConfig, RepoFile


def repo_name():
    return f"tester/push-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def dataset(tmp_path, request):
    """A dataset of its own per test: the server's object store is shared, and holds what other tests sent."""
    rng = np.random.default_rng(zlib.crc32(request.node.name.encode()))
    src = write_dataset(tmp_path / "ds", rng, n=30, layers=(0, 2, 5), dim=8, shard_size="160B", logits_topk=3)
    return tmp_path / "ds", src


@pytest.fixture
def xet(monkeypatch):
    """The Xet path on (conftest turns it off for every other test): uploads and downloads go through hf_xet."""
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", False)


@pytest.fixture
def slow_hub(hub):
    yield hub
    hub.throttle_uploads(None)
    hub.delay_commits(0.0)
    hub.clear_faults()


def requests(hub, start, method, fragment):
    return [p for m, p in hub.log[start:] if m == method and fragment in p]


def test_push_config_names_a_bad_setting():
    with pytest.raises(InvalidArgumentError, match="commit_files must be an integer >= 1"):
        PushConfig(commit_files=0)
    with pytest.raises(InvalidArgumentError, match="commit_deadline must be >= 0 seconds"):
        PushConfig(commit_deadline=-1)
    assert PushConfig(commit_files=50).in_flight == 100 and PushConfig(commit_files=50).first_commit_files() == 50
    # by default huggingface_hub's ladder decides: 250 first, up to 1,000
    assert PushConfig().first_commit_files() == 250 and PushConfig().in_flight == 2000
    assert PushConfig().next_commit_files(1000, 1.0) == 1000 and PushConfig(commit_files=300).next_commit_files(250, 1.0) == 300


def test_uploads_run_in_parallel_while_commits_land(slow_hub, tmp_path, rng):
    hub = slow_hub
    path = tmp_path / "big"
    src = write_dataset(path, rng, n=400, layers=(0, 1, 2, 3), dim=128, shard_size="50KB")
    hub.throttle_uploads(2e6)  # one shared uplink: each 50 KB shard takes >= 25 ms on it
    hub.delay_commits(0.3)  # the Hub's commit latency
    start = len(hub.state.spans)
    repo = repo_name()
    push_to_hub(path, repo, commit_files=4, workers=4, quiet=True)
    spans = hub.state.spans[start:]
    uploads = [(a, b) for kind, a, b in spans if kind == "upload"]
    commits = [(a, b) for kind, a, b in spans if kind == "commit"]
    assert len(uploads) == len(dataset_files(open_local(path))) + 1  # the shards and the index (LFS)
    most_at_once = max(sum(1 for a, b in uploads if a <= t < b) for t, _ in uploads)
    assert most_at_once >= 2, "uploads ran one at a time"
    during_commit = [u for u in uploads if any(a < u[1] and u[0] < b for a, b in commits)]
    assert during_commit, "no upload ran while a commit was landing: nothing is pipelined"
    np.testing.assert_array_equal(lmprobe.load(repo).hidden(3), src["hidden"][3])


def test_recorded_hashes_are_never_computed_again(hub, dataset, monkeypatch):
    """The writer hashed every shard as it wrote it: neither lmprobe nor huggingface_hub reads one to hash it."""
    import huggingface_hub.lfs as hf_lfs

    from lmprobe.storage import commits

    path, _ = dataset
    hashed = []
    real_sha256_file, real_sha_fileobj = commits.sha256_file, hf_lfs.sha_fileobj
    monkeypatch.setattr(commits, "sha256_file", lambda p: hashed.append(str(p)) or real_sha256_file(p))
    monkeypatch.setattr(hf_lfs, "sha_fileobj", lambda f: hashed.append(f.name) or real_sha_fileobj(f))
    repo = repo_name()
    push_to_hub(path, repo, quiet=True)
    assert [h for h in hashed if "tensors" in h] == []
    assert len(hashed) == 1 and hashed[0].endswith(INDEX_PATH)  # no hash recorded: the LFS upload needs one
    hashed.clear()
    push_to_hub(path, repo, quiet=True)  # a re-run compares: still no shard is read
    assert [h for h in hashed if "tensors" in h] == [] and len(hashed) == 1  # the index, to compare


def test_one_listing_per_push_and_a_retried_commit_asks_only_for_its_own_files(hub, dataset, monkeypatch):
    from huggingface_hub import HfApi

    path, src = dataset
    asked = []
    real = HfApi.get_paths_info
    monkeypatch.setattr(HfApi, "get_paths_info", lambda self, repo_id, paths, **kw: asked.append(list(paths))
                        or real(self, repo_id, paths, **kw))
    repo = repo_name()
    n = len(dataset_files(open_local(path)))
    hub.lose_commit_answers(1)  # the first commit lands, its answer is lost
    hub.fail("POST", r"/commit/", 503, times=1, skip=2)  # a later commit fails before it is applied
    start = len(hub.log)
    push_to_hub(path, repo, commit_files=4, quiet=True, base_wait=0.01)
    hub.clear_faults()
    assert len(requests(hub, start, "GET", "/tree/")) == 1  # one listing for the whole push, retries included
    assert len(asked) == 2 and all(len(paths) <= 4 for paths in asked)  # each check names one commit's files
    assert hub.commits(repo) == 1 + -(-n // 4) + 1  # initial, the shard commits (none twice), index and card
    np.testing.assert_array_equal(lmprobe.load(repo).hidden(5), src["hidden"][5])


def test_commit_rate_limits_are_waited_out_as_asked_and_said(hub, dataset, caplog):
    path, src = dataset
    repo = repo_name()
    hub.fail("POST", r"/commit/", 429, times=2, headers={"Retry-After": "1"})
    start, t0 = len(hub.log), time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lmprobe.storage.commits"):
        push_to_hub(path, repo, commit_files=100, quiet=True, base_wait=0.01)
    hub.clear_faults()
    assert time.monotonic() - t0 >= 2.0  # Retry-After: 1, twice (base_wait alone would be 0.03 s)
    waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert len(waits) == 2 and all("the Hub's rate limit" in w and "waiting 1s" in w for w in waits), waits
    assert "committing" in waits[0] and repo in waits[0]
    # initial, then the shards with the index and card (fewer than commit_files: one commit, the index in it); a
    # refused commit is not made twice
    assert hub.commits(repo) == 2
    assert requests(hub, start, "POST", "/paths-info/") == []  # a 429 was a refusal: nothing to check
    np.testing.assert_array_equal(lmprobe.load(repo).hidden(0), src["hidden"][0])


def test_a_rate_limit_past_the_deadline_is_a_push_error_that_says_so(hub, dataset):
    path, _ = dataset
    repo = repo_name()
    hub.fail("POST", r"/commit/", 429, times=1000, headers={"Retry-After": "1"})
    t0 = time.monotonic()
    try:
        with pytest.raises(PushError, match=r"rate limit held for longer than commit_deadline=2s.*Run the same push"):
            push_to_hub(path, repo, quiet=True, base_wait=0.01, commit_deadline=2)
    finally:
        hub.clear_faults()
    assert time.monotonic() - t0 < 10
    assert "index/train-00000-of-00001.parquet" not in hub.files(repo)
    push_to_hub(path, repo, quiet=True)  # the same push, once the Hub lets us: completes
    assert "index/train-00000-of-00001.parquet" in hub.files(repo)


def test_a_refused_upload_stops_the_push_with_the_reason(hub, dataset):
    path, _ = dataset
    repo = repo_name()
    hub.fail("PUT", r"/lfs-upload/", 403, times=1000)
    try:
        with pytest.raises(PushError, match=r"uploading tensors/.* failed .*403"):
            push_to_hub(path, repo, quiet=True)
    finally:
        hub.clear_faults()
    assert set(hub.files(repo)) == {".gitattributes"}


def test_a_writer_feeds_files_one_by_one_and_deletes_each_once_it_landed(hub, dataset, tmp_path):
    """The extraction sink's use: shards handed over as they close, a bounded number in flight, each local
    copy deleted once the commit holding it has landed, the index and card last."""
    path, src = dataset
    staging = tmp_path / "staging"
    shutil.copytree(path, staging)
    files = dataset_files(open_local(staging))
    repo = repo_name()
    landed: list[str] = []

    def on_landed(done):
        for f in done:
            entry = hub.files(repo).get(f.rel)
            assert entry is not None and entry.sha256 == f.sha256, f"{f.rel} reported before it was on the Hub"
            f.local.unlink()
            landed.append(f.rel)

    start = len(hub.log)
    committer = HubCommitter(repo, token=None, config=PushConfig(commit_files=3, max_in_flight=4, workers=2),
                             on_landed=on_landed)
    committer.prepare(private=False)
    with committer:
        committer.start()
        most = 0
        for f in files:
            committer.add(f)
            most = max(most, sum(1 for g in files[: files.index(f) + 1] if g.rel not in landed))
        committer.flush()
        assert sorted(landed) == sorted(f.rel for f in files) and not any(f.local.exists() for f in files)
        assert "index/train-00000-of-00001.parquet" not in hub.files(repo)
        result = committer.finish(last=[RepoFile(CARD_PATH, staging / CARD_PATH),
                                        RepoFile(INDEX_PATH, staging / INDEX_PATH)])
    assert most <= 4  # never more than max_in_flight files staged and not landed
    assert result.sent == len(files) + 2 and result.skipped == 0
    repo_state = hub.state.repos[("dataset", repo)]
    trees = list(repo_state.commits.values())
    assert INDEX_PATH in trees[-1] and all(INDEX_PATH not in t for t in trees[:-1])
    assert all(len(set(b) - set(a)) <= 3 for a, b in zip(trees, trees[1:], strict=False))  # commits of <= 3 files
    assert len(requests(hub, start, "GET", "/tree/")) == 1
    np.testing.assert_array_equal(lmprobe.load(repo).hidden(2), src["hidden"][2])


def test_a_lone_file_is_committed_after_commit_interval_without_a_flush(hub, tmp_path):
    """A writer that closes a shard now and then: its staged copy is freed within commit_interval."""
    repo = repo_name()
    (tmp_path / "a.safetensors").write_bytes(b"x" * 1000)
    landed = []
    committer = HubCommitter(repo, token=None, config=PushConfig(commit_interval=0.3), on_landed=landed.extend)
    committer.prepare(private=False)
    with committer:
        committer.start()
        committer.add(RepoFile("tensors/a.safetensors", tmp_path / "a.safetensors"))
        deadline = time.monotonic() + 10
        while not landed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [f.rel for f in landed] == ["tensors/a.safetensors"] and "tensors/a.safetensors" in hub.files(repo)


def test_ranks_push_to_one_branch_at_once(hub, tmp_path):
    """Several processes (torchrun ranks) each with a committer of their own, the same repo and branch."""
    import threading

    repo = repo_name()
    HubCommitter(repo, token=None).prepare(private=False)
    blobs = {f"tensors/r{r}_{i:03d}.safetensors": np.random.default_rng([r, i, 7]).bytes(3000) for r in range(3)
             for i in range(7)}
    for rel, data in blobs.items():
        (tmp_path / rel.split("/")[1]).write_bytes(data)
    errors = []

    def rank(r):
        try:
            with HubCommitter(repo, token=None, config=PushConfig(commit_files=2, workers=2)) as c:
                c.start()
                for rel in blobs:
                    if rel.startswith(f"tensors/r{r}_"):
                        c.add(RepoFile(rel, tmp_path / rel.split("/")[1]))
                c.finish()
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {rel: hub.read(repo, rel) for rel in blobs} == blobs


def test_add_refuses_a_missing_file_before_sending_it(hub, tmp_path):
    repo = repo_name()
    committer = HubCommitter(repo, token=None)
    committer.prepare(private=False)
    with committer:
        committer.start()
        with pytest.raises(PushError, match="missing"):
            committer.add(RepoFile("tensors/x.safetensors", tmp_path / "nope.safetensors"))


# ---------------------------------------------------------------------------------------------- Xet


class SpySession:
    """hf_xet's session, recording the sha256 argument of every file upload."""

    def __init__(self, inner, seen):
        self.inner, self.seen = inner, seen

    def new_upload_commit(self, **kw):
        return SpyCommit(self.inner.new_upload_commit(**kw), self.seen)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class SpyCommit:
    def __init__(self, inner, seen):
        self.inner, self.seen = inner, seen

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def start_upload_file(self, path, sha256):
        self.seen[path] = sha256
        return self.inner.start_upload_file(path, sha256=sha256)


def test_a_push_through_xet_loads_back_exactly(hub, dataset, xet, fresh_hf_cache, monkeypatch):
    import hf_xet
    import huggingface_hub.constants as c
    import huggingface_hub.utils._xet as hf_xet_utils

    path, src = dataset
    recorded = {str(f.local): f.sha256 for f in dataset_files(open_local(path))}
    seen: dict[str, object] = {}
    real = hf_xet_utils.get_xet_session
    monkeypatch.setattr(hf_xet_utils, "get_xet_session", lambda: SpySession(real(), seen))
    repo = repo_name()
    cas_before = hub.state.xet.n_objects()
    start = len(hub.log)
    push_to_hub(path, repo, quiet=True)
    # uploaded through hf_xet into the CAS, none through LFS; each shard with the sha256 the writer recorded
    assert requests(hub, start, "PUT", "/lfs-upload/") == [] and requests(hub, start, "POST", "/objects/batch") == []
    assert requests(hub, start, "GET", "/xet-write-token/main")
    assert hub.state.xet.n_objects() > cas_before
    shards = {p: s for p, s in seen.items() if "tensors" in p}
    assert shards == recorded and hf_xet.COMPUTE_SHA256 not in shards.values()
    files = hub.files(repo)
    assert all(files[f].xet_hash for f in files if f.startswith("tensors/"))
    # read back: the shards come from the CAS through hf_xet, not over HTTP from the server
    start = len(hub.log)
    ds = lmprobe.load(repo)
    for layer in (0, 2, 5):
        np.testing.assert_array_equal(ds.hidden(layer), src["hidden"][layer])
    np.testing.assert_array_equal(ds.logits_topk()[0], src["lv"])
    assert [p for p in requests(hub, start, "GET", "/resolve/") if "tensors/" in p] == []
    assert requests(hub, start, "GET", "/xet-read-token/")
    # a client without hf_xet reads the same repo over plain HTTP: the same bytes
    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(fresh_hf_cache.parent / "plain-cache"))
    np.testing.assert_array_equal(lmprobe.load(repo).hidden(5), src["hidden"][5])
    # a re-run sends nothing: the listing's sha256 of Xet files match the recorded ones
    start = len(hub.log)
    push_to_hub(path, repo, quiet=True)
    assert requests(hub, start, "POST", "/commit/") == [] and requests(hub, start, "GET", "/xet-write-token/") == []


@pytest.mark.parametrize("through", ["lfs", "xet"])
def test_copy_and_delete_rename_files_server_side_without_uploading_again(hub, tmp_path, monkeypatch, through):
    """The multi-node merge renames each rank's shards into the global numbering with copy + delete
    commits, from the same branch or from a rank's branch (src_revision): no byte is uploaded again."""
    import huggingface_hub.constants as c
    from huggingface_hub import CommitOperationAdd, CommitOperationCopy, CommitOperationDelete, HfApi

    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", through == "lfs")
    api = HfApi()
    repo = repo_name()
    api.create_repo(repo, repo_type="dataset")
    api.create_branch(repo, repo_type="dataset", branch="rank-1")
    blobs = {name: np.random.default_rng([i, through == "xet"]).bytes(20_000 + i) for i, name in enumerate("abc")}
    for name, data in blobs.items():
        (tmp_path / f"{name}.safetensors").write_bytes(data)
    add = [CommitOperationAdd(f"parts/0/{n}.safetensors", str(tmp_path / f"{n}.safetensors")) for n in "ab"]
    api.create_commit(repo, add, commit_message="rank 0", repo_type="dataset")
    api.create_commit(repo, [CommitOperationAdd("parts/1/c.safetensors", str(tmp_path / "c.safetensors"))],
                      commit_message="rank 1", repo_type="dataset", revision="rank-1")
    cas, start = hub.state.xet.n_objects(), len(hub.log)
    ops = [CommitOperationCopy("parts/0/a.safetensors", "tensors/x_shard00000.safetensors"),
           CommitOperationCopy("parts/0/b.safetensors", "tensors/x_shard00001.safetensors"),
           CommitOperationCopy("parts/1/c.safetensors", "tensors/x_shard00002.safetensors", src_revision="rank-1"),
           CommitOperationDelete("parts/")]
    api.create_commit(repo, ops, commit_message="merge: rename into the global numbering", repo_type="dataset")
    uploads = (requests(hub, start, "PUT", "/lfs-upload/") + requests(hub, start, "POST", "/objects/batch")
               + requests(hub, start, "GET", "/xet-write-token/"))
    assert uploads == [] and hub.state.xet.n_objects() == cas  # nothing sent, nothing new in the CAS
    assert len(requests(hub, start, "POST", "/commit/")) == 1
    files = hub.files(repo)
    assert sorted(p for p in files if p != ".gitattributes") == [f"tensors/x_shard0000{i}.safetensors" for i in range(3)]
    for i, name in enumerate("abc"):
        assert hub.read(repo, f"tensors/x_shard0000{i}.safetensors") == blobs[name]
        assert bool(files[f"tensors/x_shard0000{i}.safetensors"].xet_hash) == (through == "xet")
    assert "parts/1/c.safetensors" in hub.files(repo, rev="rank-1")  # the source branch is untouched


def test_the_server_refuses_a_copy_of_an_object_it_does_not_hold(hub):
    import httpx2
    from huggingface_hub import HfApi

    repo = repo_name()
    HfApi().create_repo(repo, repo_type="dataset")
    body = ('{"key": "header", "value": {"summary": "x"}}\n'
            '{"key": "lfsFile", "value": {"path": "a.safetensors", "algo": "sha256", "oid": "' + "1" * 64 + '"}}\n')
    r = httpx2.post(f"{hub.url}/api/datasets/{repo}/commit/main", content=body.encode(),
                    headers={"Content-Type": "application/x-ndjson"})
    assert r.status_code == 422 and "does not exist" in r.text


def test_push_command_takes_workers_and_a_commit_deadline(hub, dataset, capsys):
    from lmprobe.cli import main as cli_main

    path, src = dataset
    repo = repo_name()
    assert cli_main(["push", str(path), repo, "--commit-deadline", "-1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "commit_deadline must be >= 0 seconds" in err and len(err.splitlines()) == 1, err
    assert cli_main(["push", str(path), repo, "--workers", "2", "--commit-deadline", "60", "--quiet"]) == 0
    np.testing.assert_array_equal(lmprobe.load(repo).hidden(2), src["hidden"][2])
