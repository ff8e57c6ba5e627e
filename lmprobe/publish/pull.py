"""``lmprobe pull``: copy the index and chosen parts of a Hub dataset into a local folder."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from ..atomic import atomic_output, atomic_write
from ..errors import HubUnreachableError, InvalidArgumentError, LayerNotFoundError, ShardMissingError
from ..format.spec import CARD_PATH, INDEX_PATH, PULL_RECORD
from ..hashing import sha256_file
from ..lock import OutputLock
from ..opening import open_hub
from ..paths import check_output_path
from ..progress import Progress, on_terminal, third_party_bars
from ..storage.hub import HubFiles, parse_dataset_ref


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
    quiet: bool = False,
) -> Path:
    """Copy the index, the card and only the shards of ``layers`` and ``hookpoints`` (all when None) to a local folder.

    ``only="saev"`` or ``"sae"`` (or a path such as ``"saev/<HASH>"``) copies just those
    attachments instead; ``only="dataset"`` (the default) copies the dataset.

    >>> lmprobe.pull("me/acts", "acts-16", layers=[16])  # doctest: +SKIP
    """
    ref = parse_dataset_ref(repo, revision)
    if ref is None:
        raise InvalidArgumentError(f"{repo!r} is not a Hub repo id (OWNER/NAME or hf://datasets/OWNER/NAME)")
    out = check_output_path(out, "pull destination")
    try:
        with OutputLock(out):
            return _pull(ref, out, layers=layers, hookpoints=hookpoints, logits=logits, only=only, token=token,
                         quiet=quiet)
    except HubUnreachableError as exc:  # a pull cannot read a local copy instead: it makes one
        raise HubUnreachableError(
            f"cannot reach the Hub at {exc.endpoint} to pull {exc.repo_id} ({exc.reason}); check the network (or "
            "HF_ENDPOINT) and run the same pull again: files already here are not fetched again",
            endpoint=exc.endpoint, repo_id=exc.repo_id, reason=exc.reason) from exc


def _pull(ref, out: Path, *, layers, hookpoints, logits: bool, only: str | None, token, quiet: bool) -> Path:
    ds = open_hub(ref, token=token)
    files: HubFiles = ds.files
    with third_party_bars(not quiet and on_terminal()):  # huggingface_hub's download bars: not into a log
        return _copy(ref, ds, files, out, layers=layers, hookpoints=hookpoints, logits=logits, only=only, quiet=quiet)


def _copy(ref, ds, files: HubFiles, out: Path, *, layers, hookpoints, logits: bool, only: str | None,
          quiet: bool) -> Path:
    if only not in (None, "dataset"):
        prefix = only.strip("/") + "/"
        if not prefix.startswith(("saev/", "sae/")):
            raise InvalidArgumentError(f"only must be 'dataset', 'saev', 'sae' or a path under them, got {only!r}")
        rels = sorted(s for s in files.repo_files if s.startswith(prefix))
        if not rels:
            raise ShardMissingError(f"{files} has nothing under {prefix}")
        meta_names = ("metadata.json", "meta.json")
        rels.sort(key=lambda r: r.rsplit("/", 1)[-1] in meta_names)  # metadata last
        with Progress(len(rels), desc=f"pull {ref.repo_id}", unit="file", quiet=quiet) as bar:
            for rel in rels:
                _copy_into(files.fetch(rel), out / rel)
                bar.update(1)
        if not quiet:
            print(f"pulled {len(rels)} file(s) under {prefix} of {files} to {out}")
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
    records = ds.meta.files(wanted, logits=logits, hookpoints=hps)
    rels = [r.rel for r in records]
    if CARD_PATH in files.repo_files:
        rels.append(CARD_PATH)
    rels.append(INDEX_PATH)  # last: a local folder with an index is complete
    recorded = {r.rel: r for r in records}
    # an earlier pull's index goes first: until the new one lands last, the folder is visibly
    # unfinished, never an old index over a mix of old and new shards
    (out / INDEX_PATH).unlink(missing_ok=True)
    # where the copy came from: `lmprobe info` and a read of a layer it lacks name the pull that fetches it
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / PULL_RECORD, json.dumps({"repo": ref.repo_id, "revision": ref.revision}) + "\n")
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
    if not quiet:
        print(f"pulled {sent} file(s) of {files} (layers {wanted}) to {out}"
              + (f"; {len(rels) - sent} already there" if sent < len(rels) else ""))
    return out


def _copy_into(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(dst) as tmp:
        shutil.copyfile(src, tmp)
