"""A Hub output's copy of its writer's checkpoint, so that a rank that comes back on another node resumes from what
the Hub holds.

The writer's checkpoint (``.lmprobe-staging/``: its state, the index rows so far, the running statistics) lives on
the node that wrote it, and so does the open shard's partial file. The output's ``RESUME_FILE`` on the Hub holds a
copy of the last checkpoint whose shards have all landed: one parquet file per part, overwritten each time (so that
a copy is never half of one checkpoint and half of the next), that goes up with whatever the committer commits next
(no commit of its own), one copy at a time. Its rows are the index rows so far; its key-value metadata
``lmprobe:resume`` is JSON: ``{"version", "state": the writer's state (with ``progress``, where the caller stood in its source, and
``replay``, the rows, tokens and progress before the batch that opened the earliest open shard: a corpus is
replayed from there), "files": {path: [bytes, sha256]} of the
shards it names, "statistics": the running statistics' safetensors bytes in base64, or null}`` (no pickle).

A rank with nothing staged finds it, checks it as untrusted input (``check_resume``), seeds its staging folder from
it (never a shard: the shards it names are on the Hub, at the stated sizes and hashes) and the writer resumes after
its rows, recomputing only those of the shards the checkpoint left open (``DatasetWriter.refill_batch``). At worst
a rank redoes the shards that had not landed.

At full size a copy costs one upload of the part's index rows so far (W1: ~16,000 windows a rank, a few MB), each
time its writer checkpoints and the copy before has landed; one file per part, removed with the parts' folder.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from ..base.atomic import atomic_write
from ..base.hashing import sha256_file
from ..base.paths import check_relpath
from ..base.safeio import loads
from ..errors import LmprobeError, ResumeMismatchError
from ..format.resume import check_progress, check_replay, count, same_extraction
from ..format.spec import MAX_SHARD_SIZE, STAGING_DIR
from ..format.staging import check_staging_name
from .commits import RepoFile
from .hub import HubFiles, HubRef, hub_api

logger = logging.getLogger(__name__)

RESUME_DIR = ".lmprobe-resume"
RESUME_FILE = f"{RESUME_DIR}/checkpoint.parquet"
RESUME_KEY = b"lmprobe:resume"
RESUME_VERSION = 1
#: the largest copy a part may have (the Hub takes files under 20 GB), and its metadata (the state, the statistics)
MAX_RESUME_BYTES = 20 * 10**9
MAX_RESUME_META_BYTES = 256 * 2**20


def write_resume(staging: Path, state: dict, files: dict[str, tuple[int, str]], dst: Path) -> bool:
    """A checkpoint of the writer in ``staging`` (its ``state`` and recorded ``files``) as ``RESUME_FILE``, at
    ``dst``: the index parts as one table, streamed part by part; False when it has no rows (nothing to resume)."""
    parts = [staging / "index" / f"part-{i:06d}.parquet" for i in range(state["index_parts"])]
    if not parts:
        return False
    stats = state.get("statistics_file")
    doc = {"version": RESUME_VERSION, "state": {**state, "index_parts": 1},
           "files": {rel: list(v) for rel, v in sorted(files.items())},
           "statistics": base64.b64encode((staging / stats).read_bytes()).decode() if stats else None}
    meta = {RESUME_KEY: json.dumps(doc).encode()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = None
    for part in parts:
        t = pq.read_table(part)
        if writer is None:
            writer = pq.ParquetWriter(dst, t.schema.with_metadata(meta), compression="zstd")
        writer.write_table(t.replace_schema_metadata(meta))
    assert writer is not None
    writer.close()
    return True


def _sha256(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _size(v: Any, most: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= most


def check_resume(meta: bytes, listing: dict[str, tuple[int, str | None]], settings: dict, where: str) -> dict:
    """The ``lmprobe:resume`` metadata of a part's copy, read back as untrusted input: its schema; every shard it
    names a path under ``tensors/`` inside the part that the Hub holds (``listing``: path in the part -> size, LFS
    sha256 or None) at the stated size and hash; the shards of the writer's state exactly those; its settings this
    extraction's. Returns the checked document; else a ResumeMismatchError, one line naming what is wrong and what
    to do."""

    def refuse(why: str) -> ResumeMismatchError:
        return ResumeMismatchError(f"{where}/{RESUME_FILE} {why}; re-run with --overwrite to start this part over")

    if len(meta) > MAX_RESUME_META_BYTES:
        raise refuse(f"holds more than the {MAX_RESUME_META_BYTES} bytes of checkpoint a copy may have")
    doc = loads(meta, what=f"{where}/{RESUME_FILE}", error=ResumeMismatchError)
    if not isinstance(doc, dict) or doc.get("version") != RESUME_VERSION:
        raise refuse("is not a checkpoint this lmprobe version wrote")
    state, files, stats = doc.get("state"), doc.get("files"), doc.get("statistics")
    if not isinstance(state, dict) or not isinstance(files, dict) or not (stats is None or isinstance(stats, str)):
        raise refuse("lacks its state, files or statistics")
    fingerprint = state.get("fingerprint")
    recorded = fingerprint.get("caller") if isinstance(fingerprint, dict) else None
    if not isinstance(recorded, dict) or not same_extraction(recorded, json.loads(json.dumps(settings, default=str))):
        raise ResumeMismatchError(f"{where} holds a partial part written with other settings; re-run with the "
                                  "original settings to resume, or pass --overwrite to start over")
    for rel, v in files.items():
        try:
            check_relpath(rel, "a checkpoint's shard")
        except LmprobeError:
            raise refuse(f"names {str(rel)[:80]!r}, not a path inside the part") from None
        if not rel.startswith("tensors/") or not (isinstance(v, list) and len(v) == 2 and _size(v[0], MAX_SHARD_SIZE)
                                                  and _sha256(v[1])):
            raise refuse(f"names {rel[:80]!r} with {str(v)[:80]}, not a shard's path, size and sha256")
        there = listing.get(rel)
        if there is None or there[0] != v[0] or (there[1] is not None and there[1] != v[1]):
            raise refuse(f"names {rel}, which the Hub does not hold at {v[0]} bytes with that sha256")
    try:
        closed = sorted((f["bytes"], f["sha256"]) for st in state["streams"].values() for d in st["closed"]
                        for f in d["files"].values())
    except (KeyError, TypeError, AttributeError):
        raise refuse("holds a damaged writer state") from None
    if closed != sorted((v[0], v[1]) for v in files.values()):
        raise refuse("lists other shards than its writer state")
    try:  # where the source stood, and where the open shards began in it (a corpus is replayed from there)
        num_prompts, num_tokens = count(state.get("num_prompts")), count(state.get("num_tokens", 0))
        if state.get("progress") is not None:
            check_progress(state["progress"])
        if state.get("replay") is not None:
            check_replay(state["replay"], num_prompts, num_tokens)
    except ValueError as exc:
        raise refuse(f"holds a damaged source position ({str(exc)[:120]})") from None
    if state.get("index_parts") != 1 or bool(state.get("statistics_file")) != (stats is not None):
        raise refuse("does not hold the index rows and statistics its writer state names")
    return doc


def seed_staging(staging: Path, doc: dict, copy: Path) -> None:
    """The writer's staging folder (``staging``: ``.lmprobe-staging``) made from a checked copy (``copy``, its
    metadata ``doc``): its rows as the one index part, its statistics, then its state."""
    (staging / "index").mkdir(parents=True, exist_ok=True)
    state = doc["state"]
    if doc["statistics"] is not None:
        name = check_staging_name(state.get("statistics_file"), "a statistics file")
        try:
            atomic_write(staging / name, base64.b64decode(doc["statistics"], validate=True))
        except ValueError:
            raise ResumeMismatchError(f"{copy}: its statistics are not base64; re-run with --overwrite to start "
                                      "this part over") from None
    t = pq.read_table(copy)
    if t.num_rows != state.get("num_prompts"):
        raise ResumeMismatchError(f"{copy} holds {t.num_rows} index rows, its state {state.get('num_prompts')}; "
                                  "re-run with --overwrite to start this part over")
    pq.write_table(t.replace_schema_metadata(None), staging / "index" / "part-000000.parquet")
    atomic_write(staging / "state.json", json.dumps(state).encode())  # last: the folder is complete


class CheckpointCopies:
    """A Hub session's copies of its writer's checkpoints. One copy waits until every shard it names has landed,
    then goes (always to the same path) once the copy before it has landed; a new one is made only when none
    waits, so that a copy is made about once a commit, not at every checkpoint (each holds the index rows so far)."""

    def __init__(self, local: Path, repo_path: Callable[[str], str], landed: set[str],
                 pending: Callable[[str], bool]):
        self.local, self.repo_path, self.pending = local, repo_path, pending  # pending: the committer holds a path
        self._lock = threading.Lock()
        self._landed = set(landed)  # repo paths the repo holds
        self._waiting: tuple[Path, set[str]] | None = None  # the copy made, and the shards it needs
        self._sending: int | None = None  # id of the RepoFile on its way
        self._copies = 0
        self.sent = repo_path(RESUME_FILE) in landed  # the repo holds a copy

    def checkpointed(self, staging: Path, state: dict, files: dict[str, tuple[int, str]]) -> list[RepoFile]:
        """The writer checkpointed: what to hand the committer now (the waiting copy, when it may go, or none)."""
        if state.get("phase") != "writing":
            return []  # closing: the part's index follows
        if self._waiting is None:
            self._copies += 1
            dst = self.local / f"{RESUME_FILE}-{self._copies:08d}"
            if write_resume(staging, state, files, dst):
                with self._lock:
                    self._waiting = (dst, {self.repo_path(rel) for rel in files})
        with self._lock:
            if self._waiting is None or not self._waiting[1] <= self._landed or self._sending is not None \
                    or self.pending(self.repo_path(RESUME_FILE)):
                return []
            f = RepoFile(self.repo_path(RESUME_FILE), self._waiting[0])
            self._waiting, self._sending, self.sent = None, id(f), True
        return [f]

    def landed(self, files: list[RepoFile]) -> None:
        with self._lock:
            self._landed.update(f.rel for f in files)
            if any(id(f) == self._sending for f in files):
                self._sending = None


def hub_listing(ref: HubRef, token: str | bool | None) -> dict[str, tuple[int, str | None]]:
    """What a Hub output holds now: path (inside ``ref.path``) -> size, and LFS sha256 (None: a file kept in git)."""
    from huggingface_hub import RepoFile as HubRepoFile
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    prefix = f"{ref.path}/" if ref.path else ""
    try:
        entries = hub_api(token).list_repo_tree(ref.repo_id, path_in_repo=ref.path or None, repo_type=ref.repo_type,
                                                revision=ref.revision, recursive=True)
        return {e.path[len(prefix):]: (e.size, e.lfs.sha256 if e.lfs else None) for e in entries
                if isinstance(e, HubRepoFile) and e.path.startswith(prefix)}
    except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
        return {}


def seed_from_hub(ref: HubRef, token: str | bool | None, local: Path, remote: dict[str, str], settings: dict) -> bool:
    """A Hub output's staging folder (``local``) seeded from its copy on the Hub when there is one (``remote``: the
    repo paths it holds, as its committer listed them); True when it was."""
    if (f"{ref.path}/{RESUME_FILE}" if ref.path else RESUME_FILE) not in remote:
        return False
    listing = hub_listing(ref, token)
    size, sha = listing.get(RESUME_FILE, (-1, None))
    if not _size(size, MAX_RESUME_BYTES) or sha is None:
        raise ResumeMismatchError(f"{ref}/{RESUME_FILE} is {size} bytes, not a checkpoint copy of at most "
                                  f"{MAX_RESUME_BYTES}; re-run with --overwrite to start this part over")
    copy = local / RESUME_FILE
    copy.parent.mkdir(parents=True, exist_ok=True)
    HubFiles(ref, token=token).download(RESUME_FILE, copy)
    if copy.stat().st_size != size or sha256_file(copy) != sha:
        raise ResumeMismatchError(f"{ref}/{RESUME_FILE} changed while it was downloaded; run the command again")
    try:
        meta = (pq.read_schema(copy).metadata or {}).get(RESUME_KEY, b"")
    except (OSError, ValueError) as exc:  # (pyarrow's errors are both)
        raise ResumeMismatchError(f"{ref}/{RESUME_FILE} is not a parquet file ({exc}); re-run with --overwrite to "
                                  "start this part over") from None
    doc = check_resume(meta, listing, settings, str(ref))
    seed_staging(local / STAGING_DIR, doc, copy)
    copy.unlink()
    logger.info("%s: this node held nothing of it; resuming from its checkpoint on the Hub (%s rows)",
                ref, doc['state'].get('num_prompts'))
    return True
