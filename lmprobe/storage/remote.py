"""A dataset held remotely, opened: a Hub repo (``open_hub``) or an object-storage prefix (``open_object_store``),
its files read through the storage's files object (and a bounded local cache when asked). ``lmprobe.load`` picks
one of these (opening/), and a remote extraction output (outputs.py) reads back what it wrote through them.
"""

from __future__ import annotations

from ..errors import DatasetNotFoundError, ShardMissingError
from ..format.reader import Dataset
from ..format.spec import INDEX_PATH
from .hub import HubFiles, HubRef
from .lrufiles import LruFiles
from .objectstore import ObjectStoreFiles


def open_hub(ref: HubRef, *, token: str | bool | None = None, cache: int | None = None) -> Dataset:
    """Open a dataset in a Hub repo: the index now, shards when a call reads them.

    ``cache``: shards go through a folder of at most that many bytes (``LruFiles``); the index
    stays in the Hugging Face cache, as the reader keeps it open.
    """
    files = HubFiles(ref, token=token)
    if INDEX_PATH in files.repo_files:
        index = INDEX_PATH
    else:
        found = sorted(s for s in files.repo_files if s.startswith("index/") and s.endswith(".parquet"))
        if len(found) != 1:
            raise DatasetNotFoundError(f"{files} holds no lmprobe dataset: {INDEX_PATH} is missing")
        index = found[0]
    index_path = files.fetch(index, what="index")
    return Dataset(LruFiles(files, cache) if cache is not None else files, index_path)


def open_object_store(url: str, *, cache: int | None = None) -> Dataset:
    """Open a dataset at an fsspec URL (``s3://bucket/prefix``); ``cache`` as for ``open_hub``."""
    files = ObjectStoreFiles(url)
    try:
        index = files.fetch(INDEX_PATH, what="index")
    except ShardMissingError:
        raise DatasetNotFoundError(f"{url} holds no complete lmprobe dataset ({INDEX_PATH} is missing)") from None
    if cache is None:
        return Dataset(files, index)
    files.pin()
    return Dataset(LruFiles(files, cache), index)
