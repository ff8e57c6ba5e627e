"""Two jobs on one Hub folder. Two machines extracting different prompts into the same
``hf://`` repo at once published a shard shorter than its index, or one job's texts over the other's vectors, and
both exited 0. Now a job commits a marker first and makes every commit on the revision it last saw
(lmprobe/storage/claim.py): a second job is refused in one line, a job whose folder was taken over stops without
publishing, a killed job's marker is taken over by the same work and refuses other work unless --overwrite.

Each race is made deterministic: job A runs in a process of its own (tests/support/_held_extract.py) and holds right
after its first commit landed until the test releases it; job B, another machine (its own LMPROBE_CACHE), runs
meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from support.datasets import PROMPTS
from support.paths import SUPPORT

import lmprobe
from lmprobe.errors import OtherExtractionError, OutputInUseError
from lmprobe.storage.claim import MARKER

KW = dict(layers="0,3", storage="full_sequence", shard_size="2KB", batch_size=4)
A_PROMPTS = PROMPTS  # 7 prompts
B_PROMPTS = [dict(p, text=f"{p['text']} Job B wrote this one, {i}.") for i, p in enumerate(PROMPTS + PROMPTS[:2])]


@pytest.fixture(autouse=True)
def _fast_commits(monkeypatch, tmp_path):
    monkeypatch.setenv("LMPROBE_HUB_HOUR_SECONDS", "1")
    monkeypatch.setenv("LMPROBE_CACHE", str(tmp_path / "machine-test"))


def _repo(hub, name):
    return hub.state.repos[("dataset", f"user/{name}")]


def _tree(hub, name) -> dict:
    repo = _repo(hub, name)
    return repo.commits[repo.branches["main"]]


def _same(a, b, layers=(0, 3)):
    assert a.texts == b.texts
    for layer in layers:
        np.testing.assert_array_equal(a.hidden(layer), b.hidden(layer))
        for i in range(a.num_prompts):
            np.testing.assert_array_equal(a.token_hidden(i, layer), b.token_hidden(i, layer))


def _published(url: str, local) -> None:
    """The repo holds a dataset that validates, equal to ``local`` (texts and vectors from one job only)."""
    report = lmprobe.validate(url)
    assert not report.errors, report.errors
    _same(local, lmprobe.load(url))


class Held:
    """Job A: an extraction in its own process (its own machine: its own LMPROBE_CACHE), held after its first commit
    landed until ``release``."""

    def __init__(self, tmp_path: Path, model: Path, prompts: list, url: str, **kw):
        self.flag, self.go = tmp_path / "a.flag", tmp_path / "a.go"
        env = {**os.environ, "LMPROBE_CACHE": str(tmp_path / "machine-a")}
        self.proc = subprocess.Popen([sys.executable, str(SUPPORT / "_held_extract.py"),
                                      json.dumps([prompts, str(model), url, {**KW, "quiet": True, **kw},
                                                  str(self.flag), str(self.go)])],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not self.flag.exists():  # an event (a file the job writes), not a guess at how long it takes
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                out, err = self.proc.communicate()
                raise AssertionError(f"job A never held after its first commit: {err[-3000:]}")
            time.sleep(0.05)

    def release(self) -> subprocess.CompletedProcess:
        self.go.touch()
        out, err = self.proc.communicate(timeout=600)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.go.touch()
            try:
                self.proc.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


def _cli(tmp_path: Path, model: Path, prompts: list, url: str, machine: str, *extra: str) -> subprocess.CompletedProcess:
    """Job B: ``lmprobe extract`` on another machine (its own LMPROBE_CACHE)."""
    f = tmp_path / f"{machine}.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    cmd = [sys.executable, "-m", "lmprobe", "extract", "--model", str(model), "--prompts", str(f), "--out", url,
           "--layers", KW["layers"], "--storage", KW["storage"], "--shard-size", KW["shard_size"], "--batch-size",
           str(KW["batch_size"]), "--quiet", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "LMPROBE_CACHE": str(tmp_path / machine)})


def _one_line(stderr: str, words: str) -> str:
    lines = [line for line in stderr.splitlines() if words in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_second_job_on_a_folder_being_written_is_refused_and_commits_nothing(hub, llama_dir, tmp_path):
    """A holds after its first commit; B, other prompts on another machine, exits 2 with one line saying what to do
    and commits nothing; A then finishes, and the repo holds A's dataset alone (it validates; texts and vectors equal
    a local extraction of A's prompts)."""
    name = f"race-{uuid.uuid4().hex[:6]}"
    url = f"hf://datasets/user/{name}"
    local_a = lmprobe.extract(str(llama_dir), A_PROMPTS, out=tmp_path / "local-a", quiet=True, **KW)
    with Held(tmp_path, llama_dir, A_PROMPTS, url) as a:
        commits = len(_repo(hub, name).commits)
        b = _cli(tmp_path, llama_dir, B_PROMPTS, url, "machine-b")
        assert len(_repo(hub, name).commits) == commits  # B committed nothing
        done = a.release()
    assert b.returncode == 2, (b.returncode, b.stderr[-3000:])
    line = _one_line(b.stderr, "is being written by")
    assert url in line and "--overwrite" in line and "another --out" in line
    assert done.returncode == 0, done.stderr[-3000:]
    _published(url, local_a)
    assert not [p for p in _tree(hub, name) if p.endswith(MARKER)]  # the finished dataset holds no marker


@pytest.mark.slow
def test_a_job_whose_folder_is_taken_over_stops_without_publishing(hub, llama_dir, tmp_path):
    """A holds after its first commit; B takes the folder over (--overwrite) and publishes its dataset; A, released,
    exits non-zero with one line and commits nothing more: the repo holds B's dataset alone."""
    name = f"takeover-{uuid.uuid4().hex[:6]}"
    url = f"hf://datasets/user/{name}"
    local_b = lmprobe.extract(str(llama_dir), B_PROMPTS, out=tmp_path / "local-b", quiet=True, **KW)
    with Held(tmp_path, llama_dir, A_PROMPTS, url) as a:
        b = _cli(tmp_path, llama_dir, B_PROMPTS, url, "machine-b", "--overwrite")
        assert b.returncode == 0, b.stderr[-3000:]
        commits = len(_repo(hub, name).commits)
        done = a.release()
    assert done.returncode != 0
    line = _one_line(done.stderr, "changed hands while this extraction ran")
    assert url in line and "published" in line or "publishing" in line
    assert len(_repo(hub, name).commits) == commits  # A committed nothing after B's dataset
    _published(url, local_b)
    assert not [p for p in _tree(hub, name) if p.endswith(MARKER)]


def _crash(tmp_path: Path, model: Path, url: str, kw: dict) -> None:
    """Job A, killed (kill -9) at its second forward pass on machine A: its marker and some shards stay."""
    crashed = subprocess.run([sys.executable, str(SUPPORT / "_crash_extract.py"),
                              json.dumps([A_PROMPTS, str(model), url, 1, kw])], capture_output=True, text=True,
                             env={**os.environ, "LMPROBE_CACHE": str(tmp_path / "machine-a")}, timeout=600)
    assert crashed.returncode == 9, crashed.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("then", ["same work resumes", "--overwrite clears it"])
def test_a_killed_jobs_marker_refuses_other_work_until_overwrite_and_lets_the_same_work_resume(
        hub, llama_dir, tmp_path, monkeypatch, then):
    """A killed job's marker: other settings, from another machine, are refused in one line naming the difference and
    --overwrite; the same settings (from another machine too) take the marker over and finish; --overwrite (the way
    the refusal names) takes the folder over for other work. Neither finished dataset holds a marker."""
    name = f"stale-{uuid.uuid4().hex[:6]}"
    url = f"hf://datasets/user/{name}"
    _crash(tmp_path, llama_dir, url, KW)
    monkeypatch.setenv("LMPROBE_CACHE", str(tmp_path / "machine-b"))  # another machine: no staging of A's
    with pytest.raises(OtherExtractionError) as err:
        lmprobe.extract(str(llama_dir), B_PROMPTS, out=url, quiet=True, **KW)
    assert [p for p in _tree(hub, name) if p.endswith(MARKER)]  # the killed job's
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(url) and "prompts_sha256" in msg and "--overwrite" in msg
    assert isinstance(err.value, OutputInUseError)
    if then == "same work resumes":
        ds = lmprobe.extract(str(llama_dir), A_PROMPTS, out=url, quiet=True, **KW)
        local = lmprobe.extract(str(llama_dir), A_PROMPTS, out=tmp_path / "local", quiet=True, **KW)
    else:
        ds = lmprobe.extract(str(llama_dir), B_PROMPTS, out=url, quiet=True, overwrite=True, **KW)
        local = lmprobe.extract(str(llama_dir), B_PROMPTS, out=tmp_path / "local", quiet=True, **KW)
    _same(local, ds)
    _published(url, local)
    assert not [p for p in _tree(hub, name) if p.endswith(MARKER)]


@pytest.mark.parametrize("before", ["lmprobe: add", "lmprobe: add the last shards"])
def test_someone_committing_to_the_repo_mid_job_does_not_stop_it(hub, llama_dir, tmp_path, monkeypatch, before):
    """The owner edits README.md on the Hub while the job runs (before a commit of shards, or before the final one,
    whose card merged the README as it was): the job's commit is refused (its parent moved), the job reads its
    marker again, finds it its own, and commits on the new revision (the card merged again); the dataset is
    complete and the owner's text is kept."""
    from huggingface_hub import CommitOperationAdd, HfApi

    name = f"edited-{uuid.uuid4().hex[:6]}"
    url = f"hf://datasets/user/{name}"
    real, seen = HfApi.create_commit, {"edits": 0, "moved": 0}

    def create_commit(self, repo_id, operations, *, commit_message, **kw):
        if commit_message.startswith(before) and not seen["edits"]:
            seen["edits"] += 1  # the owner, in the browser, just before the job's first shards' commit
            real(HfApi(), repo_id, [CommitOperationAdd("README.md", b"# My notes\n\nKeep this.\n")],
                 commit_message="owner: notes", repo_type="dataset")
        try:
            return real(self, repo_id, operations, commit_message=commit_message, **kw)
        except Exception as exc:
            if getattr(getattr(exc, "response", None), "status_code", None) == 412:
                seen["moved"] += 1
            raise

    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    ds = lmprobe.extract(str(llama_dir), A_PROMPTS, out=url, quiet=True, **KW)
    monkeypatch.undo()
    monkeypatch.setenv("LMPROBE_CACHE", str(tmp_path / "machine-test"))
    assert seen == {"edits": 1, "moved": 1}  # the job's commit named the revision it saw, and was tried again
    local = lmprobe.extract(str(llama_dir), A_PROMPTS, out=tmp_path / "local", quiet=True, **KW)
    _same(local, ds)
    _published(url, local)
    tree = _tree(hub, name)
    assert b"Keep this." in tree["README.md"].data
    assert not [p for p in tree if p.endswith(MARKER)]


# ---------------------------------------------------------------------------------------------- the claim itself


def _claim(url_name: str, fingerprint: str, **kw):
    from lmprobe.storage.claim import RepoClaim
    from lmprobe.storage.hub import hub_api

    return RepoClaim(hub_api(None), f"user/{url_name}", "main", "", url=f"hf://datasets/user/{url_name}",
                     fingerprint=fingerprint, **kw)


def test_of_two_jobs_claiming_at_once_one_gets_the_folder(hub):
    """Both read the branch before either committed its marker: the second marker's commit is refused (412), the job
    reads again, finds the other's marker, and is refused in one line."""
    from huggingface_hub import CommitOperationAdd, HfApi

    name = f"claims-{uuid.uuid4().hex[:6]}"
    HfApi().create_repo(f"user/{name}", repo_type="dataset")
    a, b = _claim(name, "a" * 64, settings={"layers": [0]}), _claim(name, "b" * 64, settings={"layers": [1]})
    stale = a.head()
    b.claim(take_over=False)
    first = [stale]
    a.head = lambda: first.pop() if first else type(a).head(a)  # a read the branch before b's marker landed
    with pytest.raises(OtherExtractionError) as err:
        a.claim(take_over=False)
    assert "\n" not in str(err.value) and "layers: [1] -> [0]" in str(err.value)
    assert b.ours(b.marker_at(b.head()))
    with pytest.raises(OutputInUseError, match="changed hands"):  # b's folder taken over: b stops at its next commit
        a.claim(take_over=True)
        b.commit(lambda parent: HfApi().create_commit(f"user/{name}", [CommitOperationAdd("x.txt", b"x")],
                                                      commit_message="x", repo_type="dataset", parent_commit=parent))


def test_a_marker_lmprobe_cannot_read_refuses_until_overwrite(hub):
    from huggingface_hub import CommitOperationAdd, HfApi

    name = f"garbage-{uuid.uuid4().hex[:6]}"
    HfApi().create_repo(f"user/{name}", repo_type="dataset")
    HfApi().create_commit(f"user/{name}", [CommitOperationAdd(MARKER, b"\x1b[31m{not json\n")], commit_message="x",
                          repo_type="dataset")
    c = _claim(name, "c" * 64)
    with pytest.raises(OutputInUseError, match="cannot read") as err:
        c.claim(take_over=False)
    assert "\n" not in str(err.value) and "\x1b" not in str(err.value)
    c.claim(take_over=True)
    assert c.ours(c.marker_at(c.head()))


@pytest.mark.slow
def test_a_torchrun_job_into_a_folder_another_job_holds_stops_on_every_rank(hub, llama_dir, tmp_path):
    """Two nodes into a folder holding another job's marker: rank 0 is refused, tells the other rank, and every rank
    exits with the one line, before any commit; with --overwrite the job takes the folder over and its finished
    dataset holds no marker."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from support.nodes import launch, run

    name = f"ranks-{uuid.uuid4().hex[:6]}"
    url = f"hf://datasets/user/{name}"
    other = {"lmprobe_job": "ab" * 16, "settings_fingerprint": "cd" * 32, "created": "2026-01-01T00:00:00Z"}
    HfApi().create_repo(f"user/{name}", repo_type="dataset")
    HfApi().create_commit(f"user/{name}", [CommitOperationAdd(MARKER, json.dumps(other).encode())],
                          commit_message="another job's marker", repo_type="dataset")
    commits = len(_repo(hub, name).commits)
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in A_PROMPTS) + "\n")
    argv = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", url, "--layers", "0,3", "--storage",
            "full_sequence", "--shard-size", "2KB", "--quiet"]
    procs = launch(tmp_path, argv, per_node=1)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    for out in outs:  # each node's rank says it in the same one line
        assert "lmprobe extract: error: " + url in out and "job ababababab" in out, out[-3000:]
    assert len(_repo(hub, name).commits) == commits
    run(tmp_path, [*argv, "--overwrite"], per_node=1)
    assert lmprobe.load(url).num_prompts == len(A_PROMPTS)
    assert not [p for p in _tree(hub, name) if p.endswith(MARKER)]


def test_the_card_is_merged_into_the_readme_of_the_revision_the_final_commit_is_made_on(hub, llama_dir, tmp_path):
    """The owner's edit that lands after the job merged its card, and that the job saw through another commit's 412
    (so its final commit is not refused), is kept: the card is merged again at the final commit's own parent."""
    import shutil

    from huggingface_hub import CommitOperationAdd, HfApi

    from lmprobe.storage.hubrepo import card_merger
    from lmprobe.storage.outputs import HubOutput

    name = f"card-{uuid.uuid4().hex[:6]}"
    repo = f"user/{name}"
    HfApi().create_repo(repo, repo_type="dataset")
    HfApi().create_commit(repo, [CommitOperationAdd("README.md", b"# First notes\n")], commit_message="owner",
                          repo_type="dataset")
    local = tmp_path / "local"
    lmprobe.extract(str(llama_dir), A_PROMPTS, out=local, quiet=True, **KW)
    staged = tmp_path / "staged"
    shutil.copytree(local, staged)
    merge = card_merger(HubOutput.parse(f"hf://datasets/{repo}"), staged)
    assert b"# First notes" in (staged / "README.md").read_bytes()  # merged as the branch held it
    HfApi().create_commit(repo, [CommitOperationAdd("README.md", b"# Second notes\n")], commit_message="owner",
                          repo_type="dataset")
    merge(HfApi().repo_info(repo, repo_type="dataset").sha)  # the final commit's parent
    card = (staged / "README.md").read_bytes()
    assert b"# Second notes" in card and b"First notes" not in card and b"lmprobe:card" in card
