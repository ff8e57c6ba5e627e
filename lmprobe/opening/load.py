"""``lmprobe.load``: open a dataset wherever it lives, picking the storage from the path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..base.units import parse_size
from ..errors import DatasetNotFoundError, InvalidArgumentError
from ..format.reader import Dataset, open_local
from ..storage.hub import parse_dataset_ref
from ..storage.objectstore import is_object_store_url
from ..storage.remote import open_hub, open_object_store


def is_datasets_folder(path: str | os.PathLike) -> bool:
    """A Hugging Face ``datasets`` save_to_disk folder (as SAELens' CacheActivationsRunner writes), not lmprobe's."""
    p = Path(path)
    return (p / "state.json").is_file() and (p / "dataset_info.json").is_file() and not (p / "index").exists()


def is_remote(path: Any) -> bool:
    """Whether ``path`` names a dataset on the Hub or in object storage (not a local folder)."""
    return is_object_store_url(path) or parse_dataset_ref(path) is not None


def load(path: str | os.PathLike, *, revision: str | None = None, token: str | bool | None = None,
         cache: int | str | None = None) -> Dataset:
    """Open an lmprobe dataset: a local folder, ``owner/name`` or ``hf://datasets/owner/name`` on the Hub,
    or an object-storage URL such as ``s3://bucket/prefix``.

    From the Hub, the index is fetched first and shard files only when a call reads them (through
    the Hugging Face cache, all from the commit the revision pointed at when the dataset was opened).
    ``cache="20GiB"`` reads a remote dataset's files through a folder of at most that size instead
    (least recently read files deleted first); it has no effect on a local folder.

    >>> ds = lmprobe.load("out/my-dataset")     # doctest: +SKIP
    >>> ds = lmprobe.load("hf://datasets/me/acts", revision="main")  # doctest: +SKIP
    >>> ds.hidden(ds.layers[-1]).shape          # doctest: +SKIP
    (1000, 4096)
    """
    budget = parse_size(cache) if cache is not None else None
    if is_object_store_url(path):
        return open_object_store(str(path), cache=budget)
    ref = parse_dataset_ref(path, revision)
    if ref is not None:
        return open_hub(ref, token=token, cache=budget)
    if revision is not None:
        raise InvalidArgumentError(f"revision= applies to Hub repos; {path} is a local folder")
    if is_datasets_folder(path):
        raise DatasetNotFoundError(f"{path} is a Hugging Face datasets folder (a SAELens activation cache?), not an "
                                   f"lmprobe dataset: convert it with `lmprobe import-saelens {path} --out DIR`")
    return open_local(path)
