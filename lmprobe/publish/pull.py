"""``lmprobe pull``: copy the index and chosen parts of a Hub dataset into a local folder.

The folder records where it came from (``.lmprobe-pull.json``: the repo and the commit). A pull
goes into a new or empty folder, or into an earlier pull of the same repo, which it resumes or
extends; anything else is refused (``overwrite=True`` replaces an lmprobe dataset there). A copy
always holds one version: when the repo has moved on since the copy was pulled, the layers the
copy holds already are checked against the new index too, and fetched again where they changed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..base.atomic import atomic_output, atomic_write
from ..base.hashing import sha256_file
from ..base.lock import OutputLock
from ..base.paths import check_output_path
from ..base.progress import Progress, on_terminal, third_party_bars
from ..base.safeio import read_json
from ..errors import (
    FormatError,
    HubBusyError,
    HubUnreachableError,
    InvalidArgumentError,
    LayerNotFoundError,
    OutputExistsError,
    ShardMissingError,
)
from ..format.metadata import DatasetInfo, decode_schema_metadata, parse_info
from ..format.spec import CARD_PATH, INDEX_PATH, PULL_RECORD
from ..format.staging import previous_dataset_files, remove_files_inside
from ..opening import open_hub
from ..storage.hub import HubFiles, parse_dataset_ref

logger = logging.getLogger(__name__)


def pull(
    repo: str,
    out: str | os.PathLike,
    *,
    layers: Iterable[int] | None = None,
    hookpoints: Iterable[str] | None = None,
    logits: bool = True,
    only: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    overwrite: bool = False,
    quiet: bool = False,
) -> Path:
    """Copy the index, the card and only the shards of ``layers`` and ``hookpoints`` (all when None) to a local folder.

    ``only="saev"`` or ``"sae"`` (or a path such as ``"saev/<HASH>"``) copies just those
    attachments instead; ``only="dataset"`` (the default) copies the dataset.

    ``out`` is a new or empty folder, or an earlier pull of ``repo`` (resumed, or extended by more
    layers); ``overwrite=True`` replaces an lmprobe dataset there (a local extraction, a copy of
    another repo). Other folders are refused: nothing in them is replaced.

    >>> lmprobe.pull("me/acts", "acts-16", layers=[16])  # doctest: +SKIP
    """
    ref = parse_dataset_ref(repo, revision)
    if ref is None:
        raise InvalidArgumentError(f"{repo!r} is not a Hub repo id (OWNER/NAME or hf://datasets/OWNER/NAME)")
    out = check_output_path(out, "pull destination")
    try:
        with OutputLock(out):
            return _pull(ref, out, layers=layers, hookpoints=hookpoints, logits=logits, only=only, token=token,
                         overwrite=overwrite, quiet=quiet)
    except HubBusyError as exc:  # the server's time, and how a pull goes on
        raise HubBusyError(f"{exc.what}: the Hub answers HTTP {exc.status} and asks lmprobe to wait "
                           f"{exc.asked:.0f} s, until {exc.until}; a pull waits at most a minute, so it stops here: run "
                           f"the same pull again after {exc.until}: files already here are not fetched again",
                           what=exc.what, status=exc.status, asked=exc.asked, until=exc.until) from None
    except HubUnreachableError as exc:  # a pull cannot read a local copy instead: it makes one
        raise HubUnreachableError(
            f"cannot reach the Hub at {exc.endpoint} to pull {exc.repo_id} ({exc.reason}); check the network (or "
            "HF_ENDPOINT) and run the same pull again: files already here are not fetched again",
            endpoint=exc.endpoint, repo_id=exc.repo_id, reason=exc.reason) from exc


def _pull(ref, out: Path, *, layers, hookpoints, logits: bool, only: str | None, token, overwrite: bool,
          quiet: bool) -> Path:
    ds = open_hub(ref, token=token)
    files: HubFiles = ds.files
    with third_party_bars(not quiet and on_terminal()):  # huggingface_hub's download bars: not into a log
        return _copy(ref, ds, files, out, layers=layers, hookpoints=hookpoints, logits=logits, only=only,
                     overwrite=overwrite, quiet=quiet)


def _copy(ref, ds, files: HubFiles, out: Path, *, layers, hookpoints, logits: bool, only: str | None,
          overwrite: bool, quiet: bool) -> Path:
    if only not in (None, "dataset"):
        prefix = only.strip("/") + "/"
        if not prefix.startswith(("saev/", "sae/")):
            raise InvalidArgumentError(f"only must be 'dataset', 'saev', 'sae' or a path under them, got {only!r}")
        rels = sorted(s for s in files.repo_files if s.startswith(prefix))
        if not rels:
            raise ShardMissingError(f"{files} has nothing under {prefix}")
        _earlier_pull(out, ref.repo_id, overwrite)  # before anything is written
        meta_names = ("metadata.json", "meta.json")
        rels.sort(key=lambda r: r.rsplit("/", 1)[-1] in meta_names)  # metadata last
        _record(out, ref.repo_id, files.commit)
        with Progress(len(rels), desc=f"pull {ref.repo_id}", unit="file", quiet=quiet) as bar:
            for rel in rels:
                _copy_into(files.fetch(rel), out / rel)
                bar.update(1)
        if not quiet:
            logger.info("pulled %s file(s) under %s of %s to %s", len(rels), prefix, files, out)
        return out
    wanted = ds.layers if layers is None else [int(x) for x in layers]
    missing = [x for x in wanted if x not in ds.layers]
    if missing:
        raise LayerNotFoundError(f"layers {missing} are not in {files}; it stores {ds.layers}",
                                 layer=missing, available=ds.layers)
    hps = None if hookpoints is None else [str(h) for h in hookpoints]
    unknown = [h for h in hps or [] if h not in ds.hookpoints]
    if unknown:
        raise LayerNotFoundError(f"hookpoints {unknown} are not in {files}; it stores {ds.hookpoints}",
                                 layer=unknown, available=ds.hookpoints)
    previous = _earlier_pull(out, ref.repo_id, overwrite)  # refuses another folder before anything is written
    records = ds.meta.files(wanted, logits=logits, hookpoints=hps)
    # a copy holds one version: unless it is whole at this very commit, what it holds already (of any layer)
    # is checked against this commit's index and fetched again where it changed
    old_meta = _local_meta(out)
    same = previous is not None and previous.get("revision") == files.commit and old_meta is not None
    stale: list[Path] = []
    if not same and out.is_dir():
        held, held_logits = _held(out, ds.meta, old_meta)
        have = {r.rel for r in records}
        extra = [r for hp, layer in held for r in ds.meta.files([layer], logits=False, hookpoints=[hp])
                 if r.rel not in have]
        if held_logits and not logits and ds.meta.logits is not None:
            extra += [r for r in ds.meta.files([], logits=True, hookpoints=[]) if r.rel not in have]
        records += list({r.rel: r for r in extra}.values())
        kept = {r.rel for r in records}
        stale = [out / r.rel for r in (old_meta.files() if old_meta else []) if r.rel not in kept]
        if held and previous is not None and not quiet:
            was = str(previous.get("revision") or "an unrecorded commit")[:10]
            layers_here = sorted({layer for _, layer in held})
            logger.info("%s changed since %s was pulled (commit %s -> %s): the layers already here, "
                        "layers %s, are checked and fetched again where they changed",
                        files, out, was, files.commit[:10], layers_here)
    rels = [r.rel for r in records]
    if CARD_PATH in files.repo_files:
        rels.append(CARD_PATH)
    rels.append(INDEX_PATH)  # last: a local folder with an index is complete
    recorded = {r.rel: r for r in records}
    # an earlier pull's index goes first: until the new one lands last, the folder is visibly
    # unfinished, never an old index over a mix of old and new shards
    (out / INDEX_PATH).unlink(missing_ok=True)
    # where the copy came from, at which commit: `lmprobe info` and a read of a layer it lacks name the pull
    # that fetches it; the next pull tells an unchanged repo from one pushed again
    _record(out, ref.repo_id, files.commit)
    sent = 0
    with Progress(len(rels), desc=f"pull {ref.repo_id}", unit="file", quiet=quiet) as bar:
        for rel in rels:
            rec = recorded.get(rel)
            dst = out / rel
            if not (rec is not None and rec.sha256 and dst.is_file() and not dst.is_symlink()
                    and (rec.bytes is None or dst.stat().st_size == rec.bytes) and sha256_file(dst) == rec.sha256):
                _copy_into(files.fetch(rel), dst)  # (else already here, byte for byte: a resumed pull)
                sent += 1
            bar.update(1)
    remove_files_inside(out, stale)  # shards of the old version that the new index no longer lists
    if not quiet:
        logger.info("pulled %s file(s) of %s (layers %s) to %s%s", sent, files, wanted, out,
                    f"; {len(rels) - sent} already there" if sent < len(rels) else "")
    return out


def _read_record(out: Path) -> dict | None:
    try:
        rec = read_json(out / PULL_RECORD, what=PULL_RECORD) if (out / PULL_RECORD).is_file() else None
    except FormatError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("repo"), str) else None


def _record(out: Path, repo_id: str, commit: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / PULL_RECORD, json.dumps({"repo": repo_id, "revision": commit}) + "\n")


def _earlier_pull(out: Path, repo_id: str, overwrite: bool) -> dict | None:
    """The record of an earlier pull of ``repo_id`` into ``out`` (None: ``out`` is new or empty, or its dataset was
    just removed by ``overwrite``); any other folder is refused, so nothing in it is replaced."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder; pull into a new or empty folder")
    rec = _read_record(out)
    if rec is not None and rec["repo"] == repo_id:
        return rec
    if not any(not p.name.startswith(".lmprobe-") for p in out.iterdir()):
        return None  # empty, or lmprobe's own bookkeeping only
    if (out / INDEX_PATH).exists():
        what = f"a copy of {rec['repo']}" if rec is not None else "an lmprobe dataset"
        if not overwrite:
            raise OutputExistsError(f"{out} holds {what}, not a copy of {repo_id}; pass --overwrite (overwrite=True) "
                                    "to replace it, or pull into a new or empty folder")
        remove_files_inside(out, previous_dataset_files(out))  # its shards, statistics, card and index only
        (out / PULL_RECORD).unlink(missing_ok=True)
        return None
    raise OutputExistsError(f"{out} is not empty and is not a copy of {repo_id} (what is there would be replaced); "
                            "pull into a new or empty folder")


def _local_meta(out: Path) -> DatasetInfo | None:
    """The descriptors of the index a copy holds now (None: no index, or an unreadable one)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return parse_info(decode_schema_metadata(pq.read_schema(out / INDEX_PATH).metadata))
    except (FormatError, OSError, pa.ArrowInvalid):
        return None


def _held(out: Path, new: DatasetInfo, old: DatasetInfo | None) -> tuple[list[tuple[str, int]], bool]:
    """The (hookpoint, layer) pairs a copy holds a shard of, by the names of either index; and whether it holds logits."""
    held: list[tuple[str, int]] = []
    for hp, h in new.hookpoints.items():
        for layer in h.layers:
            names = [h.file(layer, s) for s in range(len(h.shards))]
            if old is not None and hp in old.hookpoints and layer in old.hookpoints[hp].layers:
                o = old.hookpoints[hp]
                names += [o.file(layer, s) for s in range(len(o.shards))]
            if any(_is_file(out, n) for n in names):
                held.append((hp, layer))
    logits: list[Any] = [new.logits, old.logits if old is not None else None]
    held_logits = any(lg is not None and any(_is_file(out, lg.file(s)) for s in range(len(lg.shards)))
                      for lg in logits)
    return held, held_logits


def _is_file(out: Path, rel: str) -> bool:
    p = out / rel
    return p.is_file() and not p.is_symlink()


def _copy_into(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(dst) as tmp:
        shutil.copyfile(src, tmp)
