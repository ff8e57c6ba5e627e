"""Datasets in object storage (``s3://bucket/prefix`` or any other fsspec URL).

Reading: ``ObjectStoreFiles`` downloads each file a call reads into a local cache.
Writing: ``UploadSink`` uploads finished files from a local staging folder on a background
thread, from a bounded queue (the producer waits only when the queue is full), with retries.
Standard AWS settings (AWS_ENDPOINT_URL, AWS_PROFILE, credentials) apply through s3fs/botocore.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..atomic import atomic_output, atomic_write
from ..errors import ObjectStoreError, ShardMissingError
from ..paths import check_relpath
from ..retry import RetryPolicy, call_with_retry, describe
from ..safeio import read_json
from ..worker import BackgroundWorker


def is_object_store_url(path: Any) -> bool:
    """Whether ``path`` is an fsspec URL of object storage (``s3://``, ``gs://``, ...; not ``hf://`` or ``file://``)."""
    s = os.fspath(path) if isinstance(path, os.PathLike) else path
    return isinstance(s, str) and "://" in s and not s.startswith(("hf://", "file://"))


def object_store_policy(*, base_wait: float = 0.5, max_retries: int = 5) -> RetryPolicy:
    """Object-storage calls retry I/O and connection errors, never a missing file, a refusal or a bug."""
    return RetryPolicy(retry_on_exceptions=(OSError, TimeoutError, ConnectionError),
                       never_retry=(FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                                    FileExistsError),
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
        return call_with_retry(fn, policy=policy)
    except FileNotFoundError:
        raise
    except Exception as exc:
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
        if dst.is_file() and stamp.is_file() and dst.stat().st_size == info.get("size"):
            try:
                if read_json(stamp, error=ObjectStoreError, max_bytes=2**16) == ident:
                    return dst
            except ObjectStoreError:
                pass  # a damaged stamp: download again
        dst.parent.mkdir(parents=True, exist_ok=True)
        stamp.unlink(missing_ok=True)
        with atomic_output(dst) as tmp:
            _call(f"downloading {self.url}/{rel}", lambda: self.fs.get_file(src, str(tmp)), self.policy)
        atomic_write(stamp, json.dumps(ident))
        return dst

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

    def download(self, rel: str, dst: Path) -> None:
        """Download ``rel`` to ``dst`` (bounded caches); the object must be the pinned version (``_check_pinned``)."""
        check_relpath(rel, "file")
        src = f"{self.root}/{rel}"
        self._check_pinned(rel, src)
        with atomic_output(dst) as tmp:
            _call(f"downloading {self.url}/{rel}", lambda: self.fs.get_file(src, str(tmp)), self.policy)

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of ``rel``, after checking the object is still the pinned version.

        One metadata request per range (fsspec reads ranges without a version condition): the price
        of never mixing two versions of a dataset.
        """
        check_relpath(rel, "file")
        src = f"{self.root}/{rel}"
        self._check_pinned(rel, src)
        data = _call(f"reading {self.url}/{rel}", lambda: self.fs.cat_file(src, start=start, end=end), self.policy)
        if len(data) != end - start:
            raise ObjectStoreError(f"{self.url}/{rel}: asked for bytes {start}-{end}, got {len(data)}; the object is "
                                   "shorter than the dataset's metadata says (replaced mid-pass?)")
        return data

    def missing_hint(self, rel: str) -> str:
        return f"{rel} is missing from {self.url}; the upload may be incomplete (re-run the extraction to resume)"
