"""The output folder's states: empty, partial (a staging folder with a checkpoint), complete (an index).

Work in progress lives in ``<out>/.lmprobe-staging/``: partial shards, index parts and
``state.json``, the last checkpoint. Everything read back from there is untrusted: a state file
names staging files by plain names only, and its numbers are checked before use.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..base.atomic import atomic_write
from ..base.safeio import read_json
from ..errors import FormatError, OutputExistsError, ResumeMismatchError
from .metadata import decode_schema_metadata, parse_info
from .spec import CARD_PATH, INDEX_PATH, STAGING_DIR

STATE_VERSION = 1
MAX_STATE_BYTES = 256 * 2**20
_STAGING_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class Staging:
    """The staging folder of an output: checkpoints, index parts, partial shards."""

    def __init__(self, out_dir: Path, *, fsync: bool = False):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / STAGING_DIR
        self.fsync = fsync

    @property
    def state_path(self) -> Path:
        return self.path / "state.json"

    def part_path(self, i: int) -> Path:
        return self.path / "index" / f"part-{i:06d}.parquet"

    def parts(self, n: int) -> list[Path]:
        return [self.part_path(i) for i in range(n)]

    def has_checkpoint(self) -> bool:
        return self.state_path.is_file()

    def reset(self) -> None:
        """Start from nothing: a run that died before its first checkpoint left nothing worth keeping."""
        if self.path.exists():
            shutil.rmtree(self.path)
        (self.path / "index").mkdir(parents=True)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def write_state(self, state: dict[str, Any]) -> None:
        atomic_write(self.state_path, json.dumps(state), fsync=self.fsync)

    def read_state(self) -> dict[str, Any]:
        """The last checkpoint, checked: a damaged or foreign state file is an error, never followed blindly."""
        try:
            st = read_json(self.state_path, what=str(self.state_path), error=ResumeMismatchError,
                           max_bytes=MAX_STATE_BYTES)
        except ResumeMismatchError as exc:
            raise ResumeMismatchError(f"{exc}; pass overwrite=True (--overwrite) to start over") from None
        if not isinstance(st, dict) or st.get("version") != STATE_VERSION:
            raise ResumeMismatchError(
                f"{self.state_path} was written by another lmprobe version; pass overwrite=True (--overwrite)")
        return st

    def prune(self, n_parts: int, keep: Iterable[str]) -> None:
        """Drop what a crash after the last checkpoint left: later index parts, temporaries, unknown shards."""
        keep = set(keep)
        for p in (self.path / "index").glob("part-*.parquet"):
            if not re.fullmatch(r"part-\d{6}\.parquet", p.name) or int(p.stem.split("-")[1]) >= n_parts:
                p.unlink()
        for p in self.path.glob("*.tmp"):
            p.unlink()
        for p in self.path.glob("*.safetensors*"):
            if p.name not in keep:
                p.unlink()


def check_staging_name(name: Any, what: str) -> str:
    """A file name recorded in a checkpoint: a plain name inside the staging folder, nothing else."""
    if not isinstance(name, str) or not _STAGING_NAME_RE.match(name) or ".." in name:
        raise ResumeMismatchError(f"the checkpoint names {what} {name!r}, not a plain staging file name; "
                                  "pass overwrite=True (--overwrite) to start over")
    return name


def previous_dataset_files(out: Path) -> list[Path]:
    """The files a complete lmprobe dataset in ``out`` consists of (shards, statistics, card, index)."""
    index = out / INDEX_PATH
    victims: list[Path] = []
    try:
        info = parse_info(decode_schema_metadata(pq.read_schema(index).metadata))
    except (FormatError, OSError, pa.ArrowInvalid):
        info = None
    if info is not None:
        victims += [out / f.rel for f in info.files()]  # every hookpoint's shards, logits, statistics
    return victims + [index, out / CARD_PATH]


def remove_files_inside(out: Path, files: Iterable[Path]) -> None:
    """Delete those of ``files`` that are regular files inside ``out`` (never anything outside it)."""
    root = out.resolve()
    for v in files:
        if v.is_file() and not v.is_symlink() and root in v.resolve().parents:
            v.unlink()


def check_fresh_output(out: Path) -> None:
    """``out`` may receive a new dataset: missing, or an empty folder (a stale staging folder aside)."""
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder; choose a new or empty folder")
    if out.exists() and any(p.name != STAGING_DIR and not p.name.startswith(".lmprobe-") for p in out.iterdir()):
        raise OutputExistsError(f"{out} is not empty and holds no lmprobe dataset; choose an empty or new folder")


def describe_mismatch(old: dict, new: dict, prefix: str = "") -> str:
    """The settings that differ, one ``name: old -> new`` each (nested settings by their own name, values cut short)."""
    parts = []
    for k in sorted(set(old) | set(new), key=str):
        a, b = old.get(k, "(none)"), new.get(k, "(none)")
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            parts.append(describe_mismatch(a, b, prefix if k == "caller" else f"{prefix}{k}."))
        else:
            parts.append(f"{prefix}{k}: {_short(a)} -> {_short(b)}")
    return "; ".join(dict.fromkeys(p for p in parts if p))  # a setting the writer and its caller both hold: once


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


#: where a sequence shard handed over before its number is known goes (a dot folder: never a dataset file)
PROVISIONAL_DIR = "tensors/.provisional"


def provisional_name(staging_name: str) -> str:
    """The provisional path of a sequence shard handed over as it closed (renamed at the end)."""
    return f"{PROVISIONAL_DIR}/{staging_name}"
