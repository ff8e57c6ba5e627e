"""``lmprobe validate``: check a dataset against the format document, reporting every problem in one pass."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..base.hashing import sha256_file
from ..base.paths import resolve_inside
from ..base.safeio import check_regular
from ..errors import FormatError, UnsafePathError, ValidationError
from .dtypes import DTYPES, SCALE_DTYPE
from .files import LocalFiles, find_index
from .metadata import WRITER, DatasetInfo, decode_schema_metadata, parse_info
from .safetensors_io import read_header
from .spec import CARD_PATH, STAGING_DIR


@dataclass
class Report:
    path: str
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked_files: int = 0
    info: dict | None = None  # the decoded metadata, once it parsed
    #: a copy ``lmprobe pull`` made of part of a dataset: the repo it came from, what it holds, what it left there
    origin: str | None = None
    held: dict[str, list[int]] = field(default_factory=dict)  # hookpoint -> layers whose shards are here
    not_pulled: dict[str, list[int]] = field(default_factory=dict)  # hookpoint -> layers none of whose shards are
    logits_not_pulled: bool = False

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def partial(self) -> bool:
        """A copy of some of a dataset's layers (or without its logits), as ``lmprobe pull`` makes."""
        return any(self.not_pulled.values()) or self.logits_not_pulled

    def partial_line(self) -> str:
        """What a partial copy holds and lacks, and the pull that fetches the rest."""
        multi = len(self.held) > 1

        def named(hp: str, layers: list[int]) -> str:
            return f"{hp + ' ' if multi else ''}{'layer' if len(layers) == 1 else 'layers'} {', '.join(map(str, layers))}"

        held = "; ".join(f"{hp + ' ' if multi else ''}layers {ls}" for hp, ls in self.held.items())
        lacking = [named(hp, ls) for hp, ls in self.not_pulled.items() if ls]
        lacking += ["the logits"] if self.logits_not_pulled else []
        wanted = sorted({x for ls in self.not_pulled.values() for x in ls})
        how = (f"`lmprobe pull {self.origin or 'REPO'}" + (f" --layers {','.join(map(str, wanted))}" if wanted else "")
               + f" --out {self.path}`")
        return (f"partial copy of {self.origin or 'a Hub dataset'}: holds {held}; not pulled: {', '.join(lacking)} "
                f"({how} fetches them)")

    def __str__(self) -> str:
        lines = [f"{self.path}: {'OK' if self.ok else 'INVALID'} ({self.checked_files} shard files checked, "
                 f"{len(self.errors)} error(s), {len(self.warnings)} warning(s))"]
        if self.partial:
            lines.append(f"  {self.partial_line()}")
        lines += [f"  error: {e}" for e in self.errors]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def raise_for_errors(self) -> None:
        """Raise ValidationError listing every error, if there is any."""
        if self.errors:
            raise ValidationError(self.path, self.errors)


def _int_col(table: pa.Table, name: str, rep: Report, *, expected: str = "int32") -> np.ndarray | None:
    if name not in table.column_names:
        rep.errors.append(f"index column {name!r} is missing")
        return None
    col = table.column(name)
    if not pa.types.is_integer(col.type):
        rep.errors.append(f"index column {name!r} has type {col.type}, expected {expected}")
        return None
    if str(col.type) != expected:
        rep.warnings.append(f"index column {name!r} has type {col.type}; the document says {expected}")
    if col.null_count:
        rep.errors.append(f"index column {name!r} has {col.null_count} null value(s)")
        return None
    return col.to_numpy().astype(np.int64)


#: errors listed one by one before further missing shard files are only counted
_LISTED_ERRORS = 50


def _files_under(root: Path) -> set[str]:
    """Every file below ``root`` (symlinks not followed), as '/'-joined relative paths."""
    out = set()
    for folder, _dirs, names in os.walk(root):
        rel = os.path.relpath(folder, root)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        out.update(prefix + n for n in names)
    return out


def _check_file(root: Path, rel: str, key_types: dict[str, tuple[str | None, tuple[int, ...]]], rep: Report,
                recorded: dict | None, checksums: bool) -> None:
    """Check one shard: it exists, parses, holds ``key_types`` {key: (dtype, shape)}, matches recorded size/sha256."""
    try:
        path = resolve_inside(root, rel, "shard file")
    except FormatError as exc:
        rep.errors.append(str(exc))
        return
    if not path.exists():
        rep.errors.append(f"{rel}: file is missing")
        return
    try:
        check_regular(path, rel)
    except UnsafePathError as exc:
        rep.errors.append(str(exc))
        return
    rep.checked_files += 1
    try:
        header = read_header(path)
    except FormatError as exc:
        rep.errors.append(str(exc))
        return
    for key, (dtype, shape) in key_types.items():
        entry = header.tensors.get(key)
        if entry is None:
            rep.errors.append(f"{rel}: tensor {key!r} is missing (has {sorted(header.tensors)})")
            continue
        if dtype is not None and entry.dtype != dtype:
            rep.errors.append(f"{rel}: tensor {key!r} is {entry.dtype}, the metadata says {dtype}")
        if entry.shape != shape:
            rep.errors.append(f"{rel}: tensor {key!r} has shape {list(entry.shape)}, expected {list(shape)}")
    end = max((e.end for e in header.tensors.values()), default=header.data_start)
    if end != header.file_size:
        rep.errors.append(f"{rel}: file is {header.file_size} bytes but its tensors end at byte {end}")
    if recorded:
        if "bytes" in recorded and recorded["bytes"] != header.file_size:
            rep.errors.append(f"{rel}: size is {header.file_size} bytes, the metadata records {recorded['bytes']}")
        if checksums and "sha256" in recorded:
            actual = sha256_file(path)
            if actual != recorded["sha256"]:
                rep.errors.append(f"{rel}: sha256 is {actual}, the metadata records {recorded['sha256']}")


def _check_coverage(name: str, shard_ids: np.ndarray, offsets: np.ndarray, sizes: list[int], rep: Report,
                    first_shard: int = 0) -> None:
    """Every (shard, offset) is in range, used once, and each shard's rows are all used."""
    n = len(sizes)
    if len(shard_ids) == 0:
        if any(sizes):
            rep.errors.append(f"{name}: shards list rows but the index addresses none")
        return
    bad = (shard_ids < first_shard) | (shard_ids >= first_shard + n)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        rep.errors.append(f"{name}: entry {i} points at shard {shard_ids[i]}, outside shards {first_shard}..{first_shard + n - 1}")
        return
    limit = np.asarray(sizes, dtype=np.int64)[shard_ids - first_shard]
    bad = (offsets < 0) | (offsets >= limit)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        rep.errors.append(f"{name}: entry {i} has offset {offsets[i]}, outside shard {shard_ids[i]} ({limit[i]} rows)")
        return
    base = np.concatenate([[0], np.cumsum(sizes)])[shard_ids - first_shard]
    flat = base + offsets
    uniq = np.unique(flat)
    if len(uniq) != len(flat):
        rep.errors.append(f"{name}: {len(flat) - len(uniq)} row(s) are addressed more than once")
    counts = np.bincount(shard_ids - first_shard, minlength=n)
    for s, (c, want) in enumerate(zip(counts.tolist(), sizes, strict=False)):
        if c != want and len(uniq) == len(flat):
            rep.errors.append(f"{name}: shard {first_shard + s} lists {want} rows but the index addresses {c}")


def _check_lists(table: pa.Table, name: str, lengths: np.ndarray | None, minus: int, rep: Report, *,
                 ours: bool) -> None:
    """A per-token column has ``num_tokens - minus`` entries per row.

    The format document fixes no length for these columns; lmprobe's own datasets are held to
    it, other writers' departures are warnings (lmprobe 0.10.3 keeps a first-token entry in
    ``token_perplexity`` for rows that were left-padded in their batch).
    """
    if name not in table.column_names or lengths is None:
        return
    col = table.column(name)
    if not pa.types.is_list(col.type) and not pa.types.is_large_list(col.type):
        rep.errors.append(f"index column {name!r} has type {col.type}, expected a list")
        return
    got = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    want = lengths - minus
    bad = np.flatnonzero(got != want)
    if len(bad):
        i = int(bad[0])
        msg = f"row {i}: {name} has {got[i]} entries, expected {want[i]} ({len(bad)} row(s) differ)"
        if ours:
            rep.errors.append(msg)
        else:
            rep.warnings.append(msg + "; written by another implementation, whose per-token lengths may differ")


def validate(path: str | os.PathLike, *, checksums: bool = True) -> Report:
    """Check the dataset at ``path``; return a Report listing every error and warning found.

    The steps: read the index and its metadata, then check the metadata keys, the index's columns, the hidden
    states' shard files, the logits, the statistics, the optional columns and the folder itself."""
    root = Path(path)
    rep = Report(str(root))
    opened = _read_index(root, rep)
    if opened is None:
        return rep
    table, raw, info = opened
    present = _files_under(root)
    _check_metadata(table, raw, info, rep)
    lengths = _check_core_columns(table, rep)
    shard_index = _int_col(table, "shard_index", rep)
    row_offset = _int_col(table, "row_offset", rep)
    _check_hidden(root, table, info, present, lengths, shard_index, row_offset, rep, checksums)
    _check_logits(root, table, info, present, rep, checksums)
    _check_statistics(root, info, rep, checksums)
    _check_optional_columns(table, raw, lengths, rep)
    _check_folder(root, rep)
    return rep


def _read_index(root: Path, rep: Report) -> tuple[pa.Table, dict[str, Any], DatasetInfo] | None:
    """The index table, its ``lmprobe:`` metadata and the parsed info; None (and the error in ``rep``) if unreadable."""
    try:
        index_path = find_index(root)
        table = pq.read_table(index_path)
    except (OSError, pa.ArrowInvalid, FormatError) as exc:
        rep.errors.append(f"cannot read the index: {exc}")
        return None
    try:
        raw = decode_schema_metadata(table.schema.metadata)
        if not raw:
            raise FormatError("the index has no 'lmprobe:' schema metadata")
        info: DatasetInfo = parse_info(raw)
    except FormatError as exc:
        rep.errors.append(str(exc))
        return None
    rep.info = raw
    rep.origin = LocalFiles(root).origin  # a `lmprobe pull` copy may hold some layers only
    return table, raw, info


def _check_metadata(table: pa.Table, raw: dict[str, Any], info: DatasetInfo, rep: Report) -> None:
    """The metadata keys every dataset has, and the row count they state."""
    for key in ("model", "prompt_ordering", "provenance"):
        if key not in raw:
            rep.warnings.append(f"metadata key 'lmprobe:{key}' is missing")
    model = raw.get("model")
    if "model" in raw and not (isinstance(model, dict) and isinstance(model.get("name"), str)):
        rep.errors.append("lmprobe:model must be an object with a string 'name' (and a 'revision')")
    if "provenance" in raw and not isinstance(raw["provenance"], dict):
        rep.errors.append("lmprobe:provenance must be an object")
    if info.num_prompts != table.num_rows:
        rep.errors.append(f"num_prompts is {info.num_prompts} but the index has {table.num_rows} rows")


def _check_core_columns(table: pa.Table, rep: Report) -> np.ndarray | None:
    """The index's text, label and num_tokens columns; the prompts' lengths when they are stored."""
    if "text" not in table.column_names:
        rep.errors.append("index column 'text' is missing")
    elif not pa.types.is_string(table.column("text").type) and not pa.types.is_large_string(table.column("text").type):
        rep.errors.append(f"index column 'text' has type {table.column('text').type}, expected string")
    if "label" not in table.column_names:
        rep.errors.append("index column 'label' is missing")
    else:
        lt = table.column("label").type
        if not (pa.types.is_integer(lt) or pa.types.is_string(lt) or pa.types.is_large_string(lt) or pa.types.is_null(lt)):
            rep.errors.append(f"index column 'label' has type {lt}, expected int32 or string")
    lengths = None
    if "num_tokens" not in table.column_names:
        rep.errors.append("index column 'num_tokens' is missing")
    else:
        col = table.column("num_tokens")
        if col.null_count == len(col) and len(col):
            rep.warnings.append("num_tokens is null in every row (as lmprobe 0.10.3 wrote pooled datasets)")
        elif col.null_count:
            rep.errors.append(f"num_tokens has {col.null_count} null value(s)")
        else:
            lengths = _int_col(table, "num_tokens", rep)
            if lengths is not None and len(lengths) and lengths.min() < 1:
                rep.errors.append(f"num_tokens must be >= 1 (row {int(np.argmin(lengths))} has {lengths.min()})")
    return lengths


def _check_hidden(root: Path, table: pa.Table, info: DatasetInfo, present: set[str], lengths: np.ndarray | None,
                  shard_index: np.ndarray | None, row_offset: np.ndarray | None, rep: Report, checksums: bool) -> None:
    """The hidden states: their descriptor, every shard file of every hookpoint, and the rows the index points at."""
    h = info.hidden
    if h is None:
        rep.warnings.append("the dataset stores no hidden_layers tensors")
        return
    want = h.kind.row_bytes(h.dim)
    if h.row_bytes is not None and h.row_bytes != want:
        rep.errors.append(f"hidden_layers.row_bytes is {h.row_bytes}, expected {want} for {h.dim} {h.dtype} values"
                          + (" and a float32 scale" if h.kind.scaled else ""))
    if h.raw.get("layout", "per_layer") != "per_layer":
        rep.errors.append(f"hidden_layers.layout is {h.raw.get('layout')!r}; only 'per_layer' is defined")
    pulled = _pulled_layers(info, present) if rep.origin else None
    if pulled is not None:
        rep.held = pulled
        rep.not_pulled = {hp: [x for x in hd.layers if x not in pulled[hp]] for hp, hd in info.hookpoints.items()}
    _check_shard_files(root, info, present, pulled, rep, checksums)
    lts = h.last_token_shards
    if shard_index is not None and row_offset is not None:
        _check_coverage("shard_index/row_offset", shard_index, row_offset,
                        [h.shards[s]["num_prompts"] for s in range(lts)], rep)
    if h.storage == "full_sequence":
        for s in range(lts):
            if h.shards[s].get("num_tokens") != h.shards[s]["num_prompts"]:
                rep.errors.append(f"last-token shard {s}: num_tokens must equal num_prompts")
        _check_full_sequence(table, h, lengths, shard_index, row_offset, rep)


def _check_shard_files(root: Path, info: DatasetInfo, present: set[str], pulled: dict[str, list[int]] | None,
                       rep: Report, checksums: bool) -> None:
    """Every shard file of every hookpoint (hidden_layers, then the others) that this copy holds."""
    # a file not on disk costs a set lookup: metadata listing 100,000 layers is answered in seconds, and
    # past the first few, missing files are counted rather than listed one line each
    h = info.hidden
    unlisted = 0
    for hp, hd in info.hookpoints.items():  # hidden_layers, then every other hookpoint's descriptor
        for s in range(len(hd.shards)):
            rows = hd.shard_rows(s)
            files = hd.shards[s].get("files") or {}
            for layer in hd.layers:
                if pulled is not None and layer not in pulled[hp]:
                    continue  # left on the Hub by `lmprobe pull --layers`: listed, not an error
                try:
                    rel = hd.file(layer, s)
                except FormatError as exc:
                    rep.errors.append(str(exc))
                    continue
                if rel not in present and len(rep.errors) >= _LISTED_ERRORS:
                    unlisted += 1
                    continue
                want_tensors = {hd.key(layer): (hd.dtype, (rows, hd.dim))}
                if hd.kind.scaled:  # the per-row scales beside the codes
                    want_tensors[hd.scale_key(layer)] = (SCALE_DTYPE, (rows,))
                _check_file(root, rel, want_tensors, rep, files.get(str(layer)), checksums)
    if unlisted:
        rep.errors.append(f"... and {unlisted:,} more shard files listed in the metadata are missing "
                          f"({len(h.layers):,} layers listed)")


def _check_logits(root: Path, table: pa.Table, info: DatasetInfo, present: set[str], rep: Report,
                  checksums: bool) -> None:
    """The top-k logits: the index's pointers into them, and each shard's tensors."""
    lg = info.logits
    if lg is not None and rep.origin and not any(lg.file(i) in present for i in range(len(lg.shards))):
        rep.logits_not_pulled, lg = True, None  # `lmprobe pull --no-logits`
    if lg is not None:
        if "shard_index_logits" in table.column_names or "row_offset_logits" in table.column_names or lg.shards:
            ls = _int_col(table, "shard_index_logits", rep)
            lo = _int_col(table, "row_offset_logits", rep)
            if ls is not None and lo is not None:
                _check_coverage("shard_index_logits/row_offset_logits", ls, lo, [d["num_prompts"] for d in lg.shards], rep)
        index_sizes = set()
        for s, d in enumerate(lg.shards):
            rel = lg.file(s)
            try:
                path = resolve_inside(root, rel, "logits shard")
                keys = set(read_header(path).tensors) if path.is_file() else set()
            except FormatError as exc:
                rep.errors.append(str(exc))
                continue
            try:
                vk, ik = lg.keys_for(keys) if keys else ("topk_values", "topk_indices")
            except FormatError as exc:
                rep.errors.append(f"{rel}: {exc}")
                continue
            if vk != "topk_values":
                rep.warnings.append(f"{rel}: logits are keyed {vk!r}/{ik!r}; the document reads 'topk_values'/'topk_indices'")
            shape = (d["num_prompts"], lg.k)
            _check_file(root, rel, {vk: (lg.dtype, shape), ik: (None, shape)}, rep, d, checksums)
            if keys and ik in keys:
                ix = read_header(path).tensors[ik]
                if ix.dtype not in ("int32", "int64"):
                    rep.errors.append(f"{rel}: {ik!r} is {ix.dtype}, expected an integer dtype")
                index_sizes.add(DTYPES[ix.dtype].itemsize)
        if lg.row_bytes is not None and len(index_sizes) == 1:
            want = lg.k * (DTYPES[lg.dtype].itemsize + index_sizes.pop())
            if lg.row_bytes != want:
                rep.warnings.append(f"logits_topk.row_bytes is {lg.row_bytes}, but a stored row is {want} bytes")


def _check_statistics(root: Path, info: DatasetInfo, rep: Report, checksums: bool) -> None:
    """The statistics file: a count, a mean norm, a mean and a std per layer of each hookpoint."""
    st = info.statistics
    if st is not None:
        dim = info.hidden.dim if info.hidden else None
        keys = {}
        descs = [(st, dim)]
        for hp, hd in list(info.hookpoints.items())[1:]:
            try:
                descs.append((st.for_hookpoint(hp), hd.dim))
            except FormatError as exc:
                rep.warnings.append(str(exc))
        for d, dim in descs:
            for layer in d.layers:
                keys[d.key(layer, "count")] = ("int64", (1,))
                keys[d.key(layer, "mean_norm")] = ("float64", (1,))
                if dim:
                    keys[d.key(layer, "mean")] = ("float64", (dim,))
                    keys[d.key(layer, "std")] = ("float64", (dim,))
        _check_file(root, st.file, keys, rep, st.raw, checksums)


def _check_optional_columns(table: pa.Table, raw: dict[str, Any], lengths: np.ndarray | None, rep: Report) -> None:
    """The perplexity columns and the per-token lists (one value per token, or one fewer for perplexities)."""
    for name in ("perplexity_mean", "perplexity_min", "perplexity_max"):
        if name in table.column_names and not pa.types.is_floating(table.column(name).type):
            rep.errors.append(f"index column {name!r} has type {table.column(name).type}, expected float64")
    prov = raw.get("provenance")
    ours = isinstance(prov, dict) and prov.get("writer") == WRITER
    _check_lists(table, "token_ids", lengths, 0, rep, ours=ours)
    _check_lists(table, "token_strings", lengths, 0, rep, ours=ours)
    _check_lists(table, "token_perplexity", lengths, 1, rep, ours=ours)


def _check_folder(root: Path, rep: Report) -> None:
    """What lies in the folder beside the dataset: old sidecars, a staging folder, the card."""
    for sidecar in ("lmprobe_info.json", "_stage_complete"):
        if (root / sidecar).exists():
            rep.warnings.append(f"sidecar file {sidecar} is not part of the format (lmprobe 0.10.3 wrote it); readers ignore it")
    if (root / STAGING_DIR).exists():
        rep.warnings.append(f"{STAGING_DIR}/ is left over from writing; it is safe to delete")
    if not (root / CARD_PATH).exists():
        rep.warnings.append("README.md (the dataset card) is missing")


def _pulled_layers(info: DatasetInfo, present: set[str]) -> dict[str, list[int]]:
    """Per hookpoint, the layers of a pulled copy that it holds: those with any shard file here. The others
    were left on the Hub (``lmprobe pull --layers``); a layer with some of its files here must have them all."""
    def here(hd, layer: int) -> bool:
        try:
            return any(hd.file(layer, s) in present for s in range(len(hd.shards)))
        except FormatError:
            return True  # checked (and reported) with the files

    return {hp: [layer for layer in hd.layers if here(hd, layer)] for hp, hd in info.hookpoints.items()}


def _check_full_sequence(table: pa.Table, h, lengths, shard_index, row_offset, rep: Report) -> None:
    lts = h.last_token_shards
    for name in ("token_offset", "token_shard_ids", "token_shard_offsets"):
        if name not in table.column_names:
            rep.errors.append(f"full_sequence dataset: index column {name!r} is missing")
            return
    ids_col, offs_col = table.column("token_shard_ids"), table.column("token_shard_offsets")
    n_ids = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False)
    n_offs = pc.list_value_length(offs_col).to_numpy(zero_copy_only=False)
    if not np.array_equal(n_ids, n_offs):
        rep.errors.append("token_shard_ids and token_shard_offsets differ in length")
        return
    if lengths is not None and not np.array_equal(n_ids, lengths):
        i = int(np.flatnonzero(n_ids != lengths)[0])
        rep.errors.append(f"row {i}: {n_ids[i]} token addresses for num_tokens={lengths[i]}")
        return
    token_offset = table.column("token_offset").to_numpy(zero_copy_only=False)
    if row_offset is not None and not np.array_equal(token_offset, row_offset):
        rep.errors.append("token_offset must equal row_offset in every row")
    ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    offs = pc.list_flatten(offs_col).to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.cumsum(n_ids) - 1
    if len(ends) and (n_ids.min() < 1):
        rep.errors.append("every prompt needs at least one token address")
        return
    if shard_index is not None and row_offset is not None and len(ends):
        bad = np.flatnonzero((ids[ends] != shard_index) | (offs[ends] != row_offset))
        if len(bad):
            rep.errors.append(
                f"row {int(bad[0])}: the last token address must equal (shard_index, row_offset) ({len(bad)} row(s))"
            )
    is_last = np.zeros(len(ids), dtype=bool)
    is_last[ends] = True
    seq_sizes = [h.shards[s]["num_tokens"] for s in h.sequence_shards]
    _check_coverage("token_shard_ids/token_shard_offsets (sequence tokens)", ids[~is_last], offs[~is_last],
                    seq_sizes, rep, first_shard=lts)
