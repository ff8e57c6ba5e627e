"""Commits to a Hub repo in bounded batches, with retries that never make the same commit twice.

Files go up in commits of bounded size (the Hub asks for under ~100 files per commit), the
``last`` files (index and card, or a dictionary's meta.json) in a final commit, so the repo never
shows an entry point before the files it describes. A re-run skips files already on the Hub with
the same content (sha256 from the Hub's LFS metadata, compared with the sha256 lmprobe recorded
when it wrote each file). 429/5xx answers and dropped connections are retried with backoff;
before a commit is retried, the repo is checked for it, so a commit whose answer was lost is not
made twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PushError
from ..hashing import sha256_file
from ..progress import Progress, on_terminal, third_party_bars
from ..retry import TRANSIENT_HTTP_STATUS, RetryPolicy, call_with_retry, describe
from ..storage.hub import hub_api, transport_errors

DEFAULT_COMMIT_FILES = 50
DEFAULT_COMMIT_BYTES = 20 * 1024**3


def push_policy(*, max_retries: int = 5, base_wait: float = 2.0) -> RetryPolicy:
    """Pushes retry dropped connections and 429/5xx answers; every other error stops the push."""
    return RetryPolicy(retry_on_exceptions=transport_errors(), retry_on_status_codes=TRANSIENT_HTTP_STATUS,
                       max_retries=max_retries, base_wait=base_wait)


@dataclass
class RepoFile:
    """A local file and its path in the repo."""

    rel: str
    local: Path
    size: int = -1
    sha256: str | None = None  # as recorded in the metadata, when it was


def git_blob_id(path: Path) -> str:
    """The git object id of a file's content (how the Hub names a file that is not in LFS)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _same(f: RepoFile, remote: str | None) -> bool:
    """Whether the repo already holds ``f``'s content (LFS files by sha256, others by git blob id)."""
    if remote is None:
        return False
    kind, _, oid = remote.partition(":")
    if kind == "sha256":
        return oid == f.sha256
    return f.local.stat().st_size < 10 * 2**20 and oid == git_blob_id(f.local)  # small text files


class HubCommitter:
    """Makes commits to one repo and revision, skipping files already there, retrying transient failures."""

    def __init__(self, repo_id: str, *, token: str | bool | None, revision: str | None = None,
                 repo_type: str = "dataset", policy: RetryPolicy | None = None, quiet: bool = True):
        self.api = hub_api(token)
        self.repo_id = repo_id
        self.repo_type = repo_type
        self.revision = revision or "main"
        self.policy = policy or push_policy()
        self.quiet = quiet
        self.commits = 0

    def call(self, what: str, fn: Callable[[], Any], landed: Callable[[], bool] | None = None) -> Any:
        """``fn()`` with retries; a failure becomes a PushError that says how to resume."""
        try:
            return call_with_retry(fn, policy=self.policy, landed=landed)
        except Exception as exc:
            retried = self.policy.is_transient(exc)
            raise PushError(
                f"{what} failed ({describe(exc)})"
                + (f" after {self.policy.max_retries + 1} attempts" if retried else "")
                + f"; the repo {self.repo_id} holds every commit made so far (shards only until the index "
                "is pushed, last). Run the same push again to resume: files already there are skipped."
            ) from exc

    def remote_files(self) -> dict[str, str]:
        """path -> ``sha256:<hex>`` (LFS files) or ``git:<blob id>`` (regular files) at the target revision."""
        from huggingface_hub import RepoFile as HubRepoFile
        from huggingface_hub.errors import RevisionNotFoundError

        try:
            entries = self.api.list_repo_tree(self.repo_id, repo_type=self.repo_type, revision=self.revision,
                                              recursive=True)
            return {e.path: (f"sha256:{e.lfs.sha256}" if e.lfs else f"git:{e.blob_id}") for e in entries
                    if isinstance(e, HubRepoFile)}
        except RevisionNotFoundError:
            return {}

    def prepare(self, private: bool) -> None:
        """Create the repo (and the branch) if needed."""
        self.call("creating the repo", lambda: self.api.create_repo(
            self.repo_id, repo_type=self.repo_type, private=private, exist_ok=True))
        if self.revision != "main":
            self.call("creating the branch", lambda: self.api.create_branch(
                self.repo_id, repo_type=self.repo_type, branch=self.revision, exist_ok=True))

    def commit(self, files: list[RepoFile], message: str) -> None:
        from huggingface_hub import CommitOperationAdd

        def ops():
            out = []
            for f in files:
                op = CommitOperationAdd(path_in_repo=f.rel, path_or_fileobj=str(f.local))
                if f.sha256:
                    op.upload_info.sha256 = bytes.fromhex(f.sha256)  # recorded at write time: no second hashing
                out.append(op)
            return out

        def landed() -> bool:
            remote = self.remote_files()
            return all(_same(f, remote.get(f.rel)) for f in files if f.sha256)

        self.call(
            f"committing {len(files)} file(s) to {self.repo_id}",
            lambda: self.api.create_commit(self.repo_id, ops(), commit_message=message, repo_type=self.repo_type,
                                           revision=self.revision),
            landed=landed if all(f.sha256 for f in files) else None,
        )
        self.commits += 1

    def push_files(self, files: list[RepoFile], last: list[RepoFile], *, commit_files: int = DEFAULT_COMMIT_FILES,
                   commit_bytes: int = DEFAULT_COMMIT_BYTES, label: str) -> int:
        """Upload ``files`` in bounded commits (skipping those already there), then ``last`` in one commit.

        Returns how many files were sent.
        """
        for f in [*files, *last]:
            if not f.local.is_file():
                raise PushError(f"{f.local} is missing; the local copy is incomplete, nothing was pushed")
            if f.sha256 is None:
                f.sha256 = sha256_file(f.local)
            f.size = f.local.stat().st_size
        remote = self.call(f"listing {self.repo_id}", self.remote_files)
        todo = [f for f in files if not _same(f, remote.get(f.rel))]
        final = [f for f in last if not _same(f, remote.get(f.rel))]
        batches: list[list[RepoFile]] = []
        for f in todo:
            if not batches or len(batches[-1]) >= commit_files or sum(x.size for x in batches[-1]) + f.size > commit_bytes:
                batches.append([])
            batches[-1].append(f)
        # huggingface_hub's own bars (one per file) only on a terminal: in a log they are dozens of escape codes
        with Progress(sum(f.size for f in todo + final), desc=f"push {self.repo_id}", unit="B", quiet=self.quiet) as bar, \
                third_party_bars(not self.quiet and on_terminal()):
            for i, batch in enumerate(batches):
                self.commit(batch, f"lmprobe: add {label} files ({i + 1}/{len(batches)})")
                bar.update(sum(f.size for f in batch))
            if final:
                self.commit(final, f"lmprobe: add {label} index and card")
                bar.update(sum(f.size for f in final))
        return len(todo) + len(final)
