"""Which storage a string names, decided in one place: a Hub repo (``hf://``), object storage through fsspec
(``s3://``, ``gs://``, ...), or a local path.

Every module that tells them apart calls ``remote_of`` (or ``is_hub_url``/``is_object_store_url``), and one that
reads what follows ``hf://`` calls ``hub_path``: no other module splits or compares a scheme
(tests/storage/test_storage_layer.py finds one that does). A new remote keeps its scheme here and its files object
beside (docs/architecture.md, "A new remote").

>>> remote_of("hf://datasets/me/acts"), remote_of("s3://bucket/run"), remote_of("out/acts")
('hub', 'object', 'local')
>>> split_url("gs://bucket/run/"), split_url("out/acts")
(('gs', 'bucket/run/'), ('', 'out/acts'))
>>> hub_path("hf://datasets/me/acts@v1")
'datasets/me/acts@v1'
"""

from __future__ import annotations

import os
from typing import Any, Literal

#: the Hugging Face Hub's scheme, as huggingface_hub's HfFileSystem spells it
HUB_SCHEME = "hf"
#: schemes that name this machine's files, not a remote (fsspec's ``file://``)
LOCAL_SCHEMES = ("file",)
_SEP = "://"

Remote = Literal["hub", "object", "local"]


def _text(path: Any) -> str | None:
    s = os.fspath(path) if isinstance(path, os.PathLike) else path
    return s if isinstance(s, str) else None


def split_url(path: Any) -> tuple[str, str]:
    """(scheme, what follows ``scheme://``) of a URL; ("", the path) of a local path (or of anything not a string:
    ("", "")). The scheme is what precedes the first ``://``, as written."""
    s = _text(path)
    if s is None:
        return "", ""
    scheme, sep, rest = s.partition(_SEP)
    return (scheme, rest) if sep else ("", s)


def remote_of(path: Any) -> Remote:
    """Which storage ``path`` names: "hub" (``hf://``), "object" (any other URL fsspec reads: ``s3://``, ``gs://``,
    ...; not ``file://``) or "local"."""
    scheme, _ = split_url(path)
    if scheme == HUB_SCHEME:
        return "hub"
    if scheme and scheme not in LOCAL_SCHEMES:
        return "object"
    if not scheme and is_url(path):  # "://x": no scheme, still a URL to fsspec
        return "object"
    return "local"


def is_url(path: Any) -> bool:
    """Whether ``path`` is written as a URL (``SCHEME://...``, ``file://`` included), not as a local path."""
    return _SEP in (_text(path) or "")


def is_hub_url(path: Any) -> bool:
    """Whether ``path`` is an ``hf://`` URL."""
    return remote_of(path) == "hub"


def is_object_store_url(path: Any) -> bool:
    """Whether ``path`` is an fsspec URL of object storage (``s3://``, ``gs://``, ...; not ``hf://`` or ``file://``)."""
    return remote_of(path) == "object"


def hub_path(url: str) -> str:
    """What follows ``hf://`` in an ``hf://`` URL (the URL itself when it is not one)."""
    scheme, rest = split_url(url)
    return rest if scheme == HUB_SCHEME else url


def hub_url(path: str) -> str:
    """The ``hf://`` URL of a path in the Hub (``datasets/OWNER/NAME[@REV][/PATH]``)."""
    return f"{HUB_SCHEME}{_SEP}{path}"
