"""What a Hub output keeps of its own, beside the dataset's files: the upload ledger on this machine (files whose
content is on the Hub but whose commit may not have landed), the record a closed writer left in its staging (what a
run killed in its commit tail finishes by reference), and a job part's map of provisional shard names (what the
merge copies from). All of it is read back as untrusted input.
"""

from __future__ import annotations

from pathlib import Path

from ..base.paths import check_relpath
from ..base.safeio import loads
from ..errors import ExtractionError, LmprobeError
from ..format.metadata import FileRecord
from ..format.reader import Dataset, open_local
from ..format.resume import same_extraction
from ..format.spec import CARD_PATH, INDEX_PATH
from ..format.staging import PROVISIONAL_DIR

#: what a Hub output's session records of the files whose content is on the Hub but whose commit may not have
#: landed yet: a run killed meanwhile commits them by reference (their sha256) instead of extracting them again
LEDGER = ".lmprobe-uploaded.jsonl"


def read_ledger(path: Path) -> list[dict]:
    """The ledger's entries (a line cut short by a kill, or anything malformed, is skipped: that file is sent again)."""
    out = []
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            e = loads(line, what="an upload ledger line")
            if isinstance(e, dict):
                check_relpath(e.get("rel"), "a ledger entry's file")
        except LmprobeError:
            continue
        if isinstance(e, dict) and isinstance(e.get("sha256"), str) and len(e["sha256"]) == 64 \
                and isinstance(e.get("size"), int) and e["size"] >= 0:
            out.append(e)
    return out


def staged_record(local: Path, settings: dict | None) -> dict[str, FileRecord] | None:
    """The files a closed writer recorded in the staged index (path -> size and sha256), when the index is sound,
    records ``settings`` and hashes every file; else None (the staging copy cannot be finished by reference)."""
    try:
        ds = open_local(local)
        extraction = ds.info.get("extraction")
        recorded = extraction.get("settings") if isinstance(extraction, dict) else None
        files = ds.meta.files()
    except (LmprobeError, OSError):
        return None
    if settings is None or not isinstance(recorded, dict) or not same_extraction(recorded, settings):
        return None
    if not all(f.sha256 and isinstance(f.bytes, int) for f in files):
        return None
    return {f.rel: f for f in files}


#: a job's part on the Hub: its sequence shards' provisional names, by the names its index gives them (the merge
#: copies each from where it is)
RENAMES = ".lmprobe-renames.json"
MAX_RENAMES_BYTES = 64 * 2**20


def part_renames(ds: Dataset) -> dict[str, str]:
    """A part's map of shard names to the provisional names its shards are under ({} when it has none); untrusted:
    each path checked, the file's size bounded."""
    try:
        path = ds.files.fetch(RENAMES, what="the part's renames")
    except (LmprobeError, OSError):
        return {}
    if not path.is_file():
        return {}
    if path.stat().st_size > MAX_RENAMES_BYTES:
        raise ExtractionError(f"{ds.source}: {RENAMES} is larger than {MAX_RENAMES_BYTES} bytes; re-run with "
                              "--overwrite")
    found = loads(path.read_text(), what=f"{ds.source}/{RENAMES}")
    if not isinstance(found, dict):
        raise ExtractionError(f"{ds.source}/{RENAMES} is not a map of names; re-run with --overwrite")
    for new, old in found.items():
        check_relpath(new, "a renamed shard")
        check_relpath(old, "a provisional shard")
        if not old.startswith(PROVISIONAL_DIR + "/"):
            raise ExtractionError(f"{ds.source}/{RENAMES} names {old!r}, not a provisional shard; re-run with "
                                  "--overwrite")
    return found


def final_files(local: Path) -> list[str]:
    """The files a finished writer leaves for last: the statistics, then the card, then the index."""
    stats = sorted(p.relative_to(local).as_posix() for p in (local / "tensors").glob("statistics*.safetensors")) \
        if (local / "tensors").is_dir() else []
    return [*stats, *[rel for rel in (CARD_PATH, INDEX_PATH) if (local / rel).exists()]]
