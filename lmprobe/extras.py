"""Extra artefacts published beside a dataset: saev exports under ``saev/<HASH>/`` and SAE
dictionaries under ``sae/<name>/`` (docs/publishing.md).

The dataset's index records them in an extra schema key, ``lmprobe:extras``, which readers that
only know the format ignore. The card lists them and shows how to fetch one part alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from .errors import LmprobeError
from .format.spec import CARD_PATH, INDEX_PATH

SAEV_DIR = "saev"
SAE_DIR = "sae"


class ExtrasError(LmprobeError, ValueError):
    """An extra artefact beside a dataset is invalid."""


def describe_saev(d: Path) -> dict:
    """The index's record of a saev export folder (validated first)."""
    from .saev import validate_saev

    problems = validate_saev(d)
    if problems:
        raise ExtrasError(f"{d} is not a valid saev export: {'; '.join(problems)}")
    m = json.loads((d / "metadata.json").read_text())
    return {"path": f"{SAEV_DIR}/{d.name}", "layers": m["layers"], "context_len": m["patches_per_ex"],
            "n_ex": m["n_ex"], "d_model": m["d_model"]}


def describe_sae(root: Path, name: str) -> dict:
    """The index's record of an SAE dictionary ``root/name`` (validated first)."""
    from .sae.loader import SAEConfig, load_dictionary, validate_dictionary

    problems = validate_dictionary(root, name)
    if problems:
        raise ExtrasError(f"{root / name} is not a valid SAE dictionary: {'; '.join(problems)}")
    dct = load_dictionary(SAEConfig(root_path=root, dictionary_name=name, device="cpu"))
    return {"path": f"{SAE_DIR}/{name}", "layers": dct.layers, "feature_count": dct.meta["feature_count"],
            "model_hash": dct.meta["model_hash"]}


def scan_extras(root: str | os.PathLike) -> dict[str, list[dict]]:
    """Describe the saev exports and SAE dictionaries in ``root/saev`` and ``root/sae``; validate each."""
    root = Path(root)
    out: dict[str, list[dict]] = {"saev": [], "sae": []}
    for d in sorted((root / SAEV_DIR).iterdir()) if (root / SAEV_DIR).is_dir() else []:
        if not d.name.startswith("."):
            out["saev"].append(describe_saev(d))
    for d in sorted((root / SAE_DIR).iterdir()) if (root / SAE_DIR).is_dir() else []:
        if not d.name.startswith("."):
            out["sae"].append(describe_sae(root / SAE_DIR, d.name))
    return out


def add_extra(root: str | os.PathLike, source: str | os.PathLike, kind: str) -> Path:
    """Copy a saev export folder (kind "saev") or an SAE dictionary folder (kind "sae") into the dataset."""
    src = Path(source)
    if kind not in (SAEV_DIR, SAE_DIR):
        raise ValueError(f"kind must be 'saev' or 'sae', got {kind!r}")
    if not src.is_dir():
        raise ExtrasError(f"{src} is not a folder")
    dst = Path(root) / kind / src.name
    if dst.resolve() == src.resolve():
        return dst
    if dst.exists():
        shutil.rmtree(dst)
    tmp = dst.with_name(f".{dst.name}.copying")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp, copy_function=_link_or_copy)
    os.replace(tmp, dst)
    return dst


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def part_files(base: Path) -> list[Path]:
    """The files of one extra part, its top-level metadata after the data it describes (metadata.json last)."""
    files = sorted(p for p in base.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
    meta = {"metadata.json", "shards.json", "meta.json"}
    return sorted(files, key=lambda p: (p.name in meta and p.parent == base, p.name == "metadata.json"))


def extra_files(root: Path, extras: dict[str, list[dict]]) -> list[tuple[str, Path]]:
    """(repo path, local path) of every file of every extra, each part's metadata after its data."""
    out = []
    for kind in ("saev", "sae"):
        for item in extras.get(kind, []):
            out += [(p.relative_to(root).as_posix(), p) for p in part_files(root / item["path"])]
    return out


def card_section(extras: dict[str, list[dict]], repo: str = "OWNER/NAME") -> str:
    lines = ["## Also in this repo", ""]
    for item in extras.get("saev", []):
        lines.append(f"- `{item['path']}/`: a saev protocol 2.0 export (layers {item['layers']}, {item['n_ex']} "
                     f"examples of {item['context_len']} tokens, d_model {item['d_model']}) for SAE training")
    for item in extras.get("sae", []):
        lines.append(f"- `{item['path']}/`: an SAE dictionary (layers {item['layers']}, {item['feature_count']} "
                     "features, sparse CSR encoders)")
    first_saev = extras["saev"][0]["path"] if extras.get("saev") else "saev/HASH"
    first_sae = extras["sae"][0]["path"] if extras.get("sae") else "sae/NAME"
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


def attach_extras(root: str | os.PathLike, extras: dict[str, list[dict]], repo: str | None = None) -> bool:
    """Record ``extras`` in the index (``lmprobe:extras``) and the card; returns whether anything changed.

    Only schema metadata changes: the index rows and every other key stay as they are.
    """
    from .format import card
    from .format.metadata import decode_schema_metadata

    root = Path(root)
    index = root / INDEX_PATH
    table = pq.read_table(index)
    meta = dict(table.schema.metadata or {})
    want = json.dumps(extras).encode()
    has_extras = bool(extras.get("saev") or extras.get("sae"))
    current = meta.get(b"lmprobe:extras")
    if (current == want) or (current is None and not has_extras):
        return False
    if has_extras:
        meta[b"lmprobe:extras"] = want
    else:
        meta.pop(b"lmprobe:extras", None)
    info = decode_schema_metadata(meta)
    sections = [card_section(extras, repo or "OWNER/NAME")] if has_extras else []
    text = card.render_card(info, table.schema, extra_sections=sections)
    tmp_card = root / (CARD_PATH + ".tmp")
    tmp_card.write_text(text)
    os.replace(tmp_card, root / CARD_PATH)
    tmp = index.with_name(index.name + ".tmp")
    pq.write_table(table.replace_schema_metadata(meta), tmp)
    os.replace(tmp, index)
    return True


def extras_of(ds: Any) -> dict[str, list[dict]]:
    """The extras a dataset's index records (empty lists when none)."""
    raw = ds.info.get("extras") or {}
    return {"saev": list(raw.get("saev") or []), "sae": list(raw.get("sae") or [])}


def publish_extra(repo_id: str, local: str | os.PathLike, kind: str, *, token: str | None = None,
                  quiet: bool = True, base_wait: float = 2.0) -> str:
    """Upload a saev export or SAE dictionary folder into an existing dataset repo, then update its index and card.

    The extra's files go first (its metadata last); the repo's index and card follow in one last
    commit, so the entry point only ever lists complete parts.
    """
    import tempfile

    from .format.reader import load
    from .hub import DEFAULT_COMMIT_BYTES, DEFAULT_COMMIT_FILES, _File, _Pusher

    local = Path(local)
    item = describe_saev(local) if kind == SAEV_DIR else describe_sae(local.parent, local.name)
    ds = load(repo_id, token=token)  # the dataset must be there: it is the entry point
    pusher = _Pusher(repo_id, token=token, revision=None, max_retries=5, base_wait=base_wait, quiet=quiet)
    files = [_File(f"{item['path']}/{p.relative_to(local).as_posix()}", p, p.stat().st_size, None)
             for p in part_files(local)]
    extras = extras_of(ds)
    extras[kind] = [x for x in extras[kind] if x["path"] != item["path"]] + [item]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "index").mkdir()
        shutil.copyfile(ds._files.fetch(INDEX_PATH), root / INDEX_PATH)
        attach_extras(root, extras, repo_id)
        last = [_File(CARD_PATH, root / CARD_PATH, -1, None), _File(INDEX_PATH, root / INDEX_PATH, -1, None)]
        pusher.push_files(files, last, commit_files=DEFAULT_COMMIT_FILES, commit_bytes=DEFAULT_COMMIT_BYTES,
                          label=item["path"])
    return item["path"]
