"""``--out hf://datasets/OWNER/NAME``: an extraction written straight to a Hub dataset repo (the
local test server), shards uploaded while the model computes from bounded local staging, the index in the last
commit, a killed run resumed without sending again what is on the Hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from support.datasets import PROMPTS
from support.nodes import Peak
from support.paths import SUPPORT

import lmprobe
from lmprobe.errors import InvalidArgumentError, OutputExistsError, ResumeMismatchError
from lmprobe.format.spec import INDEX_PATH

MANY = [dict(p, text=p["text"] + f" #{i}") for i in range(12) for p in PROMPTS]  # 84 prompts


@pytest.fixture(autouse=True)
def _fast_commits(monkeypatch, tmp_path):
    # the Hub's ~100 commits an hour, on a clock whose hour lasts a second (the local server takes more)
    monkeypatch.setenv("LMPROBE_HUB_HOUR_SECONDS", "1")
    monkeypatch.setenv("LMPROBE_CACHE", str(tmp_path / "cache"))


def _repo(hub, name):
    return hub.state.repos[("dataset", f"user/{name}")]


def _history(repo):
    """The trees of the repo's commits, oldest first."""
    return list(repo.commits.values())


def _uploads(hub) -> list[str]:
    return [path for method, path in hub.state.log if method == "PUT" and "/lfs-upload/" in path]


def _same(a, b, layers):
    assert a.texts == b.texts
    for layer in layers:
        np.testing.assert_array_equal(a.hidden(layer), b.hidden(layer))
        for i in range(a.num_prompts):
            np.testing.assert_array_equal(a.token_hidden(i, layer), b.token_hidden(i, layer))


KW = dict(layers="0,3", storage="full_sequence", shard_size="2KB", batch_size=4, quiet=True)


def test_an_extraction_goes_straight_to_the_hub(hub, llama_dir, tmp_path):
    """The repo ends with the dataset a local extraction writes, the index in the very last commit and in no commit
    whose data files are missing; the local staging held a few shards at a time and is gone at the end."""
    local = lmprobe.extract(str(llama_dir), MANY, out=tmp_path / "local", **{**KW, "batch_size": 1})
    name = f"direct-{uuid.uuid4().hex[:6]}"
    staging = tmp_path / "cache" / "outputs"
    with Peak([staging], every=0.01) as peak:
        # the default checkpoint interval (30 s): shards leave as they close, not at the next checkpoint
        ds = lmprobe.extract(str(llama_dir), MANY, out=f"hf://datasets/user/{name}", **{**KW, "batch_size": 1})
    _same(local, ds, (0, 3))
    _same(local, lmprobe.load(f"hf://datasets/user/{name}"), (0, 3))
    history = _history(_repo(hub, name))
    assert INDEX_PATH in history[-1] and all(INDEX_PATH not in tree for tree in history[:-1])
    assert len(history) > 3  # shards went up in several commits while the model computed, not in one at the end
    shards = sorted(p for p in (tmp_path / "local" / "tensors").rglob("*.safetensors"))
    assert {p.relative_to(tmp_path / "local").as_posix() for p in shards} <= set(history[-1])
    assert not [p for p in history[-1] if ".provisional" in p or ".lmprobe" in p]
    shard = max(p.stat().st_size for p in shards)
    # a few shards per stored site (2 layers): 8 uploading, those the writer closed since its checkpoint, open ones
    total = sum(p.stat().st_size for p in shards)
    assert peak.peak <= 2 * 8 * shard and 3 * peak.peak < total, (peak.peak, shard, total)
    assert not list(staging.rglob("*.safetensors"))


def test_a_killed_extraction_to_the_hub_resumes_without_sending_again(hub, llama_dir, tmp_path):
    """kill -9 halfway; a run with other settings is the one-line error a local folder gives; the same run again
    finishes, equal to an uninterrupted extraction, and uploads only what had not gone up."""
    local = lmprobe.extract(str(llama_dir), MANY, out=tmp_path / "local", **KW)
    name = f"killed-{uuid.uuid4().hex[:6]}"
    url = f"hf://datasets/user/{name}"
    kw = {k: v for k, v in KW.items() if k != "quiet"}
    crashed = subprocess.run([sys.executable, str(SUPPORT / "_crash_extract.py"),
                              json.dumps([MANY, str(llama_dir), url, 6, kw])], capture_output=True, text=True)
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    before = len(_uploads(hub))
    assert before > 0 and INDEX_PATH not in _history(_repo(hub, name))[-1]
    with pytest.raises(ResumeMismatchError) as err:  # as for a local folder
        lmprobe.extract(str(llama_dir), MANY, out=url, **{**KW, "layers": "1"})
    assert "\n" not in str(err.value) and str(err.value).startswith(url) and "layers: [0, 3] -> [1]" in str(err.value)
    ds = lmprobe.extract(str(llama_dir), MANY, out=url, **KW)
    _same(local, ds, (0, 3))
    sent_again = len(_uploads(hub)) - before
    n_files = len([p for p in (tmp_path / "local" / "tensors").rglob("*.safetensors")])
    assert sent_again < n_files - 1, (sent_again, n_files)  # what went up before the kill was not sent again


def test_a_second_run_against_a_finished_repo_does_nothing(hub, llama_dir, tmp_path):
    name = f"twice-{uuid.uuid4().hex[:6]}"
    url = f"hf://datasets/user/{name}"
    lmprobe.extract(str(llama_dir), PROMPTS, out=url, **KW)
    commits = len(_history(_repo(hub, name)))
    lmprobe.extract(str(llama_dir), PROMPTS, out=url, **KW)
    assert len(_history(_repo(hub, name))) == commits
    with pytest.raises(OutputExistsError):
        lmprobe.extract(str(llama_dir), PROMPTS, out=url, **{**KW, "layers": "1"})
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=url, overwrite=True, **{**KW, "layers": "1"})
    assert ds.layers == [1]


def test_a_branch_and_a_folder_of_the_repo(hub, llama_dir, tmp_path):
    name = f"branch-{uuid.uuid4().hex[:6]}"
    lmprobe.extract(str(llama_dir), PROMPTS, out=f"hf://datasets/user/{name}@v2/acts", **KW)
    repo = _repo(hub, name)
    tree = repo.commits[repo.branches["v2"]]
    assert f"acts/{INDEX_PATH}" in tree and INDEX_PATH not in repo.commits[repo.branches["main"]]
    ds = lmprobe.load(f"hf://datasets/user/{name}@v2/acts")
    assert ds.num_prompts == len(PROMPTS)


def test_an_extraction_into_an_open_pull_request_commits_there(hub, llama_dir):
    """``@refs/pr/N``: the commits go to the pull request's ref, which opening the pull request
    made (no branch is created: the Hub refuses a branch named refs/pr/N); main is untouched, and the dataset is
    read back from the pull request."""
    from huggingface_hub import CommitOperationAdd, HfApi

    name = f"pr-{uuid.uuid4().hex[:6]}"
    api = HfApi()
    api.create_repo(f"user/{name}", repo_type="dataset")
    api.create_commit(f"user/{name}", [CommitOperationAdd("notes.txt", b"the owner's")], repo_type="dataset",
                      commit_message="main's own file")
    pr = api.create_pull_request(f"user/{name}", "activations", repo_type="dataset")
    assert pr.git_reference == "refs/pr/1"
    repo = _repo(hub, name)
    main_commit = repo.branches["main"]
    since = len(hub.state.requests)
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=f"hf://datasets/user/{name}@refs/pr/1", **KW)
    assert not [path for _, path, _ in hub.state.requests[since:] if "/branch/" in path]
    assert repo.branches["main"] == main_commit  # main untouched
    assert INDEX_PATH in repo.commits[repo.branches["refs/pr/1"]]
    back = lmprobe.load(f"hf://datasets/user/{name}@refs/pr/1")
    assert back.texts == ds.texts == [p["text"] for p in PROMPTS]
    with pytest.raises(Exception):  # noqa: B017 - main holds no dataset
        lmprobe.load(f"hf://datasets/user/{name}")


@pytest.mark.parametrize("exists", [True, False])
def test_a_pull_request_that_is_not_open_is_refused_before_the_model_is_read(hub, llama_dir, monkeypatch, exists):
    """A ``refs/pr/N`` that does not exist (in a repo, or no repo at all) is one line naming the way out, before the
    model's config is read; nothing is created or committed. A branch that does not exist is still created
    (test_a_branch_and_a_folder_of_the_repo)."""
    from huggingface_hub import HfApi

    from lmprobe.extraction import preparation

    name = f"nopr-{uuid.uuid4().hex[:6]}"
    if exists:
        HfApi().create_repo(f"user/{name}", repo_type="dataset")
    read = []
    monkeypatch.setattr(preparation, "read_model_spec", lambda *a, **k: read.append(1))
    since = len(hub.state.requests)
    with pytest.raises(InvalidArgumentError, match="create_pull_request") as err:
        lmprobe.extract(str(llama_dir), PROMPTS, out=f"hf://datasets/user/{name}@refs/pr/7", **KW)
    assert "\n" not in str(err.value) and "refs/pr/7" in str(err.value) and not read
    assert all(method in ("GET", "HEAD") for method, _, _ in hub.state.requests[since:])
    assert exists == (("dataset", f"user/{name}") in hub.state.repos)
    with pytest.raises(InvalidArgumentError, match="conversion"):  # the Hub's own ref: not one to write to
        lmprobe.extract(str(llama_dir), PROMPTS, out=f"hf://datasets/user/{name}@refs/convert/parquet", **KW)
    assert not read


def test_the_cli_writes_to_the_hub_quietly(hub, llama_dir, tmp_path, capfd):
    from lmprobe.cli import main

    name = f"cli-{uuid.uuid4().hex[:6]}"
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    assert main(["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", f"hf://datasets/user/{name}",
                 "--layers", "1", "--storage", "full_sequence", "--shard-size", "2KB", "--quiet"]) == 0
    out, err = capfd.readouterr()
    assert not out and not err  # --quiet: no bar of ours, nor huggingface_hub's one per uploaded file
    assert lmprobe.load(f"hf://datasets/user/{name}").num_prompts == len(PROMPTS)
    assert not Path("hf:").exists()  # not a local folder named "hf:"


def test_a_model_repo_or_a_bad_rate_is_refused_before_the_model_loads(hub, llama_dir, monkeypatch):
    with pytest.raises(InvalidArgumentError, match="dataset repo"):
        lmprobe.extract(str(llama_dir), PROMPTS, out="hf://user/a-model", **KW)
    monkeypatch.setenv("LMPROBE_HUB_COMMITS_PER_HOUR", "lots")
    with pytest.raises(InvalidArgumentError, match="LMPROBE_HUB_COMMITS_PER_HOUR"):
        lmprobe.extract(str(llama_dir), PROMPTS, out="hf://datasets/user/rate", **KW)


def test_an_extraction_past_the_hubs_folder_limit_is_refused_before_the_model_loads(hub, llama_dir, monkeypatch):
    from lmprobe.extraction import loop, preparation

    loads = []
    for module in (preparation, loop):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: loads.append(1))
    with pytest.raises(InvalidArgumentError, match="10,000 entries a folder") as err:
        lmprobe.extract(str(llama_dir), [f"word {i}" for i in range(30_000)], out="hf://datasets/user/huge",
                        layers="1", storage="full_sequence", shard_size="1KB", quiet=True)
    assert "--shard-size" in str(err.value) and not loads


def test_shards_the_writer_hashed_are_not_read_again_to_hash_them(hub, llama_dir, monkeypatch):
    """The writer hashes every shard as it writes it; the upload takes that hash (huggingface_hub would otherwise
    read each file once more to compute it)."""
    import huggingface_hub.lfs as hf_lfs

    from lmprobe.storage import commits

    hashed = []
    real_sha256_file, real_sha_fileobj = commits.sha256_file, hf_lfs.sha_fileobj
    monkeypatch.setattr(commits, "sha256_file", lambda p: hashed.append(str(p)) or real_sha256_file(p))
    monkeypatch.setattr(hf_lfs, "sha_fileobj", lambda f: hashed.append(f.name) or real_sha_fileobj(f))
    name = f"hashed-{uuid.uuid4().hex[:6]}"
    lmprobe.extract(str(llama_dir), MANY, out=f"hf://datasets/user/{name}", checkpoint_interval=0, **KW)
    shards = [h for h in hashed if h.endswith(".safetensors")]
    n = len([p for p in _repo(hub, name).commits[_repo(hub, name).branches["main"]] if p.endswith(".safetensors")])
    # sequence shards still being hashed when they are handed over are hashed by their upload: a few at most
    assert len(shards) <= n // 4, (len(shards), n)


def test_a_merge_into_a_url_is_refused_not_written_to_a_local_folder_named_like_it(llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "a", layers="0", quiet=True)
    with pytest.raises(InvalidArgumentError, match="local folder.*lmprobe push"):
        lmprobe.merge([ds], "hf://datasets/user/merged")
    assert not Path("hf:").exists()


@pytest.mark.parametrize("when", ["before", "while", "unsent"])
def test_a_run_killed_in_its_commit_tail_finishes_without_extracting_again(hub, llama_dir, tmp_path, monkeypatch,
                                                                          when):
    """Kill -9 after the writer closed (as the final commit starts, while it is sent, or as it starts with the sequence
    shards still staged under their provisional names): the same command again commits what is staged and uploaded,
    without running the model again, and the repo ends with the dataset of an uninterrupted run and no provisional
    file."""
    local = lmprobe.extract(str(llama_dir), MANY, out=tmp_path / "local", **KW)
    name = f"tail-{when}-{uuid.uuid4().hex[:6]}"
    url = f"hf://datasets/user/{name}"
    kw = {k: v for k, v in KW.items() if k != "quiet"}
    crashed = subprocess.run([sys.executable, str(SUPPORT / "_crash_tail.py"),
                              json.dumps([MANY, str(llama_dir), url, when, kw])], capture_output=True, text=True)
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    assert INDEX_PATH not in _history(_repo(hub, name))[-1]
    from lmprobe.extraction import backend_hf

    def no_model(*a, **k):
        raise AssertionError("the model ran again: the re-run extracted what was already staged and uploaded")

    monkeypatch.setattr(backend_hf.TransformersBackend, "run", no_model)
    before = len(_uploads(hub))
    ds = lmprobe.extract(str(llama_dir), MANY, out=url, **KW)
    _same(local, ds, (0, 3))
    tree = _history(_repo(hub, name))[-1]
    assert not [p for p in tree if ".provisional" in p or ".lmprobe" in p]
    again = _uploads(hub)[before:]
    # nothing that went up before the kill went up again (an upload the kill cut short is not on the Hub: it goes again)
    went_up = {p for p in _uploads(hub)[:before] if hub.state.has_lfs(p.rsplit("/", 1)[1])}
    assert not set(again) & went_up
    if when != "unsent":  # (unsent: every sequence shard was still staged)
        assert len(again) <= 8 + 3  # the shards still staged (8 in flight at most), the statistics, card and index


def test_a_run_killed_against_one_hub_does_not_break_the_same_command_against_another(hub, llama_dir, tmp_path,
                                                                                    monkeypatch):
    """The staging folder is keyed by the endpoint as well as the repo: what a run killed against one
    Hub uploaded (its ledger) is not committed by reference to another, which never had it."""
    import os

    import huggingface_hub.constants as constants
    from support.hub_server import HubServer

    name = f"endpoints-{uuid.uuid4().hex[:6]}"
    url = f"hf://datasets/user/{name}"
    kw = {k: v for k, v in KW.items() if k != "quiet"}
    other = HubServer(tmp_path / "other-hub").start()
    try:
        crashed = subprocess.run([sys.executable, str(SUPPORT / "_crash_extract.py"),
                                  json.dumps([MANY, str(llama_dir), url, 6, kw])], capture_output=True, text=True,
                                 env={**os.environ, "HF_ENDPOINT": other.url})
        assert crashed.returncode == 9, crashed.stderr[-3000:]
        assert ("dataset", f"user/{name}") in other.state.repos
    finally:
        other.stop()
    assert constants.ENDPOINT == hub.url
    local = lmprobe.extract(str(llama_dir), MANY, out=tmp_path / "local", **KW)
    _same(local, lmprobe.extract(str(llama_dir), MANY, out=url, **KW), (0, 3))


def test_a_resumed_run_commits_only_what_its_writer_recorded(hub, llama_dir, tmp_path):
    """After a kill, a file in the staging folder that the writer never recorded, and a ledger line
    naming a path the writer never recorded (content on the Hub all the same), are not committed."""
    from lmprobe.storage.outputs import LEDGER, HubOutput

    name = f"foreign-{uuid.uuid4().hex[:6]}"
    url = f"hf://datasets/user/{name}"
    kw = {k: v for k, v in KW.items() if k != "quiet"}
    crashed = subprocess.run([sys.executable, str(SUPPORT / "_crash_extract.py"),
                              json.dumps([MANY, str(llama_dir), url, 6, kw])], capture_output=True, text=True)
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    staging = HubOutput.parse(url).staging()
    foreign = staging / "tensors" / "foreign.safetensors"
    foreign.write_bytes(b"not lmprobe's")
    on_hub = next(e for e in _repo(hub, name).commits[_repo(hub, name).branches["main"]].values() if e.sha256)
    with open(staging / LEDGER, "a") as f:
        f.write(json.dumps({"rel": "tensors/forged.safetensors", "sha256": on_hub.sha256, "size": on_hub.size}) + "\n")
    lmprobe.extract(str(llama_dir), MANY, out=url, **KW)
    tree = _history(_repo(hub, name))[-1]
    assert not [p for p in tree if "foreign" in p or "forged" in p], sorted(tree)


def _identities(hub, since: int) -> set[str | None]:
    """The Authorization header of each Hub API request since ``since`` (the LFS storage's own upload and verify
    URLs are the storage's, presigned on the real Hub: not counted)."""
    return {auth for method, path, auth in hub.state.requests[since:] if "/lfs-upload/" not in path}


def test_the_token_given_is_used_for_every_hub_call_of_the_extraction(hub, llama_dir, monkeypatch, tmp_path):
    """``token=`` (and ``--token``) is the identity of every request of an extraction to the Hub
    (the commits, paths-info, the finished check that opens the dataset): never HF_TOKEN's, never none."""
    from lmprobe.cli.app import main

    monkeypatch.setenv("HF_TOKEN", "hf_other_identity")
    since = len(hub.state.requests)
    lmprobe.extract(str(llama_dir), PROMPTS, out="hf://datasets/user/token-api", token="hf_given_api", **KW)
    assert _identities(hub, since) == {"Bearer hf_given_api"}
    since = len(hub.state.requests)  # again, against what it made: the "already done?" check and nothing else
    lmprobe.extract(str(llama_dir), PROMPTS, out="hf://datasets/user/token-api", token="hf_given_api", **KW)
    assert _identities(hub, since) == {"Bearer hf_given_api"}

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    since = len(hub.state.requests)
    assert main(["extract", "--model", str(llama_dir), "--prompts", str(prompts), "--out", "hf://datasets/user/token-cli", "--token",
                 "hf_given_cli", "--layers", "0,3", "--shard-size", "2KB", "--quiet"]) == 0
    assert _identities(hub, since) == {"Bearer hf_given_cli"}
    assert "hf_given" not in "".join(p.read_text(errors="replace") for p in (tmp_path / "cache").rglob("*")
                                     if p.is_file())


def _host_model_and_corpus(tmp_path, llama_dir, tag: str) -> tuple[str, str]:
    """A model repo (the tiny llama: random weights, a tokenizer trained here) and a corpus dataset repo of two
    parquet files on the local Hub, both private; (model id, corpus id)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from huggingface_hub import HfApi

    api = HfApi(token="hf_owner")
    model, corpus = f"user/tiny-{tag}-{uuid.uuid4().hex[:6]}", f"user/corpus-{tag}-{uuid.uuid4().hex[:6]}"
    api.create_repo(model, repo_type="model", private=True)
    api.upload_folder(folder_path=llama_dir, repo_id=model, repo_type="model")
    api.create_repo(corpus, repo_type="dataset", private=True)
    texts = [p["text"] for p in PROMPTS]
    for k in range(2):  # two files: a corpus is then read piece by piece through HfFileSystem
        f = tmp_path / f"train-{k}.parquet"
        pq.write_table(pa.table({"text": texts[k::2], "label": [p["label"] for p in PROMPTS][k::2]}), f)
        api.upload_file(path_or_fileobj=str(f), path_in_repo=f"data/train-{k:05d}-of-00002.parquet", repo_id=corpus,
                        repo_type="dataset")
    return model, corpus


def _requests_for(hub, since: int, *repos: str) -> list[tuple[str, str, str | None]]:
    return [r for r in hub.state.requests[since:] if any(repo in r[1] for repo in repos)]


def _no_token_in(folder: Path, token: str) -> None:
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert token.encode() not in p.read_bytes(), p


def test_the_token_given_downloads_the_model_and_reads_the_corpus(hub, llama_dir, tmp_path, monkeypatch, capfd,
                                                                  caplog, fresh_hf_cache):
    """``token=`` (and ``--token``) is also the identity of the model's download (config,
    tokenizer, weights) and of an ``hf://`` prompt or corpus source (its listing, its files): never HF_TOKEN's,
    never none. The token is in no file the extraction writes, no log line, no output."""
    import logging

    import huggingface_hub.constants as c

    from lmprobe.cli.app import main

    monkeypatch.setenv("HF_TOKEN", "hf_other_identity")
    monkeypatch.setattr(c, "HF_HUB_DISABLE_IMPLICIT_TOKEN", False)  # as for a user: HF_TOKEN would be sent
    caplog.set_level(logging.DEBUG)
    model, corpus = _host_model_and_corpus(tmp_path, llama_dir, "api")

    since = len(hub.state.requests)
    ds = lmprobe.extract(model, f"hf://datasets/{corpus}", out=tmp_path / "corpus", token="hf_given_api",
                         context_len=8, layers="0,3", quiet=True)
    asked = _requests_for(hub, since, model, corpus)
    assert any("/resolve/" in path and model in path and path.endswith(".safetensors") for _, path, _ in asked)
    assert any(corpus in path and path.endswith(".parquet") for _, path, _ in asked)
    assert {auth for _, _, auth in hub.state.requests[since:]} == {"Bearer hf_given_api"}, [
        r for r in hub.state.requests[since:] if r[2] != "Bearer hf_given_api"]
    assert ds.num_prompts > len(PROMPTS)  # windows of every document

    since = len(hub.state.requests)
    assert main(["extract", "--model", model, "--prompts", f"hf://datasets/{corpus}", "--out", str(tmp_path / "cli"),
                 "--token", "hf_given_cli", "--layers", "1"]) == 0
    assert any(corpus in path for _, path, _ in hub.state.requests[since:])
    assert {auth for _, _, auth in hub.state.requests[since:]} == {"Bearer hf_given_cli"}, [
        r for r in hub.state.requests[since:] if r[2] != "Bearer hf_given_cli"]
    assert lmprobe.load(tmp_path / "cli").num_prompts == len(PROMPTS)

    out, err = capfd.readouterr()
    said = out + err + caplog.text
    for token in ("hf_given_api", "hf_given_cli"):
        assert token not in said
        for folder in (tmp_path / "corpus", tmp_path / "cli", tmp_path / "cache", fresh_hf_cache):
            _no_token_in(folder, token)
    from transformers.utils.hub import hf_api

    assert hf_api().token is None  # lent to transformers' shared client while loading, not left there


@pytest.mark.parametrize("sub", ["/.", "/./sub", "/a//b", "/.lmprobe-parts/part-00000"])
def test_an_odd_folder_is_refused_before_any_work(hub, llama_dir, sub):
    """These ran the whole extraction and then failed, or committed under ``a//b/``, or wrote
    into lmprobe's own parts folder; now one line, no request to the Hub, no weights loaded."""
    since = len(hub.state.requests)
    with pytest.raises(InvalidArgumentError):
        lmprobe.extract(str(llama_dir), PROMPTS, out=f"hf://datasets/user/odd{sub}", **KW)
    assert hub.state.requests[since:] == []


def _plant(repo_id: str, files: dict[str, bytes]) -> None:
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="dataset", exist_ok=True)
    api.create_commit(repo_id, [CommitOperationAdd(k, v) for k, v in files.items()], repo_type="dataset",
                      commit_message="the owner's files")


def test_the_owners_readme_is_kept_and_lmprobes_card_merged_into_it(hub, llama_dir):
    """An extraction into a repo holding the owner's README.md replaced it with the generated card
    (exit 0, not a word); the owner's text and front matter stay, lmprobe's section and keys are merged in, as
    publishing attachments does (docs/security.md: "updated, not replaced")."""
    from lmprobe.format.card import BEGIN

    own = b"---\nlicense: mit\n---\n\n# My activations\n\nCollected by our lab.\n"
    _plant("user/readme-kept", {"README.md": own})
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out="hf://datasets/user/readme-kept", **KW)
    text = hub.read("user/readme-kept", "README.md").decode()
    assert "Collected by our lab." in text and "# My activations" in text and "license: mit" in text
    assert BEGIN in text and "configs:" in text  # lmprobe's section, and the index's config for the viewer
    assert ds.num_prompts == len(PROMPTS)
    # an overwrite keeps it too, with one lmprobe section
    lmprobe.extract(str(llama_dir), PROMPTS, out="hf://datasets/user/readme-kept", overwrite=True,
                    **{**KW, "layers": "0"})
    text = hub.read("user/readme-kept", "README.md").decode()
    assert "Collected by our lab." in text and text.count(BEGIN) == 1


def test_an_overwrite_with_fewer_layers_removes_the_old_layers_shards(hub, llama_dir):
    """``--overwrite`` with fewer layers left the old layers' shards in the repo, outside the new
    index; they go in the overwrite, and only files the old index named (the owner's files stay)."""
    _plant("user/fewer", {"tensors/owners-notes.txt": b"mine\n", "data.csv": b"a,b\n"})
    lmprobe.extract(str(llama_dir), PROMPTS, out="hf://datasets/user/fewer", **KW)
    old = {p for p in hub.files("user/fewer") if p.endswith(".safetensors")}
    assert any("layer003" in p for p in old)
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out="hf://datasets/user/fewer", overwrite=True,
                         **{**KW, "layers": "0"})
    files = set(hub.files("user/fewer"))
    assert {p for p in files if p.endswith(".safetensors")} == {r.rel for r in ds.meta.files()
                                                                  if r.rel.endswith(".safetensors")}
    assert {"tensors/owners-notes.txt", "data.csv"} <= files


def _change_weights(folder: Path) -> None:
    """The same folder, the same shapes and file sizes, other weights (a fine-tune saved over the old one)."""
    from safetensors.torch import load_file, save_file

    for f in folder.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v + 0.5 for k, v in tensors.items()}, f, metadata={"format": "pt"})


@pytest.mark.slow
@pytest.mark.parametrize("where", ["hub", "local"])
def test_a_resume_over_changed_weights_is_refused(hub, llama_dir, tmp_path, where):
    """A killed run from a local model folder, re-run after the weights in that folder changed,
    resumed and published a mix (13 of 40 rows from the new weights): a local model has no commit, so its weights
    are fingerprinted (safetensors headers, sizes, modification times) and a resume over others is refused in one
    line; the finished dataset is not taken for this extraction either."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    out = f"hf://datasets/user/weights-{uuid.uuid4().hex[:6]}" if where == "hub" else str(tmp_path / "out")
    kw = {k: v for k, v in KW.items() if k != "quiet"}
    crashed = subprocess.run([sys.executable, str(SUPPORT / "_crash_extract.py"), json.dumps([MANY, str(model), out, 6,
                                                                                          kw])],
                             capture_output=True, text=True)
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    _change_weights(model)
    with pytest.raises(ResumeMismatchError) as err:
        lmprobe.extract(str(model), MANY, out=out, **KW)
    assert "\n" not in str(err.value) and "weights" in str(err.value) and "--overwrite" in str(err.value)
    ds = lmprobe.extract(str(model), MANY, out=out, overwrite=True, **KW)  # the way out it names
    fresh = lmprobe.extract(str(model), MANY, out=tmp_path / "fresh", **KW)
    _same(fresh, ds, (0, 3))
    _change_weights(model)
    with pytest.raises(OutputExistsError):  # a finished dataset of the old weights is not this extraction
        lmprobe.extract(str(model), MANY, out=out, **KW)


def test_a_killed_extraction_resumes_on_another_machine_from_its_checkpoint_on_the_hub(hub, llama_dir, tmp_path,
                                                                                      monkeypatch):
    """One process: kill -9 once its checkpoint's copy is on the Hub, then the same command on a
    machine that holds nothing of it (another cache): it resumes from the copy, the result equals an uninterrupted
    run, the model ran for fewer batches than a whole run, and the copy is gone from the repo."""
    from lmprobe.extraction import backend_hf

    local = lmprobe.extract(str(llama_dir), MANY, out=tmp_path / "local", **KW)
    name = f"elsewhere-{uuid.uuid4().hex[:6]}"
    url = f"hf://datasets/user/{name}"
    kw = {k: v for k, v in KW.items() if k != "quiet"}
    crashed = subprocess.run([sys.executable, str(SUPPORT / "_crash_extract.py"),
                              json.dumps([MANY, str(llama_dir), url, 19, kw])], capture_output=True, text=True)
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    assert ".lmprobe-resume/checkpoint.parquet" in _history(_repo(hub, name))[-1]
    monkeypatch.setenv("LMPROBE_CACHE", str(tmp_path / "another-machine"))
    real, calls = backend_hf.TransformersBackend.run, [0]

    def counted(self, *a, **k):
        calls[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(backend_hf.TransformersBackend, "run", counted)
    ds = lmprobe.extract(str(llama_dir), MANY, out=url, **KW)
    assert 0 < calls[0] < len(MANY) // KW["batch_size"], calls  # the rows of the copy are not computed again
    _same(local, ds, (0, 3))
    assert not [p for p in _history(_repo(hub, name))[-1] if ".lmprobe" in p]


CORPUS_KW = dict(context_len=10, max_tokens=1000, storage="full_sequence", token_ids=True, layers="0,2",
                 batch_size=2, shard_size="2KB")


def _corpus_folder(tmp_path: Path) -> Path:
    """A local corpus of three parquet files (of two row groups each): a source dealt by piece."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [p["text"] + f" number {i} of the corpus, with a few more words to make windows." for i in range(8)
            for p in PROMPTS]
    folder = tmp_path / "corpus"
    folder.mkdir()
    for k in range(3):
        pq.write_table(pa.table({"text": docs[k::3]}), folder / f"train-{k}.parquet", row_group_size=10)
    return folder


def _shard_hashes(hub, name):
    tree = _history(_repo(hub, name))[-1]
    return {p: e.sha256 for p, e in tree.items() if p.endswith(".safetensors")}


@pytest.mark.slow
def test_a_killed_corpus_extraction_resumes_on_another_machine_from_its_checkpoint_on_the_hub(
        hub, llama_dir, tmp_path, monkeypatch, capfd):
    """A corpus job (a local multi-file parquet source, an exact --max-tokens), one process:
    killed once its checkpoint's copy is on the Hub, then the same command with another cache (a machine that
    holds nothing of it). It resumes after the copy's rows, replaying the source from where the shards the copy
    left open began, and the dataset equals an uninterrupted run's: the same index rows, shard for shard the same
    bytes."""
    import re

    folder = _corpus_folder(tmp_path)
    whole, name = f"corpus-whole-{uuid.uuid4().hex[:6]}", f"corpus-moved-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("LMPROBE_CACHE", str(tmp_path / "uninterrupted"))
    ref = lmprobe.extract(str(llama_dir), str(folder), out=f"hf://datasets/user/{whole}", checkpoint_interval=0,
                          quiet=True, **CORPUS_KW)
    assert int(ref.column("num_tokens").sum()) == CORPUS_KW["max_tokens"]
    env = {"LMPROBE_CACHE": str(tmp_path / "first-machine")}
    # killed right after the commit that lands a copy of 24 rows or more: more than the 15 windows of a last-token
    # shard (2KB of 32 float32 dims), so the copy holds closed shards of every series
    crashed = subprocess.run([sys.executable, str(SUPPORT / "_crash_after_copy.py"),
                              json.dumps([str(folder), str(llama_dir), f"hf://datasets/user/{name}", 24,
                                          CORPUS_KW])],
                             capture_output=True, text=True, env={**os.environ, **env})
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    assert ".lmprobe-resume/checkpoint.parquet" in _history(_repo(hub, name))[-1]
    monkeypatch.setenv("LMPROBE_CACHE", str(tmp_path / "another-machine"))
    from lmprobe.base.progress import messages_shown

    capfd.readouterr()
    with messages_shown():
        ds = lmprobe.extract(str(llama_dir), str(folder), out=f"hf://datasets/user/{name}", checkpoint_interval=0,
                             **CORPUS_KW)
    err = capfd.readouterr().err
    said = re.search(r"resuming after (\d+) rows \(([\d,]+) tokens\), recomputing the last (\d+) rows", err)
    assert said, err[-2000:]
    rows, tokens, again = int(said.group(1)), int(said.group(2).replace(",", "")), int(said.group(3))
    assert rows >= 24 and tokens > 0 and rows - again >= 10, said.group(0)  # the closed shards' rows: not again
    assert ds.index.equals(ref.index)
    hashes = _shard_hashes(hub, whole)
    assert len(hashes) > 10 and _shard_hashes(hub, name) == hashes
    assert not [p for p in _history(_repo(hub, name))[-1] if ".lmprobe" in p]
