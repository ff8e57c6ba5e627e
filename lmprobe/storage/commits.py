"""Commits to a Hub repo: parallel uploads pipelined with bounded commits, resumable, never made twice.

A :class:`HubCommitter` takes files one by one (``add``) as they are finished, uploads them in
parallel (LFS or Xet, whichever huggingface_hub uses), and commits them in batches while the next
files upload: the link never waits for a commit to land. Commit sizes and the commit rate follow
the job's one budget (budget.py): huggingface_hub's ladder of 20 to 1,000 files a commit (starting
at 250, a step up after a commit that landed in under 40 s, a step down after a slow one), and at
most ``commits_per_hour`` commits in any hour (sliding), whoever's files they hold.
``finish(last=[...])`` commits the entry point (index and card, or a dictionary's meta.json)
alone, after every other file landed, so the repo never shows an index whose files are missing.

- **Resume**: the repo's tree is listed once, when the committer starts. A file already there with
  the same content (the sha256 lmprobe recorded when it wrote the file against the Hub's LFS
  sha256; a small regular file by git blob id) is not sent again.
- **No second hashing**: a file with a recorded sha256 is never read to hash it; the known sha256
  goes to the LFS batch and to hf_xet. A file without one is hashed only when the repo already
  has a file at its path (to compare), otherwise by the upload itself (one read pass).
- **Retries**: 429/5xx answers and dropped connections are retried with backoff. A 429 (the Hub's
  rate limits, commits included) is waited out as long as its Retry-After says (capped), for up to
  ``commit_deadline`` seconds, and the wait is logged. Before a commit that may have landed is
  tried again, the paths of that commit alone are asked for (paths-info): a commit whose answer was
  lost is not made twice.
- **Bounded**: at most ``max_in_flight`` files are added but not yet in a landed commit; ``add``
  waits beyond that. ``on_landed`` is told of each file once the commit holding it has landed (or
  when it was on the Hub already), so a writer can delete its local copy.

>>> with HubCommitter("me/acts", token=None) as c:  # doctest: +SKIP
...     c.start()
...     for f in shards_as_they_close():
...         c.add(f)
...     c.finish(last=[RepoFile("README.md", card), RepoFile("index/train-00000-of-00001.parquet", index)])

One file past 600 lines, on purpose: uploads, commit batching, retries and resume share one state
(what is uploaded, committed, landed), and splitting them would spread its locking over files.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..base.hashing import sha256_file
from ..base.paths import check_relpath
from ..base.progress import Progress, third_party_bars
from ..base.retry import TRANSIENT_HTTP_STATUS, RetryPolicy, call_with_retry, describe, status_code
from ..errors import InvalidArgumentError, LmprobeError, PushError
from .budget import (
    HOUR,
    MAX_COMMIT_FILES,
    START_COMMIT_FILES,
    CommitWindow,
    commits_per_hour,
    hour_seconds,
    next_commit_files,
)
from .claim import RepoClaim
from .hub import HubRef, check_pull_request_open, hub_api, is_pull_request, transport_errors
from .relay import Relay

logger = logging.getLogger(__name__)

DEFAULT_COMMIT_BYTES = 20 * 1024**3
#: moves per rename commit (a copy and a delete each, nothing uploaded): 100,000 files rename in 100 commits
RENAMES_PER_COMMIT = MAX_COMMIT_FILES
PATHS_INFO_BATCH = 500  # the Hub answers paths-info for at most ~1,000 paths per request


@dataclass(frozen=True)
class PushConfig:
    """How a push uploads and commits. Every field has a default that suits the Hub."""

    commit_files: int | None = None
    """Files per commit, at most (None: huggingface_hub's ladder alone decides, 20 to 1,000, budget.py)."""
    commit_bytes: int = DEFAULT_COMMIT_BYTES
    """Bytes per commit, at most."""
    workers: int = 8
    """Files uploading at the same time."""
    max_in_flight: int | None = None
    """Files added, not yet uploaded nor in a landed commit, at most; ``add`` waits beyond it (default: twice the
    largest commit)."""
    commit_interval: float = 300.0
    """Seconds an uploaded file waits at most for others to fill its commit (fewer, larger commits), on the Hub's
    clock (``LMPROBE_HUB_HOUR_SECONDS`` scales it with the hour)."""
    commits_per_hour: float | None = None
    """Commits in any hour, at most (None: ``LMPROBE_HUB_COMMITS_PER_HOUR``, default 100)."""
    max_retries: int = 5
    """Retries of a request that failed (a dropped connection, a 5xx answer)."""
    base_wait: float = 2.0
    """Seconds before the first retry, doubled for each further one (up to 60 s)."""
    commit_deadline: float = 3600.0
    """Seconds a request refused by the Hub's rate limits (429) keeps being retried."""
    max_retry_after: float = 600.0
    """Longest single wait, a Retry-After answer's included."""

    def __post_init__(self) -> None:
        for name in ("commit_files", "commit_bytes", "workers"):
            if name == "commit_files" and self.commit_files is None:
                continue
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1, not {getattr(self, name)!r}")
        if self.max_in_flight is not None and (not isinstance(self.max_in_flight, int) or self.max_in_flight < 1):
            raise InvalidArgumentError(f"max_in_flight must be an integer >= 1, not {self.max_in_flight!r}")
        if self.commits_per_hour is not None and not self.commits_per_hour > 0:
            raise InvalidArgumentError(f"commits_per_hour must be > 0, not {self.commits_per_hour!r}")
        for name in ("commit_interval", "base_wait", "commit_deadline", "max_retry_after"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0 seconds, not {getattr(self, name)!r}")
        if self.max_retries < 0:
            raise InvalidArgumentError(f"max_retries must be >= 0, not {self.max_retries!r}")

    @property
    def largest_commit(self) -> int:
        return MAX_COMMIT_FILES if self.commit_files is None else self.commit_files

    @property
    def in_flight(self) -> int:
        return self.max_in_flight if self.max_in_flight is not None else 2 * self.largest_commit

    def first_commit_files(self) -> int:
        return min(START_COMMIT_FILES, self.largest_commit)

    def next_commit_files(self, current: int, seconds: float | None) -> int:
        """The ladder's next step (budget.py), within ``commit_files``."""
        return min(next_commit_files(current, seconds=seconds), self.largest_commit)

    def policy(self) -> RetryPolicy:
        """Every push request retries dropped connections and 429/5xx answers; 429s until the deadline."""
        return RetryPolicy(retry_on_exceptions=transport_errors(), retry_on_status_codes=TRANSIENT_HTTP_STATUS,
                           rate_limit_status_codes=frozenset({429}), max_retries=self.max_retries,
                           base_wait=self.base_wait, max_wait=self.max_retry_after,
                           deadline=self.commit_deadline)


def push_policy(*, max_retries: int = 5, base_wait: float = 2.0) -> RetryPolicy:
    """The retry policy of a push with these settings (see PushConfig.policy)."""
    return PushConfig(max_retries=max_retries, base_wait=base_wait).policy()


@dataclass
class RepoFile:
    """A local file and its path in the repo."""

    rel: str
    local: Path
    size: int = -1
    sha256: str | None = None  # as recorded when the file was written, when it was


@dataclass
class PushResult:
    """What a push did."""

    sent: int = 0
    """Files uploaded and committed."""
    skipped: int = 0
    """Files that were on the Hub already, with the same content."""
    commits: int = 0
    bytes_sent: int = 0


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


def _http_cause(exc: BaseException) -> BaseException:
    """The HTTP answer behind ``exc``, if it was one ("Error while uploading" says less than "403 ...")."""
    node: BaseException | None = exc
    seen: set[int] = set()
    while node is not None and id(node) not in seen:
        if status_code(node) is not None:
            return node
        seen.add(id(node))
        node = node.__cause__ or node.__context__
    return exc


def _remote_id(entry: Any) -> str:
    return f"sha256:{entry.lfs.sha256}" if entry.lfs else f"git:{entry.blob_id}"


@dataclass
class _Item:
    file: RepoFile
    op: Any = None  # CommitOperationAdd, once uploaded
    ready_at: float = 0.0
    released: bool = False  # its content is on the Hub (LFS or Xet): the commit needs no local copy
    # a group another rank sent (relay.py): its id, its operations, what the repo holds once it landed, its files
    gid: tuple[int, int] | None = None
    ops: list = field(default_factory=list)
    expect: dict = field(default_factory=dict)  # path -> remote id ("sha256:.." / "git:..") or None (gone)
    weight: int = 1


@dataclass
class _State:
    """What the committer's threads share, under ``cv``."""

    cv: threading.Condition = field(default_factory=threading.Condition)
    pending: dict[str, _Item] = field(default_factory=dict)  # added, not landed
    ready: list[_Item] = field(default_factory=list)  # uploaded, not yet committed
    uploading: int = 0  # added, not yet uploaded
    flushing: int = 0
    producer_waiting: bool = False
    holding: bool = False  # finish() gathers what is uploaded into its final commit: no other commit starts
    window: CommitWindow | None = None  # the starts of this job's commits in the last hour
    urgent: bool = False  # the job's committer: a rank waits for its files to land, commit what is there now
    commit_files: int = START_COMMIT_FILES  # the next commit's size, on the ladder
    stop: bool = False
    error: BaseException | None = None


class HubCommitter:
    """Uploads files to one repo and revision in parallel and commits them in bounded, pipelined commits.

    Incremental use (a writer hands over files as it closes them):
    ``prepare(private)`` creates the repo and branch if needed; ``start()`` lists the repo once and
    starts the upload and commit threads; ``add(file)`` queues one file (it waits while
    ``max_in_flight`` files are in flight); ``flush()`` returns once every file added so far is in
    a landed commit; ``finish(last)`` flushes, commits ``last`` in one final commit and returns a
    :class:`PushResult`. ``on_landed(files)`` is called (from a background thread, one call at a
    time) with files as soon as they are on the Hub. Any failure is raised, as a PushError that says
    how to resume, by the next ``add``, ``flush`` or ``finish``. Use it as a context manager: leaving
    the block without ``finish`` stops the threads and commits nothing more.
    """

    def __init__(self, repo_id: str, *, token: str | bool | None, revision: str | None = None,
                 repo_type: str = "dataset", config: PushConfig | None = None, label: str = "dataset",
                 quiet: bool = True, on_landed: Callable[[list[RepoFile]], Any] | None = None,
                 on_uploaded: Callable[[RepoFile], Any] | None = None, under: str = "",
                 window: CommitWindow | None = None, send_to: Relay | None = None,
                 commit_for: Relay | None = None, claim: RepoClaim | None = None):
        self.api = hub_api(token)
        self.repo_id = repo_id
        self.repo_type = repo_type
        self.revision = revision or "main"
        self.config = config or PushConfig()
        self.policy = self.config.policy()
        self.label = label
        self.quiet = quiet
        self.on_landed = on_landed
        # told of a file whose content is on the Hub already (an LFS or Xet upload) before its commit lands: its
        # local copy may go (the commit names it by sha256), and it stops counting against max_in_flight
        self.on_uploaded = on_uploaded
        self.under = under  # the folder of the repo the push writes in: the one listing covers it only
        self.result = PushResult()
        self.remote: dict[str, str] = {}  # path -> "sha256:<hex>" or "git:<blob id>", as listed at start()
        self.listings = 0
        # the Hub's hour, scaled for tests (LMPROBE_HUB_HOUR_SECONDS); every commit of the job is counted in one window
        self.hour = hour_seconds()
        self.window = window or CommitWindow(self.config.commits_per_hour or commits_per_hour(), hour=self.hour)
        self._s = _State(window=self.window, commit_files=self.config.first_commit_files())
        # one committer for a job's ranks (relay.py): ``send_to`` uploads and hands each file's record to the job's
        # committer instead of committing it; ``commit_for`` is that committer, and commits what the ranks send
        self.send_to, self.commit_for = send_to, commit_for
        # the job's claim on the folder it writes (claim.py): every commit is made on the revision the job last saw,
        # and stops when another job holds the folder now
        self.claim = claim
        self._sent: list[_Item | str] = []  # sender: the groups sent, in order ("flush", "last": no file of its own)
        self._send_lock = threading.Lock()
        self._receive_lock = threading.Lock()
        self._receiver: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._committer: threading.Thread | None = None
        self._callback_lock = threading.Lock()
        self._bar: Progress | None = None
        self._hf_bars: Any = None
        self._finished = False

    @property
    def commits(self) -> int:
        return self.result.commits

    # ------------------------------------------------------------------ requests
    def call(self, what: str, fn: Callable[[], Any], landed: Callable[[], bool] | None = None) -> Any:
        """``fn()`` with retries; a failure becomes a PushError that says how to resume."""
        try:
            return call_with_retry(fn, policy=self.policy, landed=landed, on_wait=self._waiting(what))
        except LmprobeError:
            raise  # its own one line (another job writes the folder now, claim.py; the owner's README too large)
        except Exception as exc:
            raise self._push_error(what, exc) from exc

    def _push_error(self, what: str, exc: BaseException) -> PushError:
        if self.policy.is_rate_limit(exc):
            how = f" (the Hub's rate limit held for longer than commit_deadline={self.config.commit_deadline:g}s)"
        elif self.policy.is_transient(exc):
            how = f" after {self.policy.max_retries + 1} attempts"
        else:
            how = ""
        return PushError(
            f"{what} failed ({describe(_http_cause(exc))}){how}; the repo {self.repo_id} holds every commit made so far (shards "
            "only until the index is pushed, last). Run the same push again to resume: files already there are "
            "skipped.")

    def _waiting(self, what: str) -> Callable[[BaseException, float, bool], None]:
        def tell(exc: BaseException, seconds: float, rate_limited: bool) -> None:
            why = "the Hub's rate limit" if rate_limited else describe(exc)
            until = time.strftime("%H:%M:%S", time.localtime(time.time() + seconds))
            logger.warning("%s: waiting %.0fs (until %s) before trying again: %s%s", what, seconds, until, why,
                           f"; giving up {self.config.commit_deadline:g}s after the first try" if rate_limited else "")
            if self._bar is not None:
                self._bar.update(0, note=f"waiting {seconds:.0f}s: {'rate limit' if rate_limited else 'retry'}")
        return tell

    def remote_files(self) -> dict[str, str]:
        """path -> ``sha256:<hex>`` (LFS files) or ``git:<blob id>`` (regular files) at the target revision."""
        from huggingface_hub import RepoFile as HubRepoFile
        from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError

        self.listings += 1
        try:
            entries = self.api.list_repo_tree(self.repo_id, path_in_repo=self.under or None,
                                              repo_type=self.repo_type, revision=self.revision, recursive=True)
            return {e.path: _remote_id(e) for e in entries if isinstance(e, HubRepoFile)}
        except (RevisionNotFoundError, EntryNotFoundError):
            return {}

    def paths_now(self, paths: Sequence[str]) -> dict[str, str]:
        """What the repo holds now at these paths only (paths-info, in batches), as ``remote_files`` says it."""
        from huggingface_hub import RepoFile as HubRepoFile

        out: dict[str, str] = {}
        for i in range(0, len(paths), PATHS_INFO_BATCH):
            got = self.api.get_paths_info(self.repo_id, list(paths[i : i + PATHS_INFO_BATCH]),
                                          repo_type=self.repo_type, revision=self.revision)
            out.update({e.path: _remote_id(e) for e in got if isinstance(e, HubRepoFile)})
        return out

    def prepare(self, private: bool) -> None:
        """Create the repo (and the branch) if needed; a pull request's ref must be open already."""
        self.call("creating the repo", lambda: self.api.create_repo(
            self.repo_id, repo_type=self.repo_type, private=private, exist_ok=True))
        if is_pull_request(self.revision):
            check_pull_request_open(HubRef(self.repo_id, self.repo_type, self.revision), token=self.api.token)
        elif self.revision != "main":
            self.call("creating the branch", lambda: self.api.create_branch(
                self.repo_id, repo_type=self.repo_type, branch=self.revision, exist_ok=True))

    # ------------------------------------------------------------------ the incremental API
    def start(self) -> HubCommitter:
        """List the repo (once for the whole push) and start the upload and commit threads."""
        if self._pool is not None:
            return self
        self.remote = self.call(f"listing {self.repo_id}", self.remote_files)
        self._bar = Progress(0, desc=f"push {self.repo_id}", unit="B", quiet=self.quiet)
        # one bar (or line) for the push, not one per file from huggingface_hub's uploads (8 at once)
        self._hf_bars = third_party_bars(False)
        self._hf_bars.__enter__()
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="lmprobe-upload")
        loop = self._relay_loop if self.send_to is not None else self._commit_loop
        self._committer = threading.Thread(target=loop, name="lmprobe-commit", daemon=True)
        self._committer.start()
        if self.commit_for is not None:
            self._receiver = threading.Thread(target=self._receive_loop, name="lmprobe-receive", daemon=True)
            self._receiver.start()
        return self

    def add(self, file: RepoFile) -> None:
        """Queue ``file`` for upload and commit; waits while ``max_in_flight`` files are in flight.

        Returns at once otherwise: the file is checked against the repo, uploaded and committed in the
        background. Its local copy must stay until ``on_landed`` names it (or ``flush`` returns).
        """
        if self._pool is None or self._finished:
            raise RuntimeError("HubCommitter.add() needs start() first, and no finish() yet")
        self._check_local(file)
        s = self._s
        with s.cv:
            self._raise_error()
            if file.rel in s.pending:
                raise InvalidArgumentError(f"{file.rel} was added twice to the push to {self.repo_id}")
            while sum(not it.released for it in s.pending.values()) >= self.config.in_flight:
                s.producer_waiting = True
                s.cv.notify_all()
                s.cv.wait(0.5)
                self._raise_error()
            s.producer_waiting = False
            s.pending[file.rel] = item = _Item(file)
            s.uploading += 1
        self._grow_bar([file])
        self._pool.submit(self._upload, item)

    def holds(self, rel: str) -> bool:
        """Whether a file added at repo path ``rel`` is not yet in a landed commit (another may not be added there)."""
        with self._s.cv:
            return rel in self._s.pending

    def add_uploaded(self, file: RepoFile) -> None:
        """Commit ``file`` (its ``sha256`` and ``size`` known) whose content an earlier run uploaded already
        (LFS or Xet): it is named by its sha256, with no local copy and nothing sent again. A file the repo
        has with that content counts as landed at once."""
        if self._pool is None or self._finished:
            raise RuntimeError("HubCommitter.add_uploaded() needs start() first, and no finish() yet")
        if not file.sha256 or file.size < 0:
            raise InvalidArgumentError(f"{file.rel}: add_uploaded needs the file's sha256 and size")
        if _same(file, self.remote.get(file.rel)):
            self._landed([file], sent=False)
            return
        # a placeholder for the content, then what the commit needs: the object is on the Hub (private fields of
        # huggingface_hub's operation; tests/publish/test_push_pipeline.py pins them against the installed version)
        op = _by_reference(file.rel, file.sha256, file.size)
        s = self._s
        item = _Item(file, op, time.monotonic(), released=True)
        if self.send_to is not None:
            with s.cv:
                self._raise_error()
                s.pending[file.rel] = item
            self._send(item)
            return
        with s.cv:
            self._raise_error()
            s.pending[file.rel] = item
            s.ready.append(item)
            s.cv.notify_all()

    def rename(self, moves: Sequence[tuple[str, str]], *, batch: int = RENAMES_PER_COMMIT) -> None:
        """Rename files of this revision server-side (a copy, then a delete of the original: nothing is sent), in
        commits of at most ``batch`` moves (a copy names an object the Hub holds, so these commits may be larger
        than upload commits). Resumable: a move an interrupted run made (its source gone, its target there) is
        not made again; a move whose source and target are both missing is a PushError."""
        todo = self._moves_to_make(moves)
        for i in range(0, len(todo), batch):
            self._rename_commit(todo[i : i + batch])

    def _moves_to_make(self, moves: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """The moves not made yet (a re-run after a kill finds some made); a PushError for a lost file."""
        if not moves:
            return []
        now = self.call(f"listing {len(moves)} file(s) to rename in {self.repo_id}",
                        lambda: self.paths_now([p for m in moves for p in m]))
        lost = [a for a, b in moves if a not in now and b not in now]
        if lost:
            raise PushError(f"{self.repo_id}: {len(lost)} file(s) to rename are missing ({lost[0]}); the repo "
                            "changed while the job ran: run it again with --overwrite")
        return [(a, b) for a, b in moves if a in now]

    def _rename_commit(self, part: list[tuple[str, str]]) -> None:
        self.take_turn()
        self._commit([], f"lmprobe: rename {len(part)} file(s)", moves=part)

    def take_turn(self) -> None:
        """Wait until the job's commit window lets one more commit start, and count it as started (every commit to
        the repo takes a turn, this committer's own and those made beside it, e.g. deleting an old index)."""
        s = self._s
        with s.cv:
            if (wait := s.window.wait(time.monotonic())) > 5:
                logger.info("%s: the job's %g commits an hour are spent; the next commit waits %.0fs",
                            self.repo_id, s.window.per_hour, wait)
            while (wait := s.window.wait(time.monotonic())) > 0:
                s.cv.wait(min(wait, 0.5))
            s.window.record(time.monotonic())

    def _grow_bar(self, files: Sequence[RepoFile]) -> None:
        bar = self._bar
        if bar is not None:
            bar.total = (bar.total or 0) + sum(max(0, f.size) for f in files)
            if bar.bar is not None:  # the tqdm bar on a terminal
                bar.bar.total = bar.total
                bar.bar.refresh()

    def flush(self) -> None:
        """Return once every file added so far is in a landed commit (a partial commit is made now)."""
        s = self._s
        with s.cv:
            s.flushing += 1
            s.cv.notify_all()
            try:
                while s.pending and s.error is None:
                    s.cv.wait(0.5)
                self._raise_error()
            finally:
                s.flushing -= 1

    def finish(self, last: Sequence[RepoFile] = (), *, message: str | None = None,
               moves: Sequence[tuple[str, str]] = (), remove: Sequence[str] = (), drop: Sequence[str] = (),
               before: Callable[[str | None], None] | None = None, wait: bool = True) -> PushResult:
        """Commit what is uploaded, ``last`` (the entry point: index and card), the renames ``moves`` (server-side),
        the removal of the folders ``remove`` and of the files ``drop`` (the job's marker, claim.py) in one final
        commit; stop the threads. ``before(parent)``: called before each try of the final commit with the revision
        it is made on (None: the branch, without a claim), to merge what the commit takes from the repo (the
        owner's README.md) as that revision holds it.

        One commit ends the work however much of it is left (each commit costs a turn of the repo's commit
        rate); renames past one commit's worth (``RENAMES_PER_COMMIT``) go in commits of their own first. Files of
        ``last`` already on the Hub with the same content are skipped; nothing is committed when nothing is
        left to do. Returns what the push did.

        A sender (one rank of a job, ``send_to``) hands its last group to the job's committer; with ``wait=False``
        it returns once every file is uploaded and handed over, without asking for a commit now or waiting for it
        to land: the job's committer commits the ranks' last groups together when the job ends (``finish`` on
        rank 0), instead of a commit or two a rank as each one ends at its own time in the job's tail.
        """
        if self._pool is None:
            self.start()
        if self.send_to is not None:
            return self._finish_sent(last, moves, remove, wait=wait)
        if self.commit_for is not None:  # the job's end: every group the ranks handed over before it is taken
            self._receive_once()
        with self._s.cv:  # a file of ``last`` added already (a writer handed it over) goes with those added
            last = [f for f in last if f.rel not in self._s.pending]
        for f in last:
            self._check_local(f)
        self._grow_bar(last)
        try:
            final = [_Item(f) for f in last]
            pool = self._pool
            assert pool is not None
            # uploaded while the other files finish; committed once they are all uploaded
            uploads: list[Future] = [pool.submit(self._upload_one, it) for it in final]
            held = self._hold()
            final = [it for it, fut in zip(final, uploads, strict=True) if fut.result()]
            self._raise_error()
            moves = self._retarget(held, moves)
            todo = self._moves_to_make(moves)
            cut = len(todo) - (len(todo) % RENAMES_PER_COMMIT or RENAMES_PER_COMMIT) if todo else 0
            for i in range(0, cut, RENAMES_PER_COMMIT):
                self._rename_commit(todo[i : i + RENAMES_PER_COMMIT])
            while held and len(held) + len(final) > self._s.commit_files:  # the final commit stays in bounds
                chunk, held = held[: self._s.commit_files], held[self._s.commit_files :]
                self.take_turn()
                self._timed_commit(chunk, f"lmprobe: add {len(chunk)} {self.label} file(s)")
            items = held + final
            if items or todo[cut:] or remove or drop:
                self.take_turn()
                what = " and ".join(it.file.rel for it in final) or f"{len(items)} file(s)"
                self._commit(items, message or f"lmprobe: add {self.label} {what}", moves=todo[cut:],
                             remove=[r.rstrip("/") for r in remove], drop=drop, before=before)
        finally:
            self.close()
        return self.result

    # ------------------------------------------------------------------ one committer for a job's ranks
    def _record(self, item: _Item) -> dict:
        """What the job's committer needs to commit an uploaded file: its sha256 (content on the Hub), or the
        content itself (a small regular file, committed inline)."""
        f = item.file
        if item.op is None or getattr(item.op, "_upload_mode", "lfs") == "lfs":
            return {"rel": f.rel, "size": f.size, "sha256": f.sha256}
        return {"rel": f.rel, "content": base64.b64encode(f.local.read_bytes()).decode()}

    def _send(self, item: _Item | str, group: dict | None = None) -> None:
        """Hand a group to the job's committer, in order (``item``: one file; "flush" or "last": ``group``)."""
        assert self.send_to is not None
        with self._send_lock:
            self.send_to.send(group if isinstance(item, str) else {"files": [self._record(item)]})
            self._sent.append(item)

    def _relay_loop(self) -> None:
        """A sender: the files whose group the job's committer reports landed are done (``on_landed``)."""
        s, done = self._s, 0
        assert self.send_to is not None
        while True:
            with s.cv:
                if s.error is not None or s.stop:
                    return
                s.cv.wait(0.1)
            try:
                n = self.send_to.landed()
            except BaseException as exc:
                self._fail(exc)
                return
            if n > done:
                with self._send_lock:
                    items = self._sent[done:n]
                done = n
                files = [it.file for it in items if isinstance(it, _Item)]
                if files:
                    self._landed(files, sent=True)
                if "last" in items:
                    with s.cv:
                        s.pending.pop("", None)
                        s.cv.notify_all()

    def _finish_sent(self, last: Sequence[RepoFile], moves: Sequence[tuple[str, str]],
                     remove: Sequence[str], *, wait: bool = True) -> PushResult:
        """A sender's end: once its files landed, ``last``, the renames and the removals go to the job's committer as
        one group (committed whole), and this returns once that landed; ``wait=False``: once they are handed over
        (every file before them, in order: the group is never committed before them)."""
        s = self._s
        with s.cv:
            last = [f for f in last if f.rel not in s.pending]
        for f in last:
            self._check_local(f)
        try:
            final = [_Item(f) for f in last]
            pool = self._pool
            assert pool is not None
            uploads = [pool.submit(self._upload_one, it) for it in final]
            with s.cv:  # every file of this rank uploaded and handed over
                while s.uploading and s.error is None:
                    s.cv.wait(0.5)
            self._raise_error()
            if wait:  # the job's committer is told to commit this rank's files without waiting for more
                self._send("flush", {"flush": True})
                self._hold()
            final = [it for it, fut in zip(final, uploads, strict=True) if fut.result()]
            self._raise_error()
            todo = self._moves_to_make(moves)
            if final or todo or remove:
                with s.cv:
                    s.pending[""] = _Item(RepoFile("", Path()))  # the last group, until it landed
                self._send("last", {"files": [self._record(it) for it in final], "moves": [list(m) for m in todo],
                                  "remove": [r.rstrip("/") for r in remove], "last": True, "urgent": wait})
                with s.cv:
                    while wait and "" in s.pending and s.error is None:
                        s.cv.wait(0.5)
                    self._raise_error()
                self.result.sent += len(final)
        finally:
            self.close()
        return self.result

    def _receive_loop(self) -> None:
        """The job's committer: the groups the ranks send become commit items, in the order each rank sent them."""
        s = self._s
        while True:
            with s.cv:
                if s.error is not None or s.stop:
                    return
                s.cv.wait(0.1)
            if not self._receive_once():
                return

    def _receive_once(self) -> bool:
        """Take the groups the ranks sent since the last look (False: the committer failed)."""
        s = self._s
        assert self.commit_for is not None
        with self._receive_lock:
            try:
                got = self.commit_for.receive()
            except BaseException as exc:
                self._fail(exc)
                return False
            urgent = any(isinstance(g, dict) and (g.get("flush") or g.get("last") and g.get("urgent", True))
                         for _, g in got)
            try:
                items = [_group_item(gid, group) for gid, group in got if not group.get("flush")]
            except BaseException as exc:
                self._fail(exc)
                return False
            for gid, group in got:
                if group.get("flush"):  # nothing to commit: counted as landed, in its turn
                    self.commit_for.report(gid)
            with s.cv:
                s.urgent = s.urgent or urgent
                for it in items:
                    s.pending[f"relay:{it.gid}"] = it
                    s.ready.append(it)
                s.cv.notify_all()
        return True

    def _retarget(self, held: list[_Item], moves: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """A file to rename that is uploaded but not yet committed is committed under its new name (its content is
        on the Hub already: only the commit names it); the moves left are of files the repo holds."""
        to = dict(moves)
        for it in held:
            dst = to.pop(it.file.rel, None)
            if dst is not None:
                with self._s.cv:
                    self._s.pending[dst] = self._s.pending.pop(it.file.rel, it)
                it.file = RepoFile(dst, it.file.local, it.file.size, it.file.sha256)
                it.op = copy.copy(it.op)
                it.op.path_in_repo = dst
        return [(a, b) for a, b in moves if a in to]

    def _hold(self) -> list[_Item]:
        """Stop the commit loop from starting commits, wait until every file added is uploaded (or landed in a
        commit already started), and take the uploaded ones: they go in the final commit."""
        s = self._s
        with s.cv:
            s.holding = True
            s.flushing += 1
            s.cv.notify_all()
            try:
                # (a rank's group is pending under "relay:<gid>": compared as items, not by path)
                while s.error is None and {id(it) for it in s.pending.values()} - {id(it) for it in s.ready}:
                    s.cv.wait(0.5)
                self._raise_error()
                held, s.ready = s.ready, []
            finally:
                s.flushing -= 1
        return held

    def close(self) -> None:
        """Stop the threads; files not yet committed are not (their uploaded objects stay, for a re-run)."""
        s = self._s
        self._finished = True
        with s.cv:
            s.stop = True
            s.cv.notify_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._committer is not None and self._committer is not threading.current_thread():
            self._committer.join(timeout=60)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._hf_bars is not None:
            self._hf_bars.__exit__(None, None, None)
            self._hf_bars = None

    def __enter__(self) -> HubCommitter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def push_files(self, files: Iterable[RepoFile], last: Sequence[RepoFile]) -> int:
        """Upload and commit ``files``, then ``last`` in a final commit. Returns how many files were sent."""
        for f in [*files, *last]:  # a missing file is refused before anything is sent
            self._check_local(f)
        self.start()
        for f in files:
            self.add(f)
        return self.finish(last).sent

    # ------------------------------------------------------------------ the threads
    def _check_local(self, f: RepoFile) -> None:
        if not f.local.is_file():
            raise PushError(f"{f.local} is missing; the local copy is incomplete, nothing more was pushed")
        f.size = f.local.stat().st_size

    def _raise_error(self) -> None:
        if self._s.error is not None:
            raise self._s.error

    def _fail(self, exc: BaseException) -> None:
        s = self._s
        with s.cv:
            first = s.error is None
            if first:
                s.error = exc
            s.cv.notify_all()
        if first and self.commit_for is not None:  # the ranks waiting for their files to land hear of it
            try:
                self.commit_for.fail(str(exc))
            except Exception:  # noqa: BLE001 - the store may be gone with the job; the error is raised here anyway
                logger.warning("could not tell the job's ranks that its committer failed: %s", exc)

    def _upload_one(self, item: _Item) -> bool:
        """Upload ``item`` unless the repo has it; False when it was there (it counts as landed)."""
        from huggingface_hub import CommitOperationAdd

        f = item.file
        remote = self.remote.get(f.rel)
        if remote is not None:
            if f.sha256 is None and remote.startswith("sha256:"):
                f.sha256 = sha256_file(f.local)  # only to compare: the repo has a file at this path
            if _same(f, remote):
                self._landed([f], sent=False)
                return False
        op = CommitOperationAdd(path_in_repo=f.rel, path_or_fileobj=str(f.local))
        if f.sha256:
            op.upload_info.sha256 = bytes.fromhex(f.sha256)  # recorded at write time: LFS and hf_xet take it as is
        self.call(f"uploading {f.rel} to {self.repo_id}", lambda: self.api.preupload_lfs_files(
            self.repo_id, additions=[op], repo_type=self.repo_type, revision=self.revision, num_threads=1,
            free_memory=False))
        if f.sha256 is None and op.upload_info.is_hashed:  # computed by the upload itself (LFS, or hf_xet)
            f.sha256 = op.upload_info.sha256.hex()
        item.op = op
        return True

    def _upload(self, item: _Item) -> None:
        s = self._s
        try:
            if s.error is not None or s.stop:
                return
            sent = self._upload_one(item)
        except BaseException as exc:  # handed to the caller by its next add/flush/finish
            self._fail(exc)
            return
        if sent and self.on_uploaded is not None and getattr(item.op, "_upload_mode", None) == "lfs":
            try:
                with self._callback_lock:
                    self.on_uploaded(item.file)
            except BaseException as exc:
                self._fail(exc)
                return
            item.released = True
        if sent and self.send_to is not None:  # the job's committer commits it; it is done once that landed
            try:
                self._send(item)
            except BaseException as exc:
                self._fail(exc)
            with s.cv:
                s.uploading -= 1
                s.cv.notify_all()
            return
        with s.cv:
            s.uploading -= 1
            if sent:
                item.ready_at = time.monotonic()
                s.ready.append(item)
            else:
                s.pending.pop(item.file.rel, None)
            s.cv.notify_all()

    def _due(self) -> float | None:
        """0 when a commit should start now, else seconds until one is due (None: not before more news).

        A commit is wanted once a commit's worth of files (the ladder's current step) is uploaded, or half the
        files ``add`` may hold locally (they wait for the commit before they are deleted), or when nothing
        more is coming for now, or when the oldest uploaded file has waited ``commit_interval``; it starts
        when the job's commit window lets it."""
        s, cfg = self._s, self.config
        if not s.ready or s.holding:
            return None
        now = time.monotonic()
        n_bytes = sum(it.file.size for it in s.ready)
        local = sum(not it.released for it in s.ready)
        if sum(it.weight for it in s.ready) >= s.commit_files or n_bytes >= cfg.commit_bytes or local >= max(1, cfg.in_flight // 2):
            due = 0.0
        elif s.uploading == 0 and (s.flushing or s.producer_waiting or s.urgent):
            due = 0.0  # nothing more is coming for now: do not keep the caller waiting
        else:
            due = max(0.0, s.ready[0].ready_at + cfg.commit_interval * self.hour / HOUR - now)
        return due if due > 0 else s.window.wait(now)

    def _commit_loop(self) -> None:
        s, cfg = self._s, self.config
        n = 0
        while True:
            with s.cv:
                while s.error is None and not s.stop:
                    due = self._due()
                    if due == 0.0:
                        break
                    s.cv.wait(0.5 if due is None else min(due, 0.5))
                if s.error is not None or s.stop:  # stopped: what is not committed stays for a re-run
                    return
                batch, n_bytes, n_files = [], 0, 0
                s.window.record(time.monotonic())
                while s.ready and (not batch or (n_files + s.ready[0].weight <= s.commit_files
                                                 and n_bytes + s.ready[0].file.size <= cfg.commit_bytes)):
                    batch.append(s.ready.pop(0))
                    n_bytes += batch[-1].file.size
                    n_files += batch[-1].weight
                s.urgent = s.urgent and bool(s.ready)
            n += 1
            try:
                self._timed_commit(batch, f"lmprobe: add {len(batch)} {self.label} file(s) (commit {n} of this push)")
            except BaseException as exc:
                self._fail(exc)
                return

    def _timed_commit(self, batch: list[_Item], message: str) -> None:
        """Commit ``batch``; the next commit's size follows the ladder by how long this one took (on the Hub's
        clock: a fast commit takes under 40 s of a 3,600 s hour)."""
        s = self._s
        t0 = time.monotonic()
        try:
            self._commit(batch, message)
        except BaseException:
            with s.cv:
                s.commit_files = self.config.next_commit_files(s.commit_files, None)
            raise
        with s.cv:
            s.commit_files = self.config.next_commit_files(s.commit_files, (time.monotonic() - t0) * HOUR / self.hour)

    def _commit(self, batch: list[_Item], message: str, *, moves: Sequence[tuple[str, str]] = (),
                remove: Sequence[str] = (), drop: Sequence[str] = (),
                before: Callable[[str | None], None] | None = None) -> None:
        """Commit ``batch`` (uploaded), the server-side renames ``moves``, the removal of the folders ``remove`` and
        of the files ``drop``; before a retry, the commit's own paths are checked so it is never made twice. With a
        claim (claim.py), the commit is made on the revision the job last saw."""
        from huggingface_hub import CommitOperationCopy, CommitOperationDelete

        files = [it.file for it in batch if it.gid is None]
        groups = [it for it in batch if it.gid is not None]
        ops: list[Any] = [it.op for it in batch if it.gid is None] + [op for it in groups for op in it.ops]
        expect = {p: v for it in groups for p, v in it.expect.items()}
        ops += [CommitOperationCopy(src_path_in_repo=a, path_in_repo=b) for a, b in moves]
        ops += [CommitOperationDelete(path_in_repo=a) for a, _ in moves]
        ops += [CommitOperationDelete(path_in_repo=f"{r}/", is_folder=True) for r in remove]
        ops += [CommitOperationDelete(path_in_repo=p) for p in drop]

        def landed() -> bool:
            now = self.paths_now([f.rel for f in files] + [p for m in moves for p in m] + list(expect) + list(drop))
            return (all(_same(f, now.get(f.rel)) for f in files) and all(b in now and a not in now for a, b in moves)
                    and all(now.get(p) == v for p, v in expect.items()) and not any(p in now for p in drop)
                    and not (remove and self.api.get_paths_info(self.repo_id, list(remove), repo_type=self.repo_type,
                                                                revision=self.revision)))

        started = self._s.window.starts[-1] if self._s.window.starts else None
        try:
            self.call(f"committing {len(ops)} change(s) to {self.repo_id}",
                      lambda: self.create_commit(ops, message, before=before), landed=landed)
        finally:
            with self._s.cv:  # counted from its answer (the Hub counted it on arrival, before that)
                if started is not None:
                    self._s.window.landed(started, time.monotonic())
        with self._s.cv:
            self.result.commits += 1
        for f in files:  # what the repo holds now, for a file added again later in this push
            self.remote[f.rel] = f"sha256:{f.sha256}" if f.sha256 else f"git:{git_blob_id(f.local)}"
        if files:
            self._landed(files, sent=True)
        if groups:
            assert self.commit_for is not None
            for it in groups:
                self.commit_for.report(it.gid)
            with self._s.cv:
                self.result.sent += sum(it.weight for it in groups)
                for it in groups:
                    self._s.pending.pop(f"relay:{it.gid}", None)
                self._s.cv.notify_all()

    def create_commit(self, ops: list[Any], message: str, *,
                      before: Callable[[str | None], None] | None = None) -> Any:
        """One commit of ``ops`` (no retry: ``call`` adds it); with a claim, on the revision the job last saw, and
        stopped when another job holds the folder now (claim.py; ``before`` as for ``finish``)."""
        def make(parent: str | None) -> Any:
            if before is not None:
                before(parent)
            return self.api.create_commit(self.repo_id, ops, commit_message=message, repo_type=self.repo_type,
                                          revision=self.revision, parent_commit=parent)

        return make(None) if self.claim is None else self.claim.commit(make)

    def _landed(self, files: list[RepoFile], *, sent: bool) -> None:
        """``files`` are on the Hub: tell ``on_landed``, then let ``flush`` and ``add`` go on."""
        if self._bar is not None:
            self._bar.update(sum(max(0, f.size) for f in files), note="")
        if self.on_landed is not None:
            with self._callback_lock:
                self.on_landed(files)
        s = self._s
        with s.cv:
            if sent:
                self.result.sent += len(files)
                self.result.bytes_sent += sum(f.size for f in files)
            else:
                self.result.skipped += len(files)
            for f in files:
                s.pending.pop(f.rel, None)
            s.cv.notify_all()


def _by_reference(rel: str, sha256: str, size: int) -> Any:
    """An add operation naming content already on the Hub (LFS or Xet) by its sha256: nothing is uploaded."""
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.lfs import UploadInfo

    # a placeholder for the content, then what the commit needs: the object is on the Hub (private fields of
    # huggingface_hub's operation; tests/publish/test_push_pipeline.py pins them against the installed version)
    op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=b"")
    op.upload_info = UploadInfo(sha256=bytes.fromhex(sha256), size=size, sample=b"")
    op._upload_mode = "lfs"
    op._is_uploaded = True
    return op


def _group_item(gid: tuple[int, int], group: Any) -> _Item:
    """A group a rank sent (relay.py) as one commit item: its operations and what the repo holds once it landed.
    The group is untrusted input: every path is checked, every sha256 and size too."""
    from huggingface_hub import CommitOperationAdd, CommitOperationCopy, CommitOperationDelete

    if not isinstance(group, dict):
        raise PushError(f"rank {gid[0]} sent a malformed commit record; run the job again")
    ops: list[Any] = []
    expect: dict[str, str | None] = {}
    size = 0
    try:
        for f in group.get("files", []):
            rel = check_relpath(f["rel"], "a relayed file")
            if "content" in f:
                data = base64.b64decode(f["content"], validate=True)
                ops.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=data))
                expect[rel] = "git:" + hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                size += len(data)
            else:
                sha, n = f["sha256"], f["size"]
                if not (isinstance(sha, str) and len(sha) == 64 and isinstance(n, int) and n >= 0):
                    raise ValueError(f"{rel}: a bad sha256 or size")
                bytes.fromhex(sha)
                ops.append(_by_reference(rel, sha, n))
                expect[rel] = f"sha256:{sha}"
                size += n
        moves = [(check_relpath(a, "a relayed rename"), check_relpath(b, "a relayed rename"))
                 for a, b in group.get("moves", [])]
        remove = [check_relpath(r, "a relayed folder") for r in group.get("remove", [])]
    except (KeyError, TypeError, ValueError, LmprobeError) as exc:
        raise PushError(f"rank {gid[0]} sent a malformed commit record ({exc}); run the job again") from exc
    ops += [CommitOperationCopy(src_path_in_repo=a, path_in_repo=b) for a, b in moves]
    ops += [CommitOperationDelete(path_in_repo=a) for a, _ in moves]
    ops += [CommitOperationDelete(path_in_repo=f"{r}/", is_folder=True) for r in remove]
    expect.update({a: None for a, _ in moves})
    return _Item(RepoFile(f"<rank {gid[0]} group {gid[1]}>", Path(), size), ready_at=time.monotonic(),
                 released=True, gid=gid, ops=ops, expect=expect, weight=max(1, len(ops) - len(moves)))
