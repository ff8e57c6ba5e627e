"""``lmprobe validate hf://datasets/OWNER/NAME``: a Hub dataset checked in place, without pulling it.

The metadata and the index are downloaded (they are small); of every safetensors file only the
header is read (two range requests) and its size is taken from the Hub's file listing. They are laid
out in a temporary folder as sparse files of their real size, and the one validator of the format
(format/validate.py) checks that folder: the same rules, the same messages, for a folder or a repo.
``full=True`` downloads every file instead and checks the hashes the metadata records.

Cost at full size: a 10^10-token dataset of 128 layers in 1 GB shards holds ~10^5 shard files; in
place, that is 2 requests and ~10 KB per file (~2 * 10^5 requests, minutes) and no disk (the files
are sparse); ``full`` downloads every byte (tens of TB: pull the layers you need instead).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..format.safetensors_io import MAX_HEADER_BYTES
from ..format.validate import Report
from ..format.validate import validate as validate_format
from ..storage.hub import HubFiles, HubRef, hub_api
from .attachments import validate_attachments


def _sizes(files: HubFiles) -> dict[str, int]:
    """Every file's size under the dataset's folder of the repo, at the pinned commit, from one tree listing."""
    ref = files.ref
    prefix = f"{ref.path}/" if ref.path else ""
    listing = hub_api(files.token).list_repo_tree(ref.repo_id, path_in_repo=ref.path or None, repo_type=ref.repo_type,
                                                  revision=files.commit, recursive=True)
    return {e.path[len(prefix):]: int(e.size) for e in listing
            if getattr(e, "size", None) is not None and e.path.startswith(prefix)}


def _header_only(files: HubFiles, rel: str, size: int, dst: Path) -> None:
    """``dst``: a sparse file of ``size`` bytes holding the safetensors header of ``rel`` (the rest reads as zeros)."""
    with open(dst, "wb") as f:
        first = files.read_range(rel, 0, min(8, size)) or b""
        n = int.from_bytes(first, "little") if len(first) == 8 else -1
        if 0 <= n <= MAX_HEADER_BYTES and 8 + n <= size:
            first = files.read_range(rel, 0, 8 + n) or b""
        f.write(first)  # a header too large or too long for the file: the validator says so from these 8 bytes
        f.truncate(size)


def validate_hub(ref: HubRef, *, full: bool = False, token: str | bool | None = None) -> Report:
    """Check the Hub dataset ``ref`` where it is: metadata, index, every shard's header and size (``full``: every
    file downloaded and its sha256 checked too). Returns the validator's report, named by the dataset's URL.

    >>> validate_hub(parse_dataset_ref("hf://datasets/me/acts")).ok   # doctest: +SKIP
    True
    """
    files = HubFiles(ref, token=token)
    sizes = _sizes(files)
    name = f"hf://{ref.repo_type}s/{ref.repo_id}" + (f"@{ref.revision}" if ref.revision else "") + \
        (f"/{ref.path}" if ref.path else "")
    tmp = Path(tempfile.mkdtemp(prefix="lmprobe-validate-"))
    try:
        for rel in files.repo_files:
            if rel.startswith(".") or "/." in rel:  # .gitattributes, a job's .lmprobe-parts/: not the dataset
                continue
            dst = tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if rel.endswith(".safetensors") and not full and rel in sizes:
                _header_only(files, rel, sizes[rel], dst)
            else:
                files.download(rel, dst)
        rep = validate_format(tmp, checksums=full)
        if rep.info is not None:
            validate_attachments(tmp, rep.info, rep)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    here = str(tmp) + os.sep
    rep.errors = [e.replace(here, "") for e in rep.errors]
    rep.warnings = [w.replace(here, "") for w in rep.warnings]
    rep.path = name
    return rep
