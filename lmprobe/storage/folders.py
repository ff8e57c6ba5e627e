"""A remote folder's files (a folder in a Hub repo, a prefix in object storage) for readers that are not datasets:
an SAE dictionary (sae/loader.py), a saev folder (saev/reader.py). Both sources implement the files protocol
(``format.files.DatasetFiles``); a local folder stays the reader's own (this module imports no
numpy, as the dictionary loader runs without it).
"""

from __future__ import annotations

import os
from dataclasses import replace

from .hub import HubFiles, parse_hf_url
from .objectstore import ObjectStoreFiles
from .urls import remote_of


def remote_folder(location: str | os.PathLike, sub: str = "", *, revision: str | None = None,
                  token: str | bool | None = None) -> HubFiles | ObjectStoreFiles | None:
    """The files of the folder ``location`` (joined with ``sub``, a relative path) names when it is remote: an
    ``hf://`` repo folder (at ``revision``, read with ``token``) or an object-storage prefix; None when it is local."""
    kind = remote_of(location)
    if kind == "local":
        return None
    url = os.fspath(location)
    if kind == "hub":
        ref = parse_hf_url(url, revision=revision)
        path = "/".join(p for p in (ref.path, sub) if p)
        return HubFiles(replace(ref, path=path), token=token)
    return ObjectStoreFiles(f"{url.rstrip('/')}/{sub}" if sub else url)
