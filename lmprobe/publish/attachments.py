"""Attachments: artefacts published beside a dataset, saev exports under ``saev/<HASH>/`` and SAE
dictionaries under ``sae/<name>/`` (docs/publishing.md).

The dataset's index records them in an extra schema key, ``lmprobe:attachments`` (datasets
published before it was named so use ``lmprobe:extras``; both are read), which readers that only
know the format ignore. The card lists them and shows how to fetch one part alone.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from ..base.atomic import atomic_output, atomic_write, move_into_place
from ..base.lock import OutputLock
from ..base.paths import resolve_inside
from ..errors import AttachmentError, DictionaryError, FormatError, LmprobeError, SaevError
from ..format import card
from ..format.metadata import decode_schema_metadata, recorded_attachments
from ..format.reader import Dataset, open_local
from ..format.spec import ATTACHMENT_KINDS, CARD_PATH, INDEX_PATH
from ..format.validate import Report
from ..opening import load
from ..sae.loader import SAEConfig, load_dictionary, validate_dictionary
from ..saev import read_saev_metadata, recorded_source_hash, source_index_hash, validate_saev
from ..storage.commits import HubCommitter, PushConfig, RepoFile

KINDS = ATTACHMENT_KINDS
SAEV_DIR, SAE_DIR = KINDS
METADATA_KEY = b"lmprobe:attachments"
LEGACY_METADATA_KEY = b"lmprobe:extras"


def describe_saev(d: Path, dataset: Dataset | None = None) -> dict:
    """The index's record of a saev export folder (validated first; with ``dataset``, checked to be an export of it)."""
    problems = validate_saev(d)
    if problems:
        raise AttachmentError(f"{d} is not a valid saev export: {'; '.join(problems)}")
    m = read_saev_metadata(d)  # a saev 2.1 folder's keys under the 2.0 names
    recorded = recorded_source_hash(m)  # None: written by saev itself or another tool, nothing to compare
    if dataset is not None and recorded is not None and recorded != source_index_hash(dataset):
        raise AttachmentError(f"{d} was exported from another dataset, or an earlier version of this one "
                              f"({dataset.source} has other texts or shards since): export it again "
                              "(`lmprobe export-saev`), or move it out of the dataset")
    return {"path": f"{SAEV_DIR}/{d.name}", "layers": m["layers"], "context_len": m["patches_per_ex"],
            "n_ex": m["n_ex"], "d_model": m["d_model"]}


def describe_sae(root: Path, name: str) -> dict:
    """The index's record of an SAE dictionary ``root/name`` (validated first)."""
    problems = validate_dictionary(root, name)
    if problems:
        raise AttachmentError(f"{root / name} is not a valid SAE dictionary: {'; '.join(problems)}")
    dct = load_dictionary(SAEConfig(root_path=root, dictionary_name=name, device="cpu"))
    return {"path": f"{SAE_DIR}/{name}", "layers": dct.layers, "feature_count": dct.meta["feature_count"],
            "model_hash": dct.meta["model_hash"]}


def describe(folder: Path, kind: str, dataset: Dataset | None = None) -> dict:
    """The index's record of an attachment; ``dataset``: the one it is to be published beside (a saev export must
    be an export of it)."""
    return describe_saev(folder, dataset) if kind == SAEV_DIR else describe_sae(folder.parent, folder.name)


def attachment_folders(root: str | os.PathLike) -> list[tuple[str, Path]]:
    """(kind, folder) of every saev export and SAE dictionary in ``root/saev`` and ``root/sae``."""
    root = Path(root)
    return [(kind, d) for kind in KINDS if (root / kind).is_dir()
            for d in sorted((root / kind).iterdir()) if not d.name.startswith(".")]


def scan_attachments(root: str | os.PathLike, dataset: Dataset | None = None) -> dict[str, list[dict]]:
    """Describe the saev exports and SAE dictionaries in ``root/saev`` and ``root/sae``; validate each (and, with
    ``dataset``, check that each saev export was made from it)."""
    out: dict[str, list[dict]] = {SAEV_DIR: [], SAE_DIR: []}
    for kind, d in attachment_folders(root):
        out[kind].append(describe(d, kind, dataset))
    return out


def add_attachment(root: str | os.PathLike, source: str | os.PathLike, kind: str) -> Path:
    """Copy a saev export folder (kind "saev") or an SAE dictionary folder (kind "sae") into the dataset.

    The copy replaces ``root/<kind>/<name>`` and nothing else: a source that already is that folder
    is kept as it is, and a source that contains it or lies inside it (other than being it) is refused,
    so copying never deletes the source or anything beside the folder it replaces.
    """
    if kind not in KINDS:
        raise AttachmentError(f"kind must be 'saev' or 'sae', got {kind!r}")
    src = Path(os.path.realpath(source))  # "." and ".." have no name of their own
    if not src.is_dir():
        raise AttachmentError(f"{source} is not a folder")
    base = Path(os.path.realpath(Path(root) / kind))
    dst = base / src.name
    if src == dst:
        return dst  # already in place
    if src == base or base in src.parents or src in dst.parents:
        raise AttachmentError(f"{source} ({src}) contains or lies inside {base}, where attachments are copied to; "
                              f"pass the {kind} folder itself")
    with OutputLock(dst):
        tmp = dst.with_name(f".{dst.name}.copying")
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
        old = dst.with_name(f".{dst.name}.replaced")
        if dst.exists():
            move_into_place(dst, old)
        move_into_place(tmp, dst)
        if old.exists():
            shutil.rmtree(old)
    return dst


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def part_files(base: Path) -> list[Path]:
    """The files of one attachment, its top-level metadata after the data it describes (metadata.json last)."""
    files = sorted(p for p in base.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
    meta = {"metadata.json", "shards.json", "meta.json"}
    return sorted(files, key=lambda p: (p.name in meta and p.parent == base, p.name == "metadata.json"))


def attachment_files(root: Path, attachments: dict[str, list[dict]]) -> list[tuple[str, Path]]:
    """(repo path, local path) of every file of every attachment, each one's metadata after its data."""
    out = []
    for kind in KINDS:
        for item in attachments.get(kind, []):
            out += [(p.relative_to(root).as_posix(), p) for p in part_files(root / item["path"])]
    return out


def card_section(attachments: dict[str, list[dict]], repo: str = "OWNER/NAME") -> str:
    lines = ["## Also in this repo", ""]
    for item in attachments.get(SAEV_DIR, []):
        lines.append(f"- `{item['path']}/`: a saev protocol 2.0 export (layers {item['layers']}, {item['n_ex']} "
                     f"examples of {item['context_len']} tokens, d_model {item['d_model']}) for SAE training")
    for item in attachments.get(SAE_DIR, []):
        lines.append(f"- `{item['path']}/`: an SAE dictionary (layers {item['layers']}, {item['feature_count']} "
                     "features, sparse CSR encoders)")
    first_saev = attachments[SAEV_DIR][0]["path"] if attachments.get(SAEV_DIR) else "saev/HASH"
    first_sae = attachments[SAE_DIR][0]["path"] if attachments.get(SAE_DIR) else "sae/NAME"
    lines += [
        "",
        "Each part downloads without the others:",
        "",
        "```bash",
        f"lmprobe pull {repo} --only saev --out local-copy     # or --only sae, or --only dataset",
        "```",
        "",
        "```python",
        "from huggingface_hub import snapshot_download",
        f'snapshot_download("{repo}", repo_type="dataset", allow_patterns=["{first_saev}/*"])',
        "",
        "from lmprobe.saev import SaevDataset",
        f'sv = SaevDataset("hf://datasets/{repo}/{first_saev}")   # downloads only the shards it reads',
        "from lmprobe.sae import SAEConfig, load_dictionary",
        f'dct = load_dictionary(SAEConfig(root_path="hf://datasets/{repo}/{SAE_DIR}", '
        f'dictionary_name="{first_sae.split("/")[-1]}"))',
        "```",
    ]
    return "\n".join(lines)


def attach(root: str | os.PathLike, attachments: dict[str, list[dict]], repo: str | None = None) -> bool:
    """Record ``attachments`` in the index (``lmprobe:attachments``) and the card; returns whether anything changed.

    Only schema metadata changes: the index rows and every other key stay as they are.
    """
    root = Path(root)
    index = root / INDEX_PATH
    table = pq.read_table(index)
    meta = dict(table.schema.metadata or {})
    want = json.dumps(attachments).encode()
    has_any = bool(attachments.get(SAEV_DIR) or attachments.get(SAE_DIR))
    current = meta.get(METADATA_KEY, meta.get(LEGACY_METADATA_KEY))
    if (current == want) or (current is None and not has_any):
        return False
    meta.pop(LEGACY_METADATA_KEY, None)
    if has_any:
        meta[METADATA_KEY] = want
    else:
        meta.pop(METADATA_KEY, None)
    info = decode_schema_metadata(meta)
    sections = [card_section(attachments, repo or "OWNER/NAME")] if has_any else []
    existing = (root / CARD_PATH).read_text(encoding="utf-8") if (root / CARD_PATH).is_file() else None
    atomic_write(root / CARD_PATH, card.update_card(existing, info, table.schema, extra_sections=sections))
    with atomic_output(index) as tmp:
        pq.write_table(table.replace_schema_metadata(meta), tmp)
    return True


def validate_attachments(root: str | os.PathLike, info: dict[str, Any], rep: Report) -> None:
    """Add to ``rep`` every problem of the attachments a local dataset's metadata records, and of those in its
    ``saev/`` and ``sae/`` folders (what `push` would publish): each valid, and each saev export made from it."""
    root = Path(root)
    try:
        dataset: Dataset | None = open_local(root)
    except LmprobeError:  # the dataset's own problems are in the report already
        dataset = None
    folders: dict[Path, str] = {}
    for kind, items in recorded_attachments(info).items():
        for item in items:
            rel = item.get("path")
            try:
                folder = resolve_inside(root, rel, f"attachment {kind} path")
            except FormatError as exc:
                rep.errors.append(str(exc))
                continue
            if not folder.is_dir():
                rep.warnings.append(f"{rel}/ is recorded in lmprobe:attachments but not in this folder (a partial copy?)")
                continue
            folders[folder] = kind
    for kind, d in attachment_folders(root):
        folders.setdefault(d.resolve(), kind)
    for folder, kind in folders.items():
        try:
            describe(folder, kind, dataset)
        except (AttachmentError, SaevError, DictionaryError) as exc:
            rep.errors.append(str(exc))


def publish_attachment(repo_id: str, local: str | os.PathLike, kind: str, *, token: str | None = None,
                       quiet: bool = True, base_wait: float = 2.0) -> str:
    """Upload a saev export or SAE dictionary folder into an existing dataset repo, then update its index and card.

    The attachment's files go first (its metadata last); the repo's index and card follow in one
    last commit, so the entry point only ever lists complete parts.
    """
    local = Path(local)
    ds: Dataset = load(repo_id, token=token)  # the dataset must be there: it is the entry point
    item = describe(local, kind, ds)  # a saev export must be an export of that dataset
    committer = HubCommitter(repo_id, token=token, config=PushConfig(base_wait=base_wait), label=item["path"],
                             quiet=quiet)
    files = [RepoFile(f"{item['path']}/{p.relative_to(local).as_posix()}", p) for p in part_files(local)]
    attachments = recorded_attachments(ds.info)
    attachments[kind] = [x for x in attachments[kind] if x.get("path") != item["path"]] + [item]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "index").mkdir()
        shutil.copyfile(ds.shards.fetch(INDEX_PATH, "index"), root / INDEX_PATH)
        if ds.files.has(CARD_PATH):  # the repo's own card, to update, not replace
            shutil.copyfile(ds.files.fetch(CARD_PATH, what="card"), root / CARD_PATH)
        attach(root, attachments, repo_id)
        last = [RepoFile(CARD_PATH, root / CARD_PATH), RepoFile(INDEX_PATH, root / INDEX_PATH)]
        committer.push_files(files, last)
    return item["path"]
