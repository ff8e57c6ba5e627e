"""Export to the saev sharded activation protocol 2.0 (and saev's 2.1), and read it back (docs/saev.md).

    <dump_to>/<HASH>/metadata.json  shards.json  acts000000.bin ...  [labels.bin]  [tokens.bin]

An example is a window of ``context_len`` (T) consecutive tokens. The prompts of a full_sequence
lmprobe dataset are concatenated in index order (optionally without each prompt's first token),
cut into windows of T tokens, and the final partial window is dropped. Each shard holds
(n_ex, L, T, D) float32, C order, little-endian. HASH is the sha256 of the canonical JSON of
metadata.json, so identical configurations share a folder and different ones never collide.

``saev_compat`` writes what saev's own loaders read instead: "2.0" for saev e43e7dd (the protocol
document's keys plus ``pixel_agg: null``), "2.1" for saev 3d73f1f (renamed keys, ``n_examples`` in
shards.json, ``data`` a string, and HASH the first 8 hex digits of sha256 over the metadata's JSON
in field order). Both hash the metadata the way that saev commit does, so saev's
``Metadata.hash`` equals the folder name. lmprobe reads all three layouts.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from .atomic import atomic_output, atomic_write, move_into_place
from .errors import SaevError, UnsafePathError
from .format.reader import Dataset
from .format.spec import DTYPES
from .format.values import bfloat16_bits_to_float32
from .lock import OutputLock
from .opening import load
from .paths import check_output_path, resolve_inside
from .safeio import check_regular, read_json
from .storage.hub import HubFiles, parse_hf_url
from .stream import Engine, RowSource, rank_world
from .units import parse_size

PROTOCOL = "2.0"
#: source shard files an export keeps open at once (runs follow the source's order, so few are needed)
_OPEN_SOURCES = 16
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
_CHUNK_BYTES = 64 * 2**20


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


def read_saev_metadata(folder: str | os.PathLike) -> dict:
    """A saev folder's metadata.json under the protocol 2.0 key names (2.1 folders' keys renamed)."""
    return canonical_metadata(read_json(_file_inside(Path(folder), "metadata.json"), error=SaevError))


def ex_per_shard(patches_per_shard: int, tokens_per_ex: int, n_layers: int) -> int:
    """Section 3: floor(patches_per_shard / (tokens_per_ex * len(layers)))."""
    return patches_per_shard // (tokens_per_ex * n_layers)


def shard_sizes(n_ex: int, per_shard: int) -> list[int]:
    """Examples per shard: full shards, then the remainder; never a shard of zero examples."""
    if per_shard < 1:
        raise SaevError("patches_per_shard is smaller than one example (context_len x layers)")
    full, rest = divmod(n_ex, per_shard)
    return [per_shard] * full + ([rest] if rest else [])



@dataclass
class _Plan:
    metadata: dict
    hash: str
    shard_sizes: list[int]
    per_shard: int  # examples in a full shard (section 3's ex_per_shard)
    prompt_of: np.ndarray  # (n_ex * T,) index row of each stored position
    token_in_prompt: np.ndarray  # (n_ex * T,) token index within that prompt

    @property
    def n_ex(self) -> int:
        return canonical_metadata(self.metadata)["n_ex"]


def _plan(ds: Any, source_desc: str, *, layers: list[int], context_len: int, patches_per_shard: int,
          drop_first_token: bool, with_tokens: bool, index_sha256: str, saev_compat: str | None,
          hookpoint: str | None = None) -> _Plan:
    if ds.storage != "full_sequence":
        raise SaevError(
            f"{source_desc} stores only the last token of each prompt (pooled); the saev protocol needs token "
            "sequences: extract with --storage full_sequence"
        )
    bad = [x for x in layers if x not in ds.layers]
    if bad:
        raise SaevError(f"layers {bad} are not in {source_desc} (it stores {ds.layers})")
    if hookpoint is not None and hookpoint not in ds.hookpoints:
        raise SaevError(f"hookpoint {hookpoint!r} is not in {source_desc} (it stores {ds.hookpoints})")
    h = ds.hidden_desc(hookpoint)
    if context_len < 1:
        raise SaevError("context_len must be >= 1")
    per = ex_per_shard(patches_per_shard, context_len, len(layers))
    if per < 1:
        raise SaevError(
            f"--patches-per-shard {patches_per_shard} is smaller than one example ({context_len} tokens x "
            f"{len(layers)} layers = {context_len * len(layers)}); raise it or use fewer layers / a shorter context"
        )
    lengths = ds.token_lengths()
    start = 1 if drop_first_token else 0
    kept = np.maximum(lengths - start, 0)
    total = int(kept.sum())
    n_ex = total // context_len
    if n_ex == 0:
        raise SaevError(f"{source_desc} holds {total} usable tokens, fewer than one window of {context_len}")
    n_pos = n_ex * context_len
    prompt_of = np.repeat(np.arange(len(lengths)), kept)[:n_pos]
    first = np.concatenate([[0], np.cumsum(kept)[:-1]])
    token_in_prompt = (np.arange(n_pos) - first[prompt_of]) + start
    info = ds.info
    model = info.get("model") or {}
    ckpt = model.get("name") or "unknown"
    if model.get("revision"):
        ckpt = f"{ckpt}@{model['revision']}"
    data = {
        "__class__": "LmprobeTokenWindows",
        "source": source_desc,
        "source_index_sha256": index_sha256,
        "num_prompts": int(len(lengths)),
        "context_len": int(context_len),
        "packing": "concatenate",
        "drop_first_token": bool(drop_first_token),
        "dropped_tail_tokens": int(total - n_pos),
        "source_dtype": ds.dtype,
        **({"hookpoint": hookpoint} if hookpoint not in (None, ds.hookpoints[0]) else {}),
        "tokens_file": "tokens.bin" if with_tokens else None,
    }
    labels_ok = _int_labels(ds) is not None
    data["labels_file"] = "labels.bin" if labels_ok else None
    if saev_compat:
        # saev's Metadata type admits vision families only; its loaders never read the family
        data["source_family"] = FAMILY
        data["last_shard_padded"] = True
        data["saev_compat"] = SAEV_CHECKED[saev_compat]
    metadata = {
        "family": SAEV_COMPAT_FAMILY if saev_compat else FAMILY,
        "ckpt": ckpt,
        "layers": [int(x) for x in layers],
        "patches_per_ex": int(context_len),
        "cls_token": False,
        "d_model": int(h.dim),
        "n_ex": int(n_ex),
        "patches_per_shard": int(patches_per_shard),
        "data": data,
        "dataset": source_desc,
        "dtype": "float32",
        "protocol": PROTOCOL,
    }
    if saev_compat:
        # saev's Metadata.load turns `dataset` into a Path and hashes str(Path): write it as that string
        metadata["dataset"] = str(PurePath(source_desc))
    if saev_compat == "2.0":
        # e43e7dd's Metadata has a pixel_agg field defaulting to None, and hashes it
        metadata = {**{k: v for k, v in metadata.items() if k not in ("dtype", "protocol")}, "pixel_agg": None,
                    "dtype": "float32", "protocol": PROTOCOL}
    elif saev_compat == "2.1":
        metadata = metadata_21(metadata)
    return _Plan(metadata, metadata_hash(metadata), shard_sizes(n_ex, per), per, prompt_of, token_in_prompt)


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


def _int_labels(ds: Any) -> np.ndarray | None:
    labels = ds.labels
    if labels is None or labels.dtype == object or labels.dtype.kind not in "iu":
        return None
    if labels.min() < 0 or labels.max() > 255:
        return None
    return labels.astype(np.uint8)


def export_saev(
    source: Any,
    out: str | os.PathLike,
    *,
    layers: Sequence[int] | None = None,
    context_len: int = 128,
    patches_per_shard: int = DEFAULT_PATCHES_PER_SHARD,
    drop_first_token: bool = False,
    tokens: bool | None = None,
    saev_compat: bool | str = False,
    hookpoint: str | None = None,
    quiet: bool = False,
) -> Path:
    """Export a full_sequence lmprobe dataset (path, repo id or Dataset) to ``out/<HASH>/``; returns that folder.

    >>> export_saev("out/acts", "saev-dumps", layers=[6], context_len=64)  # doctest: +SKIP

    ``tokens``: write tokens.bin (an lmprobe addition: the token id of every position). None: when
    the source stores token ids; True: required; False: never.

    ``saev_compat``: write what saev's own loaders accept (checked against ``SAEV_CHECKED``): "2.0"
    (or True) for saev e43e7dd, "2.1" for saev 3d73f1f (renamed keys, ``n_examples``, an 8-digit
    HASH; see ``metadata_21``). Both zero-pad the last shard to the full shard size (shards.json
    keeps its true count), set ``family`` to a value saev's metadata type admits (``"clip"``; the
    true family is kept in ``data.source_family``) and hash the metadata as that saev does. saev's
    loaders also require the folder at ``.../saev/shards/<HASH>``, so ``out`` must end in ``saev/shards``.

    ``hookpoint``: which stored hookpoint to export (default: what ``hidden_layers`` holds).

    A folder that already exists for the same configuration is verified and kept (a no-op). An
    interrupted export resumes: finished shards are kept and the rest are written.
    """
    saev_compat = compat_mode(saev_compat)
    ds = source if isinstance(source, Dataset) else load(source)
    source_desc = ds.source if not isinstance(source, (str, os.PathLike)) else str(source)
    if isinstance(source, (str, os.PathLike)) and Path(source).exists():
        source_desc = str(Path(source).resolve())
    layer_list = list(ds.layers) if layers is None else [int(x) for x in layers]
    if not layer_list:
        raise SaevError("no layers to export")
    out = Path(out)
    if saev_compat and out.parts[-2:] != ("saev", "shards"):
        raise SaevError(f"saev's loaders open folders at .../saev/shards/<HASH> only; pass an --out that ends in "
                        f"saev/shards (e.g. {out / 'saev' / 'shards'})")
    has_ids = "token_ids" in ds.column_names
    if tokens and not has_ids:
        raise SaevError(f"{source_desc} has no token_ids column, so tokens.bin cannot be written: extract with "
                        "--token-ids, or leave tokens.bin out (--no-tokens)")
    with_tokens = has_ids if tokens is None else bool(tokens)
    if tokens is None and not has_ids and not quiet:
        print(f"note: {source_desc} stores no token ids, so tokens.bin is not written (extract with --token-ids "
              "to have it)", file=sys.stderr)
    plan = _plan(ds, source_desc, layers=layer_list, context_len=context_len, patches_per_shard=patches_per_shard,
                 drop_first_token=drop_first_token, with_tokens=with_tokens, index_sha256=_index_hash(ds),
                 saev_compat=saev_compat, hookpoint=hookpoint)
    final = out / plan.hash
    check_output_path(out, "export folder")
    with OutputLock(out):
        return _export(ds, plan, out, final, layer_list, context_len, with_tokens, saev_compat, quiet, hookpoint)


def _export(ds: Any, plan: _Plan, out: Path, final: Path, layer_list: list[int], context_len: int, with_tokens: bool,
            saev_compat: str | None, quiet: bool, hookpoint: str | None = None) -> Path:
    if (final / "metadata.json").exists():
        problems = validate_saev(final)
        if problems:
            raise SaevError(f"{final} exists but does not validate ({'; '.join(problems)}); delete it and re-run")
        if not quiet:
            print(f"{final} already holds this export; nothing to do")
        return final
    h = ds.hidden_desc(hookpoint)
    T, L, D = context_len, len(layer_list), h.dim
    vec_bytes = D * 4
    import pyarrow.compute as pc

    flat_ids, flat_offs, list_lengths = ds.token_addresses()
    list_start = np.concatenate([[0], np.cumsum(list_lengths)[:-1]]).astype(np.int64)
    src_pos = list_start[plan.prompt_of] + plan.token_in_prompt
    shard_of, offset_of = flat_ids[src_pos], flat_offs[src_pos]
    del flat_ids, flat_offs, src_pos
    # the index's addresses are untrusted: rows are copied straight out of the shard files
    ds.check_addresses(shard_of, offset_of, h.shard_rows, len(h.shards))
    if with_tokens:  # checked before any byte is written: the lists must hold num_tokens ids per prompt
        ids = ds.token_columns(["token_ids"])["token_ids"]
        ds.check_token_counts(pc.list_value_length(ids).to_numpy(zero_copy_only=False), None, "token ids")
        tok = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
        del ids
    partial = out / f".{plan.hash}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    n_pos = plan.n_ex * T
    # runs of stored positions that are consecutive rows of one source shard, cut at example boundaries:
    # each run is one memcpy out of a memory-mapped source shard
    cut = np.zeros(n_pos, dtype=bool)
    cut[0] = True
    cut[1:] = (np.diff(shard_of) != 0) | (np.diff(offset_of) != 1)
    cut[::T] = True
    run_start = np.flatnonzero(cut)
    run_len = np.diff(np.append(run_start, n_pos))
    run_shard, run_off = shard_of[run_start], offset_of[run_start]
    del cut, shard_of, offset_of
    maps: dict[tuple[int, int], np.ndarray] = {}
    fds: dict[tuple[int, int], tuple[int, int]] = {}  # float32 sources: (fd, data start), read with preadv

    def source(layer: int, shard: int) -> np.ndarray:
        if (layer, shard) not in maps:
            while len(maps) >= _OPEN_SOURCES:
                maps.pop(next(iter(maps)))
            path, entry = ds.hidden_shard(layer, shard, hookpoint)
            maps[(layer, shard)] = np.memmap(path, dtype=DTYPES[h.dtype].np_storage, mode="r", offset=entry.start,
                                             shape=entry.shape)
        return maps[(layer, shard)]

    def source_fd(layer: int, shard: int) -> tuple[int, int]:
        if (layer, shard) not in fds:
            # a few source files open at a time: a remote source read through a bounded cache (--cache)
            # frees a deleted file's disk space only once it is closed
            while len(fds) >= _OPEN_SOURCES:
                os.close(fds.pop(next(iter(fds)))[0])
            path, entry = ds.hidden_shard(layer, shard, hookpoint)
            fds[(layer, shard)] = (os.open(path, os.O_RDONLY), entry.start)
        return fds[(layer, shard)]

    # float32 and bfloat16 runs are read with one preadv each straight into the block (bfloat16 into a
    # block of raw bits, converted in one pass per chunk); other dtypes are copied out of memory maps
    direct = h.dtype in ("float32", "bfloat16") and hasattr(os, "preadv")


    ex_chunk = max(1, _CHUNK_BYTES // (L * T * vec_bytes))
    from tqdm.auto import tqdm

    bar = tqdm(total=plan.n_ex, unit="ex", desc="export-saev", disable=quiet)
    shards_json = []
    shape = (min(ex_chunk, max(plan.shard_sizes)), L, T, D)
    # two blocks: one is filled while the other is converted and written on the writer thread
    blocks = [(np.empty(shape, dtype="<f4"), np.empty(shape, dtype=np.uint16) if direct and h.dtype == "bfloat16"
               else None) for _ in range(2)]
    try:
        _write_shards(plan, partial, L, T, D, ex_chunk, blocks, run_start, run_len, run_shard, run_off,
                      layer_list, source, source_fd, direct, h, bar, shards_json, pad_to=plan.per_shard
                      if saev_compat else None)
    finally:
        bar.close()
        for fd, _ in fds.values():
            os.close(fd)
    maps.clear()
    if with_tokens:
        atomic_write(partial / "tokens.bin", np.ascontiguousarray(tok[list_start[plan.prompt_of] + plan.token_in_prompt],
                                                                  dtype="<u4").tobytes())
    labels = _int_labels(ds)
    if labels is not None:
        atomic_write(partial / "labels.bin", labels[plan.prompt_of][:n_pos].tobytes())
    if saev_compat == "2.1":
        shards_json = [{"name": sh["name"], "n_examples": sh["n_ex"]} for sh in shards_json]
    atomic_write(partial / "shards.json", json.dumps(shards_json, indent=2) + "\n")
    atomic_write(partial / "metadata.json", json.dumps(plan.metadata, indent=2) + "\n")  # last
    move_into_place(partial, final)
    if not quiet:
        print(f"wrote {plan.n_ex} examples x {L} layers x {T} tokens x {D} dims "
              f"in {len(shards_json)} shard(s) to {final}")
    return final


def _write_shards(plan, partial, L, T, D, ex_chunk, blocks, run_start, run_len, run_shard, run_off,
                  layer_list, source, source_fd, direct, h, bar, shards_json, pad_to: int | None) -> None:
    """Write every shard not finished by an earlier run: acts*.bin.tmp, then renamed.

    ``blocks``: two (float32 block, raw bits or None) pairs. A chunk is read into one while the
    other is converted (a bfloat16 source read directly: its raw bits, once per chunk) and written
    on the writer thread, so reading overlaps writing. ``pad_to``: zero-pad each shard to this many
    examples (saev's loaders map every shard at full size).
    """
    vec_bytes = D * 4
    src_bytes = D * DTYPES[h.dtype].itemsize
    first_ex = 0
    with ThreadPoolExecutor(1, thread_name_prefix="lmprobe-saev-writer") as writer:
        for i, n in enumerate(plan.shard_sizes):
            name = f"acts{i:06d}.bin"
            shards_json.append({"name": name, "n_ex": n})
            path = partial / name
            file_ex = max(n, pad_to or 0)
            if path.exists() and path.stat().st_size == file_ex * L * T * vec_bytes:
                first_ex += n
                bar.update(n)
                continue  # finished by an earlier, interrupted run
            writes: list[Future | None] = [None, None]
            with atomic_output(path) as tmp, open(tmp, "wb") as f:
                try:
                    for k, a in enumerate(range(first_ex, first_ex + n, ex_chunk)):
                        b = min(first_ex + n, a + ex_chunk)
                        if writes[k % 2] is not None:
                            writes[k % 2].result()  # this block's last chunk is on disk: fill it again
                        block, bits = blocks[k % 2]
                        dst_block = block if bits is None else bits
                        r0, r1 = np.searchsorted(run_start, [a * T, b * T])
                        for li, layer in enumerate(layer_list):
                            for r in range(r0, r1):
                                pos, m = int(run_start[r]), int(run_len[r])
                                e, t = divmod(pos, T)
                                if direct:  # one read from the source file straight into the output block
                                    fd, base = source_fd(layer, int(run_shard[r]))
                                    dst = memoryview(dst_block[e - a, li, t : t + m]).cast("B")
                                    if os.preadv(fd, [dst], base + int(run_off[r]) * src_bytes) != len(dst):
                                        raise SaevError(f"{h.file(layer, int(run_shard[r]))} ended early; is the "
                                                        "source complete?")
                                    continue
                                rows = source(layer, int(run_shard[r]))[run_off[r] : run_off[r] + m]
                                block[e - a, li, t : t + m] = (bfloat16_bits_to_float32(rows) if h.dtype == "bfloat16"
                                                               else rows)
                        writes[k % 2] = writer.submit(_convert_and_write, f, block, bits, b - a)
                        bar.update(b - a)
                finally:  # the file stays open until its writes are done, error or not
                    failing = sys.exc_info()[0] is not None
                    for w in writes:
                        if w is not None and failing:
                            w.exception()  # waited for; the error already raised is the one to report
                        elif w is not None:
                            w.result()
                if file_ex > n:
                    f.truncate((file_ex * L * T) * vec_bytes)  # zeros: rows past n_ex are never read
            first_ex += n


def _convert_and_write(f: Any, block: np.ndarray, bits: np.ndarray | None, n: int) -> None:
    """The writer thread's part of a chunk: convert its bfloat16 bits (if any), append its bytes to ``f``."""
    if bits is not None:
        bfloat16_bits_to_float32(bits[:n], out=block[:n])
    f.write(memoryview(block[:n]).cast("B"))


def _index_hash(ds: Any) -> str:
    """Identifies the source data: its tensor descriptors (with per-file sha256 when recorded) and texts."""
    h = hashlib.sha256()
    h.update(json.dumps(ds.info.get("tensors"), sort_keys=True).encode())
    for t in ds.texts:
        h.update(t.encode() + b"\0")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- reader


class SaevDataset:
    """A saev folder (``<dump_to>/<HASH>``): random access and shuffled batches over memory-mapped shards.

    >>> sv = SaevDataset("saev-dumps/0f3a...")          # doctest: +SKIP
    >>> sv.get(12, layer=6, token=3).shape              # doctest: +SKIP
    (1024,)
    """

    def __init__(self, path: str | os.PathLike, *, verify_hash: bool = True, token: str | None = None):
        self._hub: HubFiles | None = None
        if isinstance(path, str) and path.startswith("hf://"):
            # a folder in a Hub repo: metadata now, each shard on first use (into the HF cache)
            self._hub = HubFiles(parse_hf_url(path), token=token)
            meta = self._hub.fetch("metadata.json", what="saev metadata")
            self._hub.fetch("shards.json", what="saev shard list")
            path = meta.parent
        self.path = Path(path)
        problems = validate_saev(self.path, check_hash=verify_hash, check_sizes=self._hub is None,
                                 local=self._hub is None)
        if problems:
            raise SaevError(f"{self.path}: " + "; ".join(problems))
        # protocol 2.1 folders are read under the 2.0 names (n_examples -> n_ex, ...)
        self.metadata = canonical_metadata(read_json(self._local("metadata.json"), error=SaevError))
        self.shards = [canonical_metadata(sh) for sh in read_json(self._local("shards.json"), error=SaevError)]
        m = self.metadata
        self.layers: list[int] = list(m["layers"])
        self.tokens_per_ex = m["patches_per_ex"] + (1 if m["cls_token"] else 0)
        self.d_model = m["d_model"]
        self.n_ex = m["n_ex"]
        self.ex_per_shard = ex_per_shard(m["patches_per_shard"], self.tokens_per_ex, len(self.layers))
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self.n_ex

    def _local(self, name: str) -> Path:
        return _file_inside(self.path, name) if self._hub is None else self.path / name

    def _file(self, name: str, *, required: bool = True) -> Path | None:
        """Local path of a file of this folder; from the Hub, downloaded now."""
        if self._hub is None:
            p = _file_inside(self.path, name)
            return p if p.exists() or required else None
        if not required and name not in self._hub.repo_files:
            return None
        try:
            return self._hub.fetch(name, what="saev file")
        except FileNotFoundError:
            raise SaevError(f"{name} is missing from {self._hub}") from None

    def shard(self, i: int) -> np.memmap:
        """Shard ``i`` as a read-only (n_ex, L, T, D) float32 memory map."""
        if i not in self._maps:
            n = self.shards[i]["n_ex"]
            path = self._file(self.shards[i]["name"])
            ex_bytes = len(self.layers) * self.tokens_per_ex * self.d_model * 4
            if path.stat().st_size not in _shard_bytes(n, self.ex_per_shard, i == len(self.shards) - 1, ex_bytes):
                raise SaevError(f"{path} is {path.stat().st_size} bytes, expected {n * ex_bytes}")
            self._maps[i] = np.memmap(path, dtype="<f4", mode="r",
                                      shape=(n, len(self.layers), self.tokens_per_ex, self.d_model))
        return self._maps[i]

    def layer_index(self, layer: int) -> int:
        if layer not in self.layers:
            raise SaevError(f"layer {layer} is not recorded in {self.path} (layers {self.layers})")
        return self.layers.index(layer)

    def locate(self, ex: int, layer: int, token: int) -> tuple[Path, int]:
        """Section 4.2: (shard file, byte offset) of the vector at (example, layer, token)."""
        if not 0 <= ex < self.n_ex:
            raise IndexError(f"example {ex} is outside 0..{self.n_ex - 1}")
        if not 0 <= token < self.tokens_per_ex:
            raise IndexError(f"token {token} is outside 0..{self.tokens_per_ex - 1}")
        li = self.layer_index(layer)
        shard_idx, ex_in_shard = divmod(ex, self.ex_per_shard)
        L, T = len(self.layers), self.tokens_per_ex
        offset_vectors = ex_in_shard * L * T + li * T + token
        return self.path / f"acts{shard_idx:06d}.bin", offset_vectors * self.d_model * 4

    def get(self, ex: int, layer: int, token: int) -> np.ndarray:
        """The (d_model,) vector at (example, layer, token), from the shard's memory map."""
        self.locate(ex, layer, token)  # checks the coordinate
        shard_idx, ex_in_shard = divmod(ex, self.ex_per_shard)
        return np.array(self.shard(shard_idx)[ex_in_shard, self.layer_index(layer), token])

    def tokens(self) -> np.ndarray | None:
        p = self._file("tokens.bin", required=False)
        return np.memmap(p, dtype="<u4", mode="r", shape=(self.n_ex, self.tokens_per_ex)) if p else None

    def labels(self) -> np.ndarray | None:
        p = self._file("labels.bin", required=False)
        return np.memmap(p, dtype="u1", mode="r", shape=(self.n_ex, self.tokens_per_ex)) if p else None

    def batches(self, layer: int, batch_size: int, *, seed: int = 0, shuffle: bool = True, memory: int | str = "1GiB",
                drop_last: bool = False, worker: tuple[int, int] = (0, 1), rank: int | None = None,
                world_size: int | None = None, epoch: int = 0) -> Iterator[np.ndarray]:
        """Yield (batch_size, d_model) float32 batches of one layer's token vectors, globally shuffled.

        The same training reader as ``lmprobe.stream.ShardStream`` (docs/training.md): blocks of
        consecutive vectors from all over the folder, read a memory budget's worth at a time and
        shuffled together, so a batch mixes like a uniform sample. Each vector appears once per
        pass; ``rank``/``world_size`` and ``worker=(i, n)`` split a pass without overlap.
        """
        li = self.layer_index(layer)
        r, w = rank_world(rank, world_size)
        engine = Engine(_SaevRows(self, li), batch_size, seed=seed, shuffle=shuffle, rank=r, world=w,
                        memory=parse_size(memory), drop_last=drop_last)
        for batch in engine.iterate(epoch, worker):
            yield batch[:, 0]

    def torch_dataset(self, layer: int, batch_size: int, **kwargs: Any):
        """A torch IterableDataset of (batch_size, d_model) tensors; splits runs across DataLoader workers.

        Use ``DataLoader(ds, batch_size=None, num_workers=N)``; ``set_epoch(epoch)`` reshuffles.
        """
        import torch

        parent = self

        class _Iterable(torch.utils.data.IterableDataset):
            def __init__(self):
                self.epoch = 0

            def set_epoch(self, epoch: int) -> None:
                self.epoch = epoch

            def __iter__(self):
                info = torch.utils.data.get_worker_info()
                worker = (info.id, info.num_workers) if info else (0, 1)
                for batch in parent.batches(layer, batch_size, worker=worker, epoch=self.epoch, **kwargs):
                    yield torch.from_numpy(batch)

        return _Iterable()


def validate_saev(path: str | os.PathLike, *, check_hash: bool = True, check_sizes: bool = True,
                  local: bool = True) -> list[str]:
    """Every problem of a saev folder against the protocol (empty list: valid).

    ``local=False``: the folder is a Hugging Face cache snapshot, whose files link into the cache.
    """
    p = Path(path)

    def _inside(folder: Path, name: str) -> Path:
        return _file_inside(folder, name) if local else folder / name

    problems: list[str] = []
    try:
        m = read_json(_inside(p, "metadata.json"), what="metadata.json", error=SaevError)
    except SaevError as exc:
        return [str(exc)]
    if not isinstance(m, dict):
        return ["metadata.json must hold an object"]
    v21 = m.get("protocol") == "2.1"
    keys = set(m)
    # saev e43e7dd writes pixel_agg (null, or a label aggregation) beside the protocol document's keys
    allowed = [set(METADATA_KEYS_21)] if v21 else [set(METADATA_KEYS), {*METADATA_KEYS, "pixel_agg"}]
    if keys not in allowed:
        missing, extra = sorted(allowed[0] - keys), sorted(keys - allowed[-1])
        problems.append(f"metadata.json keys differ from the protocol's (missing {missing}, extra {extra})")
    if "pixel_agg" in m and m["pixel_agg"] not in (PIXEL_AGG_21 if v21 else (None, *PIXEL_AGG_21)):
        problems.append(f"metadata.json pixel_agg {m['pixel_agg']!r} is not one of {list(PIXEL_AGG_21)}")
    hash_name = metadata_hash(m)
    m = canonical_metadata(m)
    types = {"family": str, "ckpt": str, "layers": list, "patches_per_ex": int, "cls_token": bool, "d_model": int,
             "n_ex": int, "patches_per_shard": int, "data": str if v21 else dict, "dataset": str, "dtype": str,
             "protocol": str}
    bad_types = [f"metadata.json {k!r} must be a {t.__name__}" for k, t in types.items()
                 if k in m and (not isinstance(m[k], t) or (t is int and isinstance(m[k], bool)))]
    if bad_types or not set(types) <= set(m):
        return problems + bad_types  # the checks below need every key, well typed
    if m["protocol"].split(".")[0] != PROTOCOL.split(".")[0]:
        problems.append(f"protocol {m['protocol']!r} is not {PROTOCOL} (a different major version)")
    if m["dtype"] != "float32":
        problems.append(f"dtype {m['dtype']!r}: the protocol fixes float32")
    if check_hash and p.name != hash_name:
        problems.append(f"folder name {p.name} is not the sha256 of metadata.json ({hash_name})")
    if not m["layers"] or not all(isinstance(x, int) and not isinstance(x, bool) for x in m["layers"]):
        problems.append("layers must be a non-empty list of integers")
        return problems
    small = [k for k in ("patches_per_ex", "d_model", "patches_per_shard") if m[k] < 1] + (["n_ex"] if m["n_ex"] < 0
                                                                                         else [])
    if small:
        return problems + [f"metadata.json {k!r} is {m[k]}, which no folder can have" for k in small]
    T = m["patches_per_ex"] + (1 if m["cls_token"] else 0)
    L, D = len(m["layers"]), m["d_model"]
    try:
        shards = read_json(_inside(p, "shards.json"), what="shards.json", error=SaevError)
    except SaevError as exc:
        return problems + [str(exc)]
    count = "n_examples" if v21 else "n_ex"
    if not isinstance(shards, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str)
                                               and isinstance(s.get(count), int) for s in shards):
        return problems + [f"shards.json must be a list of {{name, {count}}}"]
    shards = [canonical_metadata(s) for s in shards]
    per = ex_per_shard(m["patches_per_shard"], T, L)
    try:
        want = shard_sizes(m["n_ex"], per)
    except SaevError as exc:
        return problems + [str(exc)]
    got = [s["n_ex"] for s in shards]
    if got != want:
        problems.append(f"shards.json n_ex {got} differ from the protocol's sizing {want}")
    for i, s in enumerate(shards):
        if s["name"] != f"acts{i:06d}.bin":
            problems.append(f"shard {i} is named {s['name']!r}, expected acts{i:06d}.bin")
            continue
        try:
            f = _inside(p, s["name"])
        except SaevError as exc:
            problems.append(str(exc))
            continue
        if not f.exists():
            if check_sizes:  # a folder read from the Hub downloads its shards later
                problems.append(f"{s['name']} is missing")
        elif check_sizes and f.stat().st_size not in _shard_bytes(s["n_ex"], per, i == len(shards) - 1, L * T * D * 4):
            problems.append(f"{s['name']} is {f.stat().st_size} bytes, expected {s['n_ex'] * L * T * D * 4}")
    for name, item in (("labels.bin", 1), ("tokens.bin", 4)):
        try:
            f = _inside(p, name)
        except SaevError as exc:
            problems.append(str(exc))
            continue
        if f.exists() and f.stat().st_size != m["n_ex"] * T * item:
            problems.append(f"{name} is {f.stat().st_size} bytes, expected {m['n_ex'] * T * item}")
    return problems


def _shard_bytes(n_ex: int, per: int, last: bool, ex_bytes: int) -> tuple[int, ...]:
    """Sizes a shard file may have: its examples, or (the last one) zero-padded to a full shard, as saev writes it."""
    return (n_ex * ex_bytes, per * ex_bytes) if last else (n_ex * ex_bytes,)


def _file_inside(folder: Path, name: str) -> Path:
    """A file of a saev folder: inside it (symlinks included) and, when present, a regular file."""
    try:
        f = resolve_inside(folder, name, "saev file")
        return check_regular(f, "saev file") if f.exists() else f
    except UnsafePathError as exc:
        raise SaevError(str(exc)) from None


def is_saev_folder(path: str | os.PathLike) -> bool:
    """A folder holding metadata.json and shards.json (and no lmprobe index) is judged as a saev folder."""
    p = Path(path)
    return (p / "metadata.json").exists() and (p / "shards.json").exists() and not (p / "index").is_dir()




class _SaevRows(RowSource):
    """One layer of a saev folder as rows for the training reader: example after example, token after token."""

    def __init__(self, sv: SaevDataset, li: int):
        self.sv, self.li = sv, li
        self.T = sv.tokens_per_ex
        self.shard_rows = [sh["n_ex"] * self.T for sh in sv.shards]
        self.n_sites, self.dim = 1, sv.d_model

    def prepare(self, shards) -> None:
        for s in shards:
            self.sv.shard(s)  # downloaded (from the Hub) and size-checked here, on the reader's thread

    def read_rows(self, shard: int, rows: np.ndarray, site: int, out: np.ndarray) -> None:
        mm = self.sv.shard(shard)  # (n_ex, L, T, D)
        ex, tok = np.divmod(rows, self.T)
        flat = (ex * mm.shape[1] + self.li) * self.T + tok  # the row in the shard's (n_ex * L * T, D) view
        np.take(mm.reshape(-1, self.dim), flat, axis=0, out=out, mode="clip")  # one gather, no buffered copy
