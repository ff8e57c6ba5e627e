"""Datasets in object storage (``s3://bucket/prefix`` or any other fsspec URL).

Reading: ``ObjectStoreFiles`` downloads each file a call reads into a local cache.
Writing: ``UploadSink`` uploads finished files from a local staging folder on a background
thread, from a bounded queue (the producer waits only when the queue is full), with retries.
Standard AWS settings (AWS_ENDPOINT_URL, AWS_PROFILE, credentials) apply through s3fs/botocore.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ..base.paths import check_relpath
from ..base.retry import RetryPolicy, call_with_retry, describe
from ..base.safeio import read_json
from ..base.worker import BackgroundWorker
from ..errors import ObjectStoreError, OutOfSpaceError, ShardMissingError
from .cachedir import flocked
from .urls import is_object_store_url  # noqa: F401  (its old home: opening/ and outputs.py import it from here)

#: bytes per request when a range of an object is streamed to a file (memory stays this small)
STREAM_CHUNK = 8 * 2**20
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def object_store_policy(*, base_wait: float = 0.5, max_retries: int = 5) -> RetryPolicy:
    """Object-storage calls retry I/O and connection errors, never a missing file, a refusal or a bug."""
    return RetryPolicy(retry_on_exceptions=(OSError, TimeoutError, ConnectionError),
                       never_retry=(FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                                    FileExistsError),
                       never_retry_errnos=_DISK_FULL,  # a full local disk is not the store's fault
                       max_retries=max_retries, base_wait=base_wait)


def filesystem(url: str):
    """(fsspec filesystem, root path without the protocol) of ``url``."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with huggingface_hub
        raise ObjectStoreError("object storage needs fsspec") from None
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise ObjectStoreError(f"{url}: {exc} (for s3:// install 'lmprobe[s3]')") from None
    return fs, root.rstrip("/")


def object_identity(info: dict) -> dict[str, str]:
    """What identifies one version of an object: its ETag, size and modification time, as the store reports them."""
    keys = ("ETag", "etag", "VersionId", "size", "LastModified", "mtime", "updated", "created", "generation")
    return {k: str(info[k]) for k in keys if k in info and info[k] is not None}


def cache_dir(url: str, kind: str) -> Path:
    """A local folder for ``url`` under ``$LMPROBE_CACHE`` (default ``~/.cache/lmprobe``)."""
    base = Path(os.environ.get("LMPROBE_CACHE", Path.home() / ".cache" / "lmprobe"))
    return base / kind / hashlib.sha1(url.encode()).hexdigest()[:16]


def _call(what: str, fn: Callable[[], Any], policy: RetryPolicy) -> Any:
    try:
        return call_with_retry(fn, policy=policy, what=what)
    except FileNotFoundError:
        raise
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            raise OutOfSpaceError(f"the local disk is full while {what}: free some space, or point LMPROBE_CACHE "
                                  "at a larger disk") from exc
        if policy.is_transient(exc):
            raise ObjectStoreError(f"{what} failed after {policy.max_retries + 1} attempt(s): {describe(exc)}") from exc
        raise


class UploadSink:
    """Uploads files from ``local`` to ``url`` on a background thread, in arrival order."""

    def __init__(self, url: str, local: Path, *, max_queue: int = 4, delete_after: bool = True,
                 policy: RetryPolicy | None = None, fs: Any = None, keep: tuple[str, ...] = ()):
        self.url, self.local = url, Path(local)
        self.fs, self.root = filesystem(url)
        if fs is not None:
            self.fs = fs
        self.delete_after = delete_after
        self.keep = set(keep)  # files uploaded but kept locally
        self.policy = policy or object_store_policy()
        self.uploaded: list[str] = []
        self._worker = BackgroundWorker(self._upload, max_pending=max_queue, name="lmprobe-upload")

    def put(self, rel: str) -> None:
        """Upload one file now, in the caller's thread."""
        src = self.local / rel
        _call(f"uploading {rel} to {self.url}", lambda: self.fs.put_file(str(src), f"{self.root}/{rel}"), self.policy)

    def _upload(self, rel: str) -> None:
        self.put(rel)
        self.uploaded.append(rel)
        if self.delete_after and rel not in self.keep:
            (self.local / rel).unlink(missing_ok=True)

    def submit(self, rel: str) -> None:
        """Queue a file (relative to ``local``) for upload; blocks while the queue is full."""
        self._worker.submit(rel)

    def remove(self, rel: str) -> None:
        """Delete an object (absent already: fine)."""
        target = f"{self.root}/{rel}"
        try:
            _call(f"deleting {self.url}/{rel}", lambda: self.fs.rm_file(target), self.policy)
        except FileNotFoundError:
            pass

    def listing(self) -> set[str]:
        """Every object under the URL, as paths relative to it."""
        self.fs.invalidate_cache(self.root)  # fsspec caches listings: this one must be the bucket's now
        found = _call(f"listing {self.url}", lambda: self.fs.find(self.root), self.policy) or []
        prefix = self.root.rstrip("/") + "/"
        return {k[len(prefix):] for k in found if k.startswith(prefix)}

    def submit_existing(self) -> None:
        """Queue the finished shard files a previous, interrupted run left behind."""
        tensors = self.local / "tensors"
        for p in sorted(tensors.glob("*.safetensors")) if tensors.is_dir() else []:
            self.submit(p.relative_to(self.local).as_posix())

    def finish(self) -> None:
        """Wait for every queued upload (raising the first failure)."""
        self._worker.finish()

    def abort(self) -> None:
        self._worker.stop(skip_pending=True)


class ObjectStoreFiles:
    """Dataset files at an fsspec URL, downloaded on first use into a local cache."""

    remote = True
    origin = None

    def __init__(self, url: str, *, policy: RetryPolicy | None = None):
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url)
        self.cache = cache_dir(self.url, "remote")
        self.policy = policy or object_store_policy()
        self._seen: dict[str, dict[str, str]] = {}  # rel -> identity when this reader first downloaded it

    def __str__(self) -> str:
        return self.url

    def fetch(self, rel: str, *, what: str = "file") -> Path:
        """A local copy of ``rel``: from the cache when the object is the one cached, else downloaded.

        An object is identified by what the store says of it (ETag, size, modification time), not
        by its size alone: a dataset replaced at the same URL by one of the same shapes is noticed.
        Processes sharing the cache download a file once: the others wait for it (a lock per file),
        and each writes under a name of its own before the rename, so none trips over another.
        """
        check_relpath(rel, what)
        dst = self.cache / rel
        src = f"{self.root}/{rel}"
        try:
            info = _call(f"reading {self.url}/{rel}", lambda: self.fs.info(src), self.policy)
        except FileNotFoundError:
            raise ShardMissingError(self.missing_hint(rel)) from None
        ident = object_identity(info)
        stamp = dst.with_name(dst.name + ".identity.json")
        if self._cached(dst, stamp, info, ident):
            return dst
        dst.parent.mkdir(parents=True, exist_ok=True)
        with flocked(dst.with_name(f".{dst.name}.lock")):
            if self._cached(dst, stamp, info, ident):  # another process fetched it meanwhile
                return dst
            stamp.unlink(missing_ok=True)
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part")
            try:
                _call(f"downloading {self.url}/{rel}", lambda: self.fs.get_file(src, str(tmp)), self.policy)
                os.replace(tmp, dst)
                tmp.write_text(json.dumps(ident))
                os.replace(tmp, stamp)
            except BaseException as exc:
                tmp.unlink(missing_ok=True)
                if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
                    raise OutOfSpaceError(f"the disk holding the cache {self.cache} is full while downloading "
                                          f"{self.url}/{rel}: free some space, or point LMPROBE_CACHE at a larger "
                                          "disk") from exc
                raise
        return dst

    @staticmethod
    def _cached(dst: Path, stamp: Path, info: dict, ident: dict) -> bool:
        if not (dst.is_file() and stamp.is_file() and dst.stat().st_size == info.get("size")):
            return False
        try:
            return read_json(stamp, error=ObjectStoreError, max_bytes=2**16) == ident
        except ObjectStoreError:
            return False  # a damaged stamp: download again

    def listing(self) -> list[str]:
        """Every object under the URL now, relative to it."""
        self.fs.invalidate_cache(self.root)  # fsspec caches listings: this one must be the bucket's now
        found = _call(f"listing {self.url}", lambda: self.fs.find(self.root), self.policy) or []
        prefix = self.root.rstrip("/") + "/"
        return sorted(k[len(prefix):] for k in found if k.startswith(prefix))

    def has(self, rel: str) -> bool:
        """Whether the object ``rel`` exists under the URL now."""
        check_relpath(rel, "file")
        src = f"{self.root}/{rel}"
        self.fs.invalidate_cache(src)
        try:
            return bool(_call(f"reading {self.url}/{rel}", lambda: self.fs.isfile(src), self.policy))
        except FileNotFoundError:
            return False

    def pin(self) -> None:
        """Record every object's identity now: a later ``download`` of a changed object is an error."""
        try:
            found = _call(f"listing {self.url}", lambda: self.fs.find(self.root, detail=True), self.policy)
        except FileNotFoundError:
            return
        for path, info in found.items():
            rel = path[len(self.root) :].lstrip("/")
            self._seen.setdefault(rel, object_identity(info))

    def _check_pinned(self, rel: str, src: str) -> None:
        """The object is the version pinned at open (or first seen): else an error naming it, never mixed data."""
        self.fs.invalidate_cache(src)  # ask the store, not fsspec's listing cache
        try:
            info = _call(f"reading {self.url}/{rel}", lambda: self.fs.info(src), self.policy)
        except FileNotFoundError:
            raise ShardMissingError(self.missing_hint(rel)) from None
        ident = object_identity(info)
        seen = self._seen.setdefault(rel, ident)  # pinned at open (``pin``), or at its first read
        if seen != ident:
            raise ObjectStoreError(f"{self.url}/{rel} changed on the remote while it was being read ({seen} -> "
                                   f"{ident}); the dataset was replaced mid-pass: open it again to read the new one")

    def download(self, rel: str, dst: Path, *, policy: RetryPolicy | None = None) -> None:
        """Download ``rel`` to ``dst`` (a name of the caller's own: bounded caches); the object must be the pinned
        version (``_check_pinned``)."""
        check_relpath(rel, "file")
        src = f"{self.root}/{rel}"
        self._check_pinned(rel, src)
        _call(f"downloading {self.url}/{rel}", lambda: self.fs.get_file(src, str(dst)), policy or self.policy)

    def read_range(self, rel: str, start: int, end: int, *, out: BinaryIO | None = None,
                   policy: RetryPolicy | None = None) -> bytes | None:
        """Bytes ``start:end`` of ``rel``, after checking the object is still the pinned version: returned, or
        written to the binary file ``out`` in requests of ``STREAM_CHUNK`` bytes (memory stays small).

        One metadata request per range (fsspec reads ranges without a version condition): the price
        of never mixing two versions of a dataset.
        """
        check_relpath(rel, "file")
        src = f"{self.root}/{rel}"
        policy = policy or self.policy
        self._check_pinned(rel, src)
        steps = [(start, end)] if out is None else [(a, min(end, a + STREAM_CHUNK)) for a in range(start, end, STREAM_CHUNK)]
        parts = []
        for a, b in steps:
            data = _call(f"reading {self.url}/{rel}", lambda a=a, b=b: self.fs.cat_file(src, start=a, end=b), policy)
            if len(data) != b - a:
                raise ObjectStoreError(f"{self.url}/{rel}: asked for bytes {a}-{b}, got {len(data)}; the object is "
                                       "shorter than the dataset's metadata says (replaced mid-pass?)")
            if out is None:
                parts.append(data)
            else:
                out.write(data)
        return b"".join(parts) if out is None else None

    def missing_hint(self, rel: str) -> str:
        return f"{rel} is missing from {self.url}; the upload may be incomplete (re-run the extraction to resume)"
