"""Publishing and loading against a Hub-compatible server on 127.0.0.1, with the real huggingface_hub client."""

from __future__ import annotations

import json
import re
import uuid

import numpy as np
import pytest
from support.datasets import PROMPTS, write_dataset
from support.paths import ROOT

import lmprobe
from lmprobe import push_to_hub
from lmprobe.cli import main as cli_main
from lmprobe.errors import InvalidArgumentError, LmprobeError, PushError
from lmprobe.format.spec import INDEX_PATH

TOKEN = "hf_testSECRETtoken1234567890"


def repo_name():
    return f"tester/acts-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def dataset(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=30, layers=(0, 2, 5), dim=8, shard_size="160B", logits_topk=3)
    return tmp_path / "ds", src


def test_push_then_load_only_fetches_what_a_call_needs(hub, dataset, fresh_hf_cache):
    path, src = dataset
    repo = repo_name()
    url = push_to_hub(path, repo, token=TOKEN, quiet=True)
    assert url.endswith(f"/datasets/{repo}")
    files = hub.files(repo)
    assert "index/train-00000-of-00001.parquet" in files and "README.md" in files
    assert not any(".lmprobe-staging" in p for p in files)
    start = len(hub.log)
    ds = lmprobe.load(repo)
    np.testing.assert_array_equal(ds.hidden(2), src["hidden"][2])
    fetched = [p for m, p in hub.log[start:] if m == "GET" and "/resolve/" in p]
    shards = [p for p in fetched if "tensors/" in p]
    assert shards and all("hidden_layer002" in p for p in shards), fetched
    assert len(shards) == len(ds.info["tensors"]["hidden_layers"]["shards"])
    values, _ = lmprobe.load(f"hf://datasets/{repo}", revision="main").logits_topk()
    np.testing.assert_array_equal(values, src["lv"])


def test_token_is_sent_but_never_printed_or_stored(hub, dataset, capsys, tmp_path):
    path, _ = dataset
    repo = repo_name()
    assert cli_main(["push", str(path), repo, "--token", TOKEN]) == 0
    assert any(TOKEN in h for h in hub.state.auth_headers)
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err and "pushed" in out.err  # the result line, from the lmprobe logger
    for p in list(path.rglob("*")) + list(tmp_path.rglob("*")):
        if p.is_file() and p.stat().st_size < 50_000_000:
            assert TOKEN.encode() not in p.read_bytes(), p


def test_commits_are_bounded_and_the_index_comes_last(hub, dataset):
    path, _ = dataset
    repo = repo_name()
    n_shard_files = sum(1 for _ in (path / "tensors").iterdir())
    before = len(hub.log)
    push_to_hub(path, repo, commit_files=4, quiet=True)
    commits = [p for m, p in hub.log[before:] if m == "POST" and "/commit/" in p]
    assert len(commits) == -(-n_shard_files // 4) + 1
    assert hub.commits(repo) == len(commits) + 1  # + the repo's initial commit
    # every commit before the last one holds shards only: never an index pointing at missing shards
    repo_state = hub.state.repos[("dataset", repo)]
    order = list(repo_state.commits)
    for c in order[:-1]:
        assert "index/train-00000-of-00001.parquet" not in repo_state.commits[c]


def test_rerun_skips_files_already_there(hub, dataset):
    path, _ = dataset
    repo = repo_name()
    push_to_hub(path, repo, quiet=True)
    before = len(hub.log)
    push_to_hub(path, repo, quiet=True)
    assert not [p for m, p in hub.log[before:] if "/commit/" in p or "lfs" in p]


@pytest.mark.slow
def test_transient_errors_are_retried(hub, dataset):
    path, src = dataset
    repo = repo_name()
    hub.fail("POST", r"/commit/", 500, times=1)
    hub.fail("POST", r"/preupload/", 429, times=1)
    hub.cut_upload(times=1, after_bytes=50)
    push_to_hub(path, repo, quiet=True, base_wait=0.05)
    hub.clear_faults()
    ds = lmprobe.load(repo)
    np.testing.assert_array_equal(ds.hidden(5), src["hidden"][5])


def test_a_failed_push_leaves_shards_only_and_a_second_run_completes(hub, dataset, capsys):
    path, src = dataset
    repo = repo_name()
    n = sum(1 for _ in (path / "tensors").iterdir())
    hub.fail("POST", r"/commit/", 503, times=1000, skip=1)  # the first commit lands, then the Hub is down
    with pytest.raises(PushError, match="Run the same push again to resume"):
        push_to_hub(path, repo, commit_files=5, quiet=True, base_wait=0.01, max_retries=2)
    hub.clear_faults()
    files = hub.files(repo)
    assert "index/train-00000-of-00001.parquet" not in files and 0 < sum(p.startswith("tensors/") for p in files) < n
    before = len(hub.log)
    push_to_hub(path, repo, commit_files=5, quiet=True)
    commits = [p for m, p in hub.log[before:] if m == "POST" and "/commit/" in p]
    # the first commit's 5 shards are skipped, the rest go up 5 a commit, the index and card in the last one
    assert len(commits) == -(-(n - 5 + 2) // 5)
    assert len(hub.files(repo)) == n + 3  # shards, index, card, .gitattributes
    np.testing.assert_array_equal(lmprobe.load(repo).hidden(0), src["hidden"][0])


def test_commit_naming_a_missing_lfs_object_is_rejected_by_the_server(hub):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    repo = repo_name()
    api = HfApi()
    api.create_repo(repo, repo_type="dataset")
    import httpx2

    body = (json.dumps({"key": "header", "value": {"summary": "x"}}) + "\n"
            + json.dumps({"key": "lfsFile", "value": {"path": "a.safetensors", "algo": "sha256", "oid": "0" * 64,
                                                      "size": 3}}) + "\n")
    r = httpx2.post(f"{hub.url}/api/datasets/{repo}/commit/main", content=body.encode(),
                    headers={"Content-Type": "application/x-ndjson"})
    assert r.status_code == 422 and "does not exist" in r.text
    with pytest.raises(HfHubHTTPError):
        list(api.list_repo_tree(repo, repo_type="dataset", path_in_repo="a.safetensors"))


def test_a_commit_whose_answer_is_lost_is_not_made_twice(hub, dataset):
    path, src = dataset
    repo = repo_name()
    hub.lose_commit_answers(1)
    push_to_hub(path, repo, commit_files=100, quiet=True, base_wait=0.01)
    hub.clear_faults()
    assert hub.commits(repo) == 2  # initial, then shards, index and card in one commit (made once)
    np.testing.assert_array_equal(lmprobe.load(repo).hidden(0), src["hidden"][0])


def test_pull_copies_only_one_layer(hub, dataset, tmp_path, capsys):
    path, src = dataset
    repo = repo_name()
    push_to_hub(path, repo, quiet=True)
    assert cli_main(["pull", repo, "--layers", "2", "--out", str(tmp_path / "local"), "--no-logits"]) == 0
    local = tmp_path / "local"
    names = sorted(p.name for p in (local / "tensors").iterdir())
    assert names and all(n.startswith("hidden_layer002") for n in names)
    np.testing.assert_array_equal(lmprobe.load(local).hidden(2), src["hidden"][2])
    with pytest.raises(FileNotFoundError, match="hidden_layer000"):
        lmprobe.load(local).hidden(0)


def test_missing_repo_is_a_clear_error(hub):
    with pytest.raises(FileNotFoundError, match="no dataset repo 'nobody/nothing'"):
        lmprobe.load("nobody/nothing")


def test_index_reads_with_pandas_pyarrow_and_datasets(hub, dataset):
    path, src = dataset
    repo = repo_name()
    push_to_hub(path, repo, quiet=True)
    import pandas as pd

    df = pd.read_parquet(f"hf://datasets/{repo}/index/train-00000-of-00001.parquet")
    assert df["text"].tolist() == src["texts"]
    import pyarrow.parquet as pq
    from huggingface_hub import HfFileSystem

    t = pq.read_table(f"datasets/{repo}/index/train-00000-of-00001.parquet", filesystem=HfFileSystem())
    assert b"lmprobe:tensors" in t.schema.metadata
    import datasets

    d = datasets.load_dataset(repo, split="train")
    assert d.num_rows == 30 and d[4]["text"] == src["texts"][4]


def test_extract_push_round_trip(hub, llama_dir, tmp_path, fresh_hf_cache):
    repo = repo_name()
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    assert cli_main(["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", str(tmp_path / "ds"),
                     "--layers", "1,3", "--logits-topk", "4", "--push", repo, "--quiet"]) == 0
    local, remote = lmprobe.load(tmp_path / "ds"), lmprobe.load(repo)
    for layer in (1, 3):
        np.testing.assert_array_equal(local.hidden(layer), remote.hidden(layer))
    np.testing.assert_array_equal(local.logits_topk()[1], remote.logits_topk()[1])


def test_extract_then_push_is_an_api_call_too(hub, tmp_path, fresh_hf_cache):
    """The command line's extract --push is lmprobe.extract(..., push=...), checked before the
    model runs and published by the same call."""
    repo = repo_name()
    ds = lmprobe.extract("lmprobe-tiny", ["the cat sat", "a dog ran"], out=tmp_path / "ds", layers=-1, push=repo,
                         token=TOKEN, quiet=True)
    remote = lmprobe.load(repo)
    np.testing.assert_array_equal(ds.hidden(ds.layers[0]), remote.hidden(ds.layers[0]))
    for bad, match in ((dict(push="not a repo"), "not a repo id"), (dict(private=True), "pass --push"),
                       (dict(push=repo, out="s3://bucket/x"), "write straight to the Hub")):
        with pytest.raises(lmprobe.LmprobeError, match=match):
            lmprobe.extract("lmprobe-tiny", ["a"], **{"out": tmp_path / "never", **bad})
    assert not (tmp_path / "never").exists()


def test_a_partial_copy_says_what_it_holds_and_how_to_fetch_the_rest(hub, dataset, tmp_path, capsys):
    path, src = dataset
    repo = repo_name()
    push_to_hub(path, repo, quiet=True)
    local = tmp_path / "local"
    assert cli_main(["pull", repo, "--layers", "5", "--out", str(local), "--quiet"]) == 0
    capsys.readouterr()
    assert cli_main(["info", str(local)]) == 0
    out = capsys.readouterr().out
    assert (f"layers       3: [0, 2, 5] in the dataset; this copy holds only [5] (`lmprobe pull {repo} --layers L "
            f"--out {local}` fetches more)") in out
    assert "shard_index" not in out and "row_offset_logits" not in out
    with pytest.raises(FileNotFoundError) as exc:
        lmprobe.load(local).hidden(2)
    assert str(exc.value).startswith("this copy holds layer 5 only, not layer 2")
    assert str(exc.value).endswith(f"`lmprobe pull {repo} --layers 2 --out {local}` fetches it")
    # ... and that command does
    assert cli_main(["pull", repo, "--layers", "2", "--out", str(local), "--quiet"]) == 0
    np.testing.assert_array_equal(lmprobe.load(local).hidden(2), src["hidden"][2])
    assert cli_main(["info", str(local)]) == 0
    assert "this copy holds only [2, 5]" in capsys.readouterr().out


@pytest.mark.slow
def test_the_local_hub_starts_by_hand_and_takes_a_push(tmp_path):
    """docs/publishing.md: `python -m tests.support.hub_server --port N` prints the HF_ENDPOINT to export."""
    import os
    import re
    import socket
    import subprocess
    import sys

    root = ROOT
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "tests.support.hub_server", "--port", str(port), "--root",
                               str(tmp_path / "repos")], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        first = server.stdout.readline() + server.stdout.readline()
        m = re.search(r"export HF_ENDPOINT=(\S+) HF_HUB_DISABLE_XET=1", first)
        assert m and m.group(1) == f"http://127.0.0.1:{port}", first
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update(HF_ENDPOINT=m.group(1), HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "hf"))
        lm = [sys.executable, "-m", "lmprobe"]
        for argv in (["demo", "--out", str(tmp_path / "demo")], ["push", str(tmp_path / "demo"), "me/demo", "--quiet"],
                     ["info", "me/demo"]):
            r = subprocess.run(lm + argv, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
            assert r.returncode == 0, r.stderr
        assert "lmprobe/synthetic-demo" in r.stdout and "me/demo" in r.stdout
        assert (tmp_path / "repos").is_dir()
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_prompt_decodes_with_a_tokenizer_in_the_local_cache_and_never_asks_the_hub(hub, llama_dir, tmp_path):
    from huggingface_hub import HfApi, snapshot_download
    from transformers import AutoTokenizer

    from lmprobe.format.writer import DatasetWriter

    tok = AutoTokenizer.from_pretrained(llama_dir)
    repo = f"tester/tok-{uuid.uuid4().hex[:8]}"
    api = HfApi(token=TOKEN)
    api.create_repo(repo, repo_type="model")
    api.upload_folder(folder_path=llama_dir, repo_id=repo, repo_type="model")
    snapshot_download(repo)  # the model's files are in the local cache, as after any earlier use
    commit = api.model_info(repo).sha
    ids = tok("The film was great.")["input_ids"]
    with DatasetWriter(tmp_path / "ds", layers=[0], dim=4, model_name=repo, model_revision=commit, logits_topk=2,
                       token_ids=True) as w:
        w.add_batch(texts=["The film was great."], num_tokens=[len(ids)], hidden={0: np.zeros((1, 4))},
                    token_ids=[ids], logits_values=np.array([[2.0, 1.0]]), logits_indices=np.array([ids[1:3]]))
    start = len(hub.log)
    p = lmprobe.load(tmp_path / "ds").prompt(0)
    assert hub.log[start:] == []  # nothing asked of the Hub: local_files_only
    assert p.tokens == [tok.decode([t]) for t in ids] and "".join(p.tokens[1:]) == "The film was great."
    assert [name for name, _ in p.topk] == [tok.decode([t]) for t in ids[1:3]]
    # a model that is not here: ids, as before
    with DatasetWriter(tmp_path / "other", layers=[0], dim=4, model_name="tester/not-here", token_ids=True) as w:
        w.add_batch(texts=["x"], num_tokens=[2], hidden={0: np.zeros((1, 4))}, token_ids=[[5, 7]])
    assert lmprobe.load(tmp_path / "other").prompt(0).token_strings() == ["#5 ", "#7 "]


# ---------------------------------------------------------------------------------------------- credentials in HF_ENDPOINT


def test_credentials_in_hf_endpoint_are_never_printed(hub, dataset, tmp_path, monkeypatch, capsys, fresh_hf_cache):
    """HF_ENDPOINT=http://user:KEY@host: the KEY reaches the server, never the terminal."""
    import socket

    import huggingface_hub.constants as c

    from lmprobe.storage import hub as hub_mod

    monkeypatch.setattr(hub_mod, "hub_read_policy", lambda: hub_mod.RetryPolicy(  # fail at once, not after retries
        retry_on_exceptions=hub_mod.transport_errors(), retry_on_status_codes=(500,), max_retries=0))
    key = "KEYsecret0987"
    path, _ = dataset
    repo = repo_name()
    push_to_hub(path, repo, quiet=True)
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    with socket.socket() as s:  # a port nothing listens on: the host is down
        s.bind(("127.0.0.1", 0))
        down = s.getsockname()[1]
    commands = [["info", repo], ["pull", repo, "--out", str(tmp_path / "a")],
                ["import-saelens", repo, "--out", str(tmp_path / "b")],
                ["extract", "--model", "someone/some-model", "--prompts", str(f), "--out", str(tmp_path / "c")]]
    for endpoint in (f"http://user:{key}@127.0.0.1:{down}", f"{hub.url.replace('://', f'://user:{key}@')}"):
        monkeypatch.setattr(c, "ENDPOINT", endpoint)
        up = str(down) not in endpoint
        if up:  # the Hub answers, but every read fails: the failed URL is quoted in the message
            hub.fail("GET", ".", 500, times=1000)
        try:
            for argv in commands[:3] if up else commands:
                assert cli_main(argv) == 2, argv
                out = capsys.readouterr()
                assert key not in out.out + out.err and "cannot reach the Hub at http://***@127.0.0.1" in out.err, out
                assert not up or "for url 'http://***@127.0.0.1" in out.err
        finally:
            hub.clear_faults()
    # a push through such an endpoint prints where it went, without the key
    monkeypatch.setattr(c, "ENDPOINT", hub.url.replace("://", f"://user:{key}@"))
    url = push_to_hub(path, repo_name())
    out = capsys.readouterr()
    assert key not in url + out.out + out.err and f"http://***@127.0.0.1:{hub.url.rsplit(':', 1)[1]}" in url


# ---------------------------------------------------------------------------------------------- pull into a folder


def tree(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_pull_refuses_a_folder_that_is_not_a_copy_of_the_repo(hub, dataset, tmp_path, rng, capsys):
    """Pulling into the user's own folder must not replace their README and their extraction without a word:
    like extract, merge and the exports, pull refuses a non-empty output."""
    path, src = dataset
    repo, other = repo_name(), repo_name()
    push_to_hub(path, repo, quiet=True)
    push_to_hub(path, other, quiet=True)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("my own notes\n")
    mine = tmp_path / "mine"
    write_dataset(mine, rng, n=5, layers=(0,), dim=8)
    copy_of_other = tmp_path / "copy-of-other"
    assert cli_main(["pull", other, "--layers", "0", "--out", str(copy_of_other), "--quiet"]) == 0
    cases = [(notes, "is not empty and is not a copy of"), (mine, "holds an lmprobe dataset"),
             (copy_of_other, f"holds a copy of {other}")]
    for folder, message in cases:
        before = tree(folder)
        assert cli_main(["pull", repo, "--out", str(folder), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and f"not a copy of {repo}" in err and len(err.splitlines()) == 1, err
        assert tree(folder) == before  # nothing replaced, nothing added
    assert cli_main(["pull", repo, "--out", str(notes), "--overwrite", "--quiet"]) == 2  # it replaces datasets only
    assert "is not empty and is not a copy of" in capsys.readouterr().err
    assert tree(notes) == {"README.md": b"my own notes\n"}
    # --overwrite replaces a dataset (a local extraction, or a copy of another repo), as extract --overwrite does
    for folder in (mine, copy_of_other):
        assert cli_main(["pull", repo, "--out", str(folder), "--quiet", "--overwrite"]) == 0
        np.testing.assert_array_equal(lmprobe.load(folder).hidden(5), src["hidden"][5])
        assert lmprobe.validate(folder).ok
    # an earlier pull of the same repo is resumed and extended, as before
    assert cli_main(["pull", repo, "--out", str(mine), "--quiet"]) == 0


def test_pulling_more_layers_after_a_new_push_never_mixes_versions(hub, tmp_path, rng, capsys):
    """Pull layer 0, the repo is pushed again, pull layer 2 into the same copy: the copy never holds the new index
    with the old layer's shards (ds.hidden(0) would return other prompts' vectors)."""
    from huggingface_hub import HfApi

    old, new, fewer = tmp_path / "old", tmp_path / "new", tmp_path / "fewer"
    src_old = write_dataset(old, rng, n=30, layers=(0, 2), dim=8, shard_size="160B", logits_topk=3)
    src_new = write_dataset(new, rng, n=30, layers=(0, 2), dim=8, shard_size="160B", logits_topk=3)  # same shard names
    src_fewer = write_dataset(fewer, rng, n=9, layers=(0, 2), dim=8, shard_size="160B", logits_topk=3)
    repo = repo_name()
    push_to_hub(old, repo, quiet=True)
    first = HfApi().repo_info(repo, repo_type="dataset").sha
    local = tmp_path / "local"
    assert cli_main(["pull", repo, "--layers", "0", "--out", str(local), "--quiet"]) == 0
    assert json.loads((local / ".lmprobe-pull.json").read_text()) == {"repo": repo, "revision": first}
    push_to_hub(new, repo, quiet=True)  # the repo moves on: other prompts, the same file names
    second = HfApi().repo_info(repo, repo_type="dataset").sha
    capsys.readouterr()
    assert cli_main(["pull", repo, "--layers", "2", "--out", str(local)]) == 0
    out = capsys.readouterr().err  # said by the lmprobe logger
    ds = lmprobe.load(local)
    np.testing.assert_array_equal(ds.hidden(0), src_new["hidden"][0])  # the layer already here, updated
    np.testing.assert_array_equal(ds.hidden(2), src_new["hidden"][2])
    np.testing.assert_array_equal(ds.logits_topk()[0], src_new["lv"])
    assert lmprobe.validate(local).ok
    assert f"changed since {local} was pulled" in out and "layers [0]" in out, out
    assert json.loads((local / ".lmprobe-pull.json").read_text()) == {"repo": repo, "revision": second}
    # adding a layer of the version a copy holds: --revision pins it
    pinned = tmp_path / "pinned"
    assert cli_main(["pull", repo, "--layers", "0", "--out", str(pinned), "--revision", first, "--quiet"]) == 0
    assert cli_main(["pull", repo, "--layers", "2", "--out", str(pinned), "--revision", first, "--quiet"]) == 0
    np.testing.assert_array_equal(lmprobe.load(pinned).hidden(0), src_old["hidden"][0])
    np.testing.assert_array_equal(lmprobe.load(pinned).hidden(2), src_old["hidden"][2])
    # moving it to a newer version with fewer shards updates what it holds and removes the shards no longer listed
    push_to_hub(fewer, repo, quiet=True)
    assert cli_main(["pull", repo, "--layers", "0", "--out", str(pinned), "--no-logits", "--quiet"]) == 0
    ds = lmprobe.load(pinned)
    np.testing.assert_array_equal(ds.hidden(2), src_fewer["hidden"][2])
    np.testing.assert_array_equal(ds.logits_topk()[0], src_fewer["lv"])
    here = {p.relative_to(pinned).as_posix() for p in (pinned / "tensors").rglob("*") if p.is_file()}
    assert here == {r.rel for r in ds.meta.files()}  # both layers and the logits, of this version only
    assert lmprobe.validate(pinned).ok


def test_a_partial_copy_validates_as_one_and_commands_use_the_layers_it_holds(hub, dataset, tmp_path, capsys):
    """`validate` lists the layers not pulled (not as errors), and `probe`/`report` use the layers the copy
    holds instead of failing on the first one not there."""
    path, src = dataset
    repo = repo_name()
    push_to_hub(path, repo, quiet=True)
    local, bare = tmp_path / "local", tmp_path / "bare"
    assert cli_main(["pull", repo, "--layers", "2", "--out", str(local), "--quiet"]) == 0
    assert cli_main(["pull", repo, "--layers", "0,5", "--no-logits", "--out", str(bare), "--quiet"]) == 0
    capsys.readouterr()
    assert cli_main(["validate", str(local), str(bare), "--strict"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{local}: OK (") and "0 error(s), 0 warning(s)" in out[0], out
    assert out[1] == (f"  partial copy of {repo}: holds layers [2]; not pulled: layers 0, 5 (`lmprobe pull {repo} "
                      f"--layers 0,5 --out {local}` fetches them)"), out
    assert out[3] == (f"  partial copy of {repo}: holds layers [0, 5]; not pulled: layer 2, the logits (`lmprobe pull "
                      f"{repo} --layers 2 --out {bare}` fetches them)"), out
    # what a copy holds is still checked, byte for byte
    shard = sorted((local / "tensors").glob("hidden_layer002_*"))[0]
    good = shard.read_bytes()
    shard.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert cli_main(["validate", str(local)]) == 1
    assert "hidden_layer002_shard000.safetensors: sha256 is" in capsys.readouterr().out
    shard.write_bytes(good)
    # a layer missing from a layer the copy holds is an error, not "not pulled"
    last = sorted((local / "tensors").glob("hidden_layer002_*"))[-1]
    kept = last.read_bytes()
    last.unlink()
    assert cli_main(["validate", str(local)]) == 1
    assert f"{last.relative_to(local).as_posix()}: file is missing" in capsys.readouterr().out
    last.write_bytes(kept)
    # probe and report default to the layers the copy holds
    assert cli_main(["probe", str(local), "--cv", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[1:-1]] == ["2"], table
    assert cli_main(["report", str(bare), "--out", str(tmp_path / "r"), "--quiet"]) == 0
    html = (tmp_path / "r" / "index.html").read_text()
    assert "<td>layers</td><td>0, 5 of 0, 2, 5 (a partial copy" in html


def test_hints_name_what_works_for_push_and_an_offline_pull(hub, dataset, tmp_path, capsys, monkeypatch):
    """Hints name what works: push of a missing folder names the local folder it publishes (not
    hf://datasets/...), and an offline pull does not suggest `lmprobe pull`."""
    from huggingface_hub import constants

    assert cli_main(["push", "out/nope", "me/x", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("lmprobe push: error: out/nope does not exist; push publishes a local dataset folder "
                   "(lmprobe push DIR OWNER/NAME)"), err
    path, _ = dataset
    repo = repo_name()
    push_to_hub(path, repo, quiet=True)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the Hub is gone
    assert cli_main(["pull", repo, "--out", str(tmp_path / "p"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach the Hub at http://127.0.0.1:9" in err[0], err
    assert err[0].endswith("check the network (or HF_ENDPOINT) and run the same pull again: files already here are "
                           "not fetched again"), err
    assert cli_main(["info", repo]) == 2  # a read still points at a local copy
    err = capsys.readouterr().err
    assert "check the network (or HF_ENDPOINT), or read a local copy (made by `lmprobe pull`" in err, err


def test_push_and_pull_into_a_log_write_lines_not_bars(hub, dataset, tmp_path, capsys, monkeypatch):
    """Into a log, push and pull write progress lines, never tqdm bars with escape codes."""
    monkeypatch.setenv("LMPROBE_PROGRESS_INTERVAL", "0")
    path, _ = dataset
    repo = repo_name()
    assert cli_main(["push", str(path), repo]) == 0
    out = capsys.readouterr()
    assert "\r" not in out.err and "\x1b" not in out.err and "it/s" not in out.err, out.err
    *bar, said = out.err.splitlines()  # progress lines, then the result line
    assert bar and all(x.startswith(f"push {repo}: ") for x in bar) and "(100.0%)" in bar[-1], bar
    assert said.startswith("pushed "), said
    assert cli_main(["pull", repo, "--layers", "2", "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr()
    assert "\r" not in out.err and "\x1b" not in out.err, out.err
    *bar, said = out.err.splitlines()
    assert re.fullmatch(rf"pull {repo}: \d+/\d+ files \(100\.0%\), .*", bar[-1]), out.err
    assert said.startswith("pulled "), said


def test_the_local_hub_server_stopped_with_sigterm_removes_its_temporary_folder(tmp_path):
    """`python -m tests.support.hub_server` killed with SIGTERM (as a job scheduler or `kill` stops it) removes its
    temporary folder; a --root given by the user is kept."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = ROOT
    for given in (None, tmp_path / "mine"):
        cmd = [sys.executable, "-m", "tests.support.hub_server"] + (["--root", str(given)] if given else [])
        server = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, text=True)
        try:
            first = server.stdout.readline()
            folder = Path(re.search(r"repos kept in (\S+);", first).group(1))
            assert folder.is_dir()
        finally:
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=30) == 0
        assert folder.exists() == (given is not None), folder


def test_an_interrupted_pull_over_an_earlier_one_never_pairs_old_index_and_new_shards(hub, tmp_path, rng, monkeypatch):
    from lmprobe.publish import pull as pull_mod

    old, new = tmp_path / "old", tmp_path / "new"
    write_dataset(old, rng, n=12, layers=(0, 1), shard_size="96B")
    write_dataset(new, rng, n=12, layers=(0, 1), shard_size="96B")
    lmprobe.push_to_hub(old, "tester/pull-a", quiet=True)
    dst = tmp_path / "local"
    lmprobe.pull("tester/pull-a", dst, quiet=True)
    lmprobe.push_to_hub(new, "tester/pull-a", quiet=True)  # the repo pushed again: the same names, other values
    copies = []
    real = pull_mod._copy_into

    def dying(src, target):
        copies.append(target)
        if len(copies) == 3:
            raise KeyboardInterrupt
        return real(src, target)

    monkeypatch.setattr(pull_mod, "_copy_into", dying)
    with pytest.raises(KeyboardInterrupt):
        lmprobe.pull("tester/pull-a", dst, quiet=True)
    monkeypatch.setattr(pull_mod, "_copy_into", real)
    # the folder is visibly incomplete, never a mix that reads
    with pytest.raises(LmprobeError, match="unfinished|no lmprobe dataset|missing"):
        lmprobe.load(dst).hidden(0)
    lmprobe.pull("tester/pull-a", dst, quiet=True)
    np.testing.assert_array_equal(lmprobe.load(dst).hidden(1), lmprobe.load(new).hidden(1))
    np.testing.assert_array_equal(lmprobe.load(dst).hidden(0), lmprobe.load(new).hidden(0))


def test_repushing_a_complete_dataset_sends_nothing(hub, tmp_path, rng, capsys):
    write_dataset(tmp_path / "ds", rng, n=6)
    assert cli_main(["push", str(tmp_path / "ds"), "tester/repush"]) == 0
    capsys.readouterr()
    commits = len(hub.log)
    assert cli_main(["push", str(tmp_path / "ds"), "tester/repush"]) == 0
    said = capsys.readouterr().err  # the lmprobe logger's line
    assert "pushed 0 file(s)" in said and "nothing to send" in said
    assert not any(m == "POST" and "/commit/" in p for m, p in hub.log[commits:])


@pytest.mark.parametrize("path", ["out/nonexistent", "./gone", "~/gone/x", "/abs/gone", "a/b/c"])
def test_a_missing_local_path_is_a_local_error_with_no_request(tmp_path, monkeypatch, capsys, path):
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda *a, **k: calls.append(a) or 1 / 0)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda *a, **k: calls.append(a) or 1 / 0)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request would fail loudly
    assert cli_main(["info", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and "cannot reach" not in err[0], err
    assert not calls


def test_owner_name_without_such_a_local_folder_still_means_the_hub():
    from lmprobe.storage.hub import parse_dataset_ref

    assert parse_dataset_ref("someone/acts").repo_id == "someone/acts"
    assert parse_dataset_ref("out/nonexistent") is not None  # no ./out here: a Hub repo name


# ------------------------------------------------------------------ validate a Hub dataset in place

def test_validate_checks_a_hub_dataset_in_place_and_full_checks_its_hashes(hub, tmp_path, rng, capsys):
    from huggingface_hub import HfApi

    write_dataset(tmp_path / "ds", rng, n=9, layers=(0, 1), dim=4)
    repo = f"tester/valid-{uuid.uuid4().hex[:8]}"
    push_to_hub(tmp_path / "ds", repo, quiet=True)
    url = f"hf://datasets/{repo}"
    n_shards = len(list((tmp_path / "ds").rglob("*.safetensors")))
    for path in (url, repo):  # `validate me/acts` suggested hf://, which collapsed into hf:/ and did not exist
        assert cli_main(["validate", path]) == 0
        out = capsys.readouterr().out
        assert f": OK ({n_shards} shard files checked" in out and "hf:/datasets" not in out, out
    # a shard whose bytes changed but not its size: its header and size still agree; --full reads its hash
    shard = sorted((tmp_path / "ds").rglob("*.safetensors"))[0]
    rel = shard.relative_to(tmp_path / "ds").as_posix()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    api = HfApi()
    api.upload_file(path_or_fileobj=bytes(data), path_in_repo=rel, repo_id=repo, repo_type="dataset")
    assert cli_main(["validate", url]) == 0
    capsys.readouterr()
    assert cli_main(["validate", url, "--full"]) == 1
    out = capsys.readouterr().out
    assert f"{rel}: sha256 is" in out and out.startswith(f"{url}: INVALID"), out
    # a truncated shard: its size says it without downloading it
    api.upload_file(path_or_fileobj=bytes(data[:-4]), path_in_repo=rel, repo_id=repo, repo_type="dataset")
    assert cli_main(["validate", url]) == 1
    out = capsys.readouterr().out
    assert rel in out and "INVALID" in out, out


def test_an_unreachable_hub_tells_a_writer_how_to_write(tmp_path, monkeypatch, capsys):
    """An unreachable Hub, for a write to --out hf://..., is said as such: never "read a local copy made by
    `lmprobe pull`"."""
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in PROMPTS_TEXTS))
    assert cli_main(["extract", "--model", "lmprobe-tiny", "--prompts", str(prompts), "--out",
                     "hf://datasets/me/unreachable", "--layers", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot reach the Hub at http://127.0.0.1:9" in err and "pull" not in err, err
    assert "--out DIR" in err and "lmprobe push DIR me/unreachable" in err, err


PROMPTS_TEXTS = ["The cat sat on the mat.", "A dog."]


@pytest.mark.parametrize("url, ref", [
    ("hf://datasets/u/n@refs/pr/1", ("u/n", "refs/pr/1", "")),
    ("hf://datasets/u/n@refs/pr/12/sub/dir", ("u/n", "refs/pr/12", "sub/dir")),
    ("hf://datasets/u/n@refs/convert/parquet/x", ("u/n", "refs/convert/parquet", "x")),
    ("hf://datasets/u/n@refs%2Fpr%2F3/x", ("u/n", "refs/pr/3", "x")),
    ("hf://datasets/u/n@v1/a/b", ("u/n", "v1", "a/b")),
    ("hf://datasets/u/n/a/b/", ("u/n", None, "a/b")),
])
def test_hf_urls_parse_revisions_with_slashes_as_huggingface_hub_does(url, ref):
    """A PR's ref (``refs/pr/N``) or a conversion's (``refs/convert/NAME``) is the revision, not a
    branch ``refs`` and a folder ``pr/1``."""
    from lmprobe.storage.hub import parse_hf_url

    got = parse_hf_url(url)
    assert (got.repo_id, got.revision, got.path) == ref


@pytest.mark.parametrize("url, says", [
    ("hf://datasets/u/n/.", "'.'"),
    ("hf://datasets/u/n/./sub", "'.'"),
    ("hf://datasets/u/n/a/./b", "'.'"),
    ("hf://datasets/u/n/a//b", "a/b"),
    ("hf://datasets/u/n/.lmprobe-parts/part-00000", ".lmprobe-"),
    ("hf://datasets/u/n/x/.lmprobe-staging", ".lmprobe-"),
    ("hf://datasets/u/n/a/../b", ".."),
    ("hf://datasets/u/n@", "revision"),
    ("hf://datasets/u/n@/sub", "revision"),
    ("hf://datasets/u/n@refs/pr/x", "refs/pr/N"),
])
def test_odd_folders_in_hf_urls_are_refused_in_one_line(url, says):
    """``/.``, ``/./sub``, ``a//b``, lmprobe's own ``.lmprobe-*`` folders, an empty or malformed
    revision: one line from the one hf:// grammar, before any request (it was a whole extraction, then a failure)."""
    from lmprobe.errors import LmprobeError
    from lmprobe.storage.hub import parse_hf_url

    with pytest.raises(LmprobeError) as err:
        parse_hf_url(url)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_push_into_a_pull_request_commits_there_once_it_is_open(hub, dataset):
    """``revision="refs/pr/N"``: refused in one line before anything is sent while the pull request is not open
    (a branch cannot be named so); committed to the pull request's ref once it is, main untouched."""
    from huggingface_hub import HfApi

    path, _ = dataset
    repo = repo_name()
    api = HfApi(token=TOKEN)
    api.create_repo(repo, repo_type="dataset")
    since = len(hub.log)
    with pytest.raises(InvalidArgumentError, match="create_pull_request"):
        push_to_hub(path, repo, revision="refs/pr/1", token=TOKEN, quiet=True)
    assert not [p for m, p in hub.log[since:] if m in ("POST", "PUT") and "/repos/create" not in p]
    api.create_pull_request(repo, "activations", repo_type="dataset")
    push_to_hub(path, repo, revision="refs/pr/1", token=TOKEN, quiet=True)
    assert lmprobe.load(f"hf://datasets/{repo}@refs/pr/1").num_prompts == 30
    assert INDEX_PATH not in hub.files(repo) and INDEX_PATH in hub.files(repo, rev="refs/pr/1")
