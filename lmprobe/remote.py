"""Datasets in object storage (``s3://bucket/prefix`` or any fsspec URL).

Writing: the extraction writes into a local staging folder while a background thread uploads
each finished shard from a bounded queue (the forward pass waits only when the queue is full),
with retries; the statistics, the card and, last, the index follow once everything else is up.
Uploaded shards are deleted locally, so the local disk holds a few shards at a time. Standard
AWS settings (AWS_ENDPOINT_URL, AWS_PROFILE, credentials) apply through s3fs/botocore.

Reading: ``lmprobe.load("s3://bucket/prefix")`` fetches the index, then each shard file a call
reads, into a local cache.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from .errors import DatasetNotFoundError, LmprobeError, ShardMissingError
from .format.paths import check_relpath
from .format.spec import CARD_PATH, INDEX_PATH


class RemoteStorageError(LmprobeError, OSError):
    """Object storage could not be reached or written after retries."""


def is_remote_url(path: Any) -> bool:
    s = os.fspath(path) if isinstance(path, os.PathLike) else path
    return isinstance(s, str) and "://" in s and not s.startswith(("hf://", "file://"))


def _fs(url: str):
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with huggingface_hub
        raise RemoteStorageError("object storage needs fsspec") from None
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise RemoteStorageError(f"{url}: {exc} (for s3:// install 'lmprobe[s3]')") from None
    return fs, root.rstrip("/")


def cache_dir(url: str, kind: str) -> Path:
    base = Path(os.environ.get("LMPROBE_CACHE", Path.home() / ".cache" / "lmprobe"))
    return base / kind / hashlib.sha1(url.encode()).hexdigest()[:16]


def _retry(what: str, fn, retries: int = 5, base_wait: float = 0.5):
    for attempt in range(retries + 1):
        try:
            return fn()
        except (OSError, TimeoutError, ConnectionError) as exc:
            if isinstance(exc, FileNotFoundError) or attempt == retries:
                raise RemoteStorageError(f"{what} failed after {attempt + 1} attempt(s): {exc}") from exc
            time.sleep(base_wait * 2**attempt)
        except Exception as exc:  # botocore / aiohttp errors carry no common base
            if attempt == retries:
                raise RemoteStorageError(f"{what} failed after {attempt + 1} attempt(s): {exc}") from exc
            time.sleep(base_wait * 2**attempt)


class UploadSink:
    """Uploads finished files from ``local`` to ``url`` on a background thread, in arrival order."""

    def __init__(self, url: str, local: Path, *, max_queue: int = 4, delete_after: bool = True,
                 base_wait: float = 0.5):
        self.url, self.local = url, Path(local)
        self.fs, self.root = _fs(url)
        self.delete_after = delete_after
        self.base_wait = base_wait
        self.q: queue.Queue = queue.Queue(maxsize=max_queue)
        self.error: BaseException | None = None
        self.uploaded: list[str] = []
        self.thread = threading.Thread(target=self._drain, name="lmprobe-upload", daemon=True)
        self.thread.start()

    def _put(self, rel: str) -> None:
        src = self.local / rel
        dst = f"{self.root}/{rel}"
        _retry(f"uploading {rel} to {self.url}", lambda: self.fs.put_file(str(src), dst), base_wait=self.base_wait)

    def _drain(self) -> None:
        while True:
            rel = self.q.get()
            if rel is None:
                return
            if self.error is not None:
                continue
            try:
                self._put(rel)
                self.uploaded.append(rel)
                if self.delete_after and rel not in (INDEX_PATH, CARD_PATH):
                    (self.local / rel).unlink(missing_ok=True)
            except BaseException as exc:
                self.error = exc

    def submit(self, rel: str) -> None:
        """Queue a file (relative to ``local``) for upload; blocks while the queue is full."""
        if self.error is not None:
            raise self.error
        self.q.put(rel)

    def submit_existing(self) -> None:
        """Queue the finished shard files a previous, interrupted run left behind."""
        for p in sorted((self.local / "tensors").glob("*.safetensors")) if (self.local / "tensors").is_dir() else []:
            self.submit(p.relative_to(self.local).as_posix())

    def finish(self) -> None:
        """Wait for every queued upload, then upload the card and, last, the index."""
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        for rel in (CARD_PATH, INDEX_PATH):
            if (self.local / rel).exists():
                self._put(rel)

    def abort(self) -> None:
        self.q.put(None)
        self.thread.join()


class RemoteFiles:
    """Dataset files at an fsspec URL, downloaded on first use into a local cache."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = _fs(self.url)
        self.cache = cache_dir(self.url, "remote")

    def __str__(self) -> str:
        return self.url

    def fetch(self, rel: str, *, what: str = "file") -> Path:
        check_relpath(rel, what)
        dst = self.cache / rel
        src = f"{self.root}/{rel}"
        try:
            size = _retry(f"reading {self.url}/{rel}", lambda: self.fs.size(src))
        except RemoteStorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise ShardMissingError(self.missing_hint(rel)) from None
            raise
        if dst.exists() and dst.stat().st_size == size:
            return dst
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".tmp")
        _retry(f"downloading {self.url}/{rel}", lambda: self.fs.get_file(src, str(tmp)))
        os.replace(tmp, dst)
        return dst


    def missing_hint(self, rel: str) -> str:
        return f"{rel} is missing from {self.url}; the upload may be incomplete (re-run the extraction to resume)"


def load_remote(url: str):
    import pyarrow.parquet as pq

    from .format.reader import Dataset

    files = RemoteFiles(url)
    try:
        index = files.fetch(INDEX_PATH, what="index")
    except ShardMissingError:
        raise DatasetNotFoundError(f"{url} holds no complete lmprobe dataset ({INDEX_PATH} is missing)") from None
    return Dataset(files, pq.read_table(index))
