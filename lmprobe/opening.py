"""``lmprobe.load``: open a dataset wherever it lives, picking the storage from the path."""

from __future__ import annotations

import os

from .errors import DatasetNotFoundError, InvalidArgumentError, ShardMissingError
from .format.reader import Dataset, open_local
from .format.spec import INDEX_PATH
from .storage.hub import HubFiles, HubRef, parse_dataset_ref
from .storage.objectstore import ObjectStoreFiles, is_object_store_url


def open_hub(ref: HubRef, *, token: str | bool | None = None) -> Dataset:
    """Open a dataset in a Hub repo: the index now, shards when a call reads them."""
    files = HubFiles(ref, token=token)
    if INDEX_PATH in files.repo_files:
        index = INDEX_PATH
    else:
        found = sorted(s for s in files.repo_files if s.startswith("index/") and s.endswith(".parquet"))
        if len(found) != 1:
            raise DatasetNotFoundError(f"{files} holds no lmprobe dataset: {INDEX_PATH} is missing")
        index = found[0]
    return Dataset(files, files.fetch(index, what="index"))


def open_object_store(url: str) -> Dataset:
    """Open a dataset at an fsspec URL (``s3://bucket/prefix``)."""
    files = ObjectStoreFiles(url)
    try:
        index = files.fetch(INDEX_PATH, what="index")
    except ShardMissingError:
        raise DatasetNotFoundError(f"{url} holds no complete lmprobe dataset ({INDEX_PATH} is missing)") from None
    return Dataset(files, index)


def load(path: str | os.PathLike, *, revision: str | None = None, token: str | bool | None = None) -> Dataset:
    """Open an lmprobe dataset: a local folder, ``owner/name`` or ``hf://datasets/owner/name`` on the Hub,
    or an object-storage URL such as ``s3://bucket/prefix``.

    From the Hub, the index is fetched first and shard files only when a call reads them (through
    the Hugging Face cache, all from the commit the revision pointed at when the dataset was opened).

    >>> ds = lmprobe.load("out/my-dataset")     # doctest: +SKIP
    >>> ds = lmprobe.load("hf://datasets/me/acts", revision="main")  # doctest: +SKIP
    >>> ds.hidden(ds.layers[-1]).shape          # doctest: +SKIP
    (1000, 4096)
    """
    if is_object_store_url(path):
        return open_object_store(str(path))
    ref = parse_dataset_ref(path, revision)
    if ref is not None:
        return open_hub(ref, token=token)
    if revision is not None:
        raise InvalidArgumentError(f"revision= applies to Hub repos; {path} is a local folder")
    return open_local(path)
