"""The saev protocol's arithmetic and metadata: keys, compatible layouts, folder hashes, shard sizes (docs/saev.md).

Pure planning, shared by the exporter (``export``) and the reader (``reader``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..base.paths import resolve_inside
from ..base.safeio import check_regular, read_json
from ..errors import SaevError, UnsafePathError

PROTOCOL = "2.0"
METADATA_KEYS = ("family", "ckpt", "layers", "patches_per_ex", "cls_token", "d_model", "n_ex", "patches_per_shard",
                 "data", "dataset", "dtype", "protocol")
#: saev 3d73f1f's Metadata fields, in field order (its hash is over them in this order)
METADATA_KEYS_21 = ("family", "ckpt", "layers", "content_tokens_per_example", "cls_token", "d_model", "n_examples",
                    "max_tokens_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol")
#: 2.1 name -> the protocol 2.0 name lmprobe reads by
RENAMED_21 = {"content_tokens_per_example": "patches_per_ex", "n_examples": "n_ex",
              "max_tokens_per_shard": "patches_per_shard"}
#: saev 3d73f1f's PixelAgg values; its loader turns the key into that enum, so it cannot be null
PIXEL_AGG_21 = ("majority", "prefer-fg")
COMPAT = ("2.0", "2.1")
DEFAULT_PATCHES_PER_SHARD = 2_400_000
FAMILY = "llm"
#: what saev_compat=True writes as `family`: saev's Metadata admits only vision model families
SAEV_COMPAT_FAMILY = "clip"
#: the saev code each compatible layout was checked against (tests/reference/saev holds their loaders)
SAEV_CHECKED = {"2.0": "saev e43e7dd (2025-10-03), shuffled loader",
                "2.1": "saev 3d73f1f, shuffled, ordered and indexed loaders"}



def metadata_hash(metadata: dict) -> str:
    """The folder name of a metadata.json, as saev computes it.

    Protocol 2.0 (and saev e43e7dd): sha256 of json.dumps(metadata, sort_keys=True, separators=(',', ':')).
    Protocol 2.1 (saev 3d73f1f): the first 8 hex digits of sha256 over orjson's dump of its Metadata
    dataclass: fields in declaration order, compact, non-ASCII unescaped.
    """
    if metadata.get("protocol") == "2.1":
        ordered = {k: metadata[k] for k in METADATA_KEYS_21 if k in metadata}
        raw = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        return hashlib.sha256(raw).hexdigest()[:8]
    return hashlib.sha256(json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def compat_mode(saev_compat: bool | str | None) -> str | None:
    """``saev_compat`` as a protocol version: False/None -> None, True -> "2.0", "2.0"/"2.1" as they are."""
    if saev_compat is None or saev_compat is False:
        return None
    if saev_compat is True:
        return "2.0"
    if saev_compat in COMPAT:
        return str(saev_compat)
    raise SaevError(f"--saev-compat {saev_compat!r}: choose one of {', '.join(COMPAT)} (the saev protocol to write)")


def canonical_metadata(m: dict) -> dict:
    """A metadata.json of any layout under the protocol 2.0 key names lmprobe reads by (2.1 keys renamed)."""
    return {RENAMED_21.get(k, k): v for k, v in m.items()}


def recorded_source_hash(m: dict) -> str | None:
    """The ``data.source_index_sha256`` an lmprobe export records (``data`` is JSON text in 2.1), else None."""
    data = m.get("data")
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except ValueError:
            return None
    h = data.get("source_index_sha256") if isinstance(data, dict) else None
    return h if isinstance(h, str) else None


def read_saev_metadata(folder: str | os.PathLike) -> dict:
    """A saev folder's metadata.json under the protocol 2.0 key names (2.1 folders' keys renamed)."""
    return canonical_metadata(read_json(file_inside(Path(folder), "metadata.json"), error=SaevError))


def ex_per_shard(patches_per_shard: int, tokens_per_ex: int, n_layers: int) -> int:
    """Section 3: floor(patches_per_shard / (tokens_per_ex * len(layers)))."""
    return patches_per_shard // (tokens_per_ex * n_layers)


def shard_sizes(n_ex: int, per_shard: int) -> list[int]:
    """Examples per shard: full shards, then the remainder; never a shard of zero examples."""
    if per_shard < 1:
        raise SaevError("patches_per_shard is smaller than one example (context_len x layers)")
    full, rest = divmod(n_ex, per_shard)
    return [per_shard] * full + ([rest] if rest else [])


def metadata_21(m: dict) -> dict:
    """Protocol 2.0 metadata as saev 3d73f1f's Metadata: renamed keys in its field order, ``data`` as a string.

    saev stores ``data`` as a base64 pickle of its dataset config, which its loaders never read;
    lmprobe writes no pickle: ``data`` is the compact JSON text of lmprobe's description instead.
    ``pixel_agg`` is "majority", saev's default (the enum admits no null; no labels are aggregated).
    """
    to_21 = {old: new for new, old in RENAMED_21.items()}
    renamed = {to_21.get(k, k): v for k, v in m.items()}
    renamed["data"] = json.dumps(m["data"], sort_keys=True, separators=(",", ":"))
    renamed["pixel_agg"] = "majority"
    renamed["protocol"] = "2.1"
    return {k: renamed[k] for k in METADATA_KEYS_21}


def shard_bytes(n_ex: int, per: int, last: bool, ex_bytes: int) -> tuple[int, ...]:
    """Sizes a shard file may have: its examples, or (the last one) zero-padded to a full shard, as saev writes it."""
    return (n_ex * ex_bytes, per * ex_bytes) if last else (n_ex * ex_bytes,)


def file_inside(folder: Path, name: str) -> Path:
    """A file of a saev folder: inside it (symlinks included) and, when present, a regular file."""
    try:
        f = resolve_inside(folder, name, "saev file")
        return check_regular(f, "saev file") if f.exists() else f
    except UnsafePathError as exc:
        raise SaevError(str(exc)) from None
