"""``lmprobe export-saev``: a full_sequence dataset as saev shards, written in chunks while the next is read."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from ..base.atomic import atomic_output, atomic_write, move_into_place
from ..base.lock import OutputLock
from ..base.paths import check_output_path
from ..base.progress import Progress
from ..base.units import plural
from ..base.worker import settle
from ..errors import SaevError
from ..format.reader import Dataset
from ..format.values import bfloat16_to_float32_later
from ..opening import load
from .protocol import (
    DEFAULT_PATCHES_PER_SHARD,
    FAMILY,
    PROTOCOL,
    SAEV_CHECKED,
    SAEV_COMPAT_FAMILY,
    canonical_metadata,
    compat_mode,
    ex_per_shard,
    metadata_21,
    metadata_hash,
    shard_sizes,
)
from .reader import validate_saev

logger = logging.getLogger(__name__)

#: source shard files an export keeps open at once (runs follow the source's order, so few are needed)
_OPEN_SOURCES = 16
_CHUNK_BYTES = 64 * 2**20


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
    # default: every stored layer (of a partial copy made by `lmprobe pull --layers`, the ones it holds)
    layer_list = ds.default_layers(hookpoint) if layers is None else [int(x) for x in layers]
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
        logger.info("note: %s stores no token ids, so tokens.bin is not written (extract with --token-ids "
                    "to have it)", source_desc)
    plan = _plan(ds, source_desc, layers=layer_list, context_len=context_len, patches_per_shard=patches_per_shard,
                 drop_first_token=drop_first_token, with_tokens=with_tokens, index_sha256=source_index_hash(ds),
                 saev_compat=saev_compat, hookpoint=hookpoint)
    final = out / plan.hash
    check_output_path(out, "export folder")
    with OutputLock(out):
        return _export(ds, plan, out, final, layer_list, context_len, with_tokens, saev_compat, quiet, hookpoint)


def _already_exported(final: Path, quiet: bool) -> bool:
    """Whether ``final`` holds a finished export already (one that does not validate is an error)."""
    if not (final / "metadata.json").exists():
        return False
    problems = validate_saev(final)
    if problems:
        raise SaevError(f"{final} exists but does not validate ({'; '.join(problems)}); delete it and re-run")
    if not quiet:
        logger.info("%s already holds this export; nothing to do", final)
    return True


def _runs(shard_of: np.ndarray, offset_of: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                         np.ndarray]:
    """Runs of stored positions that are consecutive rows of one source shard, cut at example boundaries (every
    ``T`` positions): each run is one memcpy out of a memory-mapped source shard. (start, length, shard, row)."""
    n_pos = len(shard_of)
    cut = np.zeros(n_pos, dtype=bool)
    cut[0] = True
    cut[1:] = (np.diff(shard_of) != 0) | (np.diff(offset_of) != 1)
    cut[::T] = True
    run_start = np.flatnonzero(cut)
    run_len = np.diff(np.append(run_start, n_pos))
    return run_start, run_len, shard_of[run_start], offset_of[run_start]


def _export(ds: Any, plan: _Plan, out: Path, final: Path, layer_list: list[int], context_len: int, with_tokens: bool,
            saev_compat: str | None, quiet: bool, hookpoint: str | None = None) -> Path:
    if _already_exported(final, quiet):
        return final
    h = ds.hidden_desc(hookpoint)
    T, L, D = context_len, len(layer_list), h.dim
    vec_bytes = D * 4
    import pyarrow.compute as pc

    flat_ids, flat_offs, list_lengths = ds.shards.token_addresses()
    list_start = np.concatenate([[0], np.cumsum(list_lengths)[:-1]]).astype(np.int64)
    src_pos = list_start[plan.prompt_of] + plan.token_in_prompt
    shard_of, offset_of = flat_ids[src_pos], flat_offs[src_pos]
    del flat_ids, flat_offs, src_pos
    # the index's addresses are untrusted: rows are copied straight out of the shard files
    ds.shards.check_addresses(shard_of, offset_of, h.shard_rows, len(h.shards))
    if with_tokens:  # checked before any byte is written: the lists must hold num_tokens ids per prompt
        ids = ds.token_columns(["token_ids"])["token_ids"]
        ds.shards.check_token_counts(pc.list_value_length(ids).to_numpy(zero_copy_only=False), None, "token ids")
        tok = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
        del ids
    partial = out / f".{plan.hash}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    n_pos = plan.n_ex * T
    run_start, run_len, run_shard, run_off = _runs(shard_of, offset_of, T)
    del shard_of, offset_of
    maps: dict[tuple[int, int], np.ndarray] = {}
    fds: dict[tuple[int, int], tuple[int, int]] = {}  # float32 sources: (fd, data start), read with preadv

    def source(layer: int, shard: int) -> tuple[np.ndarray, np.ndarray | None]:
        """A shard's rows as stored, mapped, and a scaled dtype's (int8) per-row scales beside them."""
        if (layer, shard) not in maps:
            while len(maps) >= _OPEN_SOURCES:
                maps.pop(next(iter(maps)))
            path, entry = ds.shards.hidden_shard(layer, shard, hookpoint)
            scales = None
            if h.kind.scaled:
                spath, sentry = ds.shards.hidden_scales(layer, shard, hookpoint)
                scales = np.memmap(spath, dtype=np.float32, mode="r", offset=sentry.start, shape=sentry.shape)
            maps[(layer, shard)] = (np.memmap(path, dtype=h.kind.np_storage, mode="r", offset=entry.start,
                                              shape=entry.shape), scales)
        return maps[(layer, shard)]

    def source_fd(layer: int, shard: int) -> tuple[int, int]:
        if (layer, shard) not in fds:
            # a few source files open at a time: a remote source read through a bounded cache (--cache)
            # frees a deleted file's disk space only once it is closed
            while len(fds) >= _OPEN_SOURCES:
                os.close(fds.pop(next(iter(fds)))[0])
            path, entry = ds.shards.hidden_shard(layer, shard, hookpoint)
            fds[(layer, shard)] = (os.open(path, os.O_RDONLY), entry.start)
        return fds[(layer, shard)]

    # float32 and bfloat16 runs are read with one preadv each straight into the block (bfloat16 into a
    # block of raw bits, converted in one pass per chunk); other dtypes are copied out of memory maps
    direct = (h.kind.half_of_float32 or h.dtype == "float32") and hasattr(os, "preadv")
    ex_chunk = max(1, _CHUNK_BYTES // (L * T * vec_bytes))
    bar = Progress(plan.n_ex, desc="export-saev", unit="example", quiet=quiet)
    shards_json = []
    shape = (min(ex_chunk, max(plan.shard_sizes)), L, T, D)
    # two blocks: one is filled while the other is converted (converter threads) and written (the writer thread)
    blocks = [(np.empty(shape, dtype="<f4"), np.empty(shape, dtype=np.uint16) if direct and h.kind.half_of_float32
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
        logger.info("wrote %s x %s x %s x %s dims in %s to %s",
                    plural(plan.n_ex, 'example'), plural(L, 'layer'), plural(T, 'token'), D,
                    plural(len(shards_json), 'shard'), final)
    return final


def _write_shards(plan, partial, L, T, D, ex_chunk, blocks, run_start, run_len, run_shard, run_off,
                  layer_list, source, source_fd, direct, h, bar, shards_json, pad_to: int | None) -> None:
    """Write every shard not finished by an earlier run: acts*.bin.tmp, then renamed.

    ``blocks``: two (float32 block, raw bits or None) pairs. A chunk is read into one while the
    other is written on the writer thread, so reading overlaps writing; a bfloat16 source's chunk
    (read as raw bits) is converted on the converter threads as soon as it is read, while the
    writer still writes the chunk before it. ``pad_to``: zero-pad each shard to this many
    examples (saev's loaders map every shard at full size).
    """
    vec_bytes = D * 4
    src_bytes = D * h.kind.itemsize
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
                                codes, scales = source(layer, int(run_shard[r]))
                                lo = int(run_off[r])
                                h.kind.decode(codes[lo : lo + m], None if scales is None else scales[lo : lo + m],
                                              out=block[e - a, li, t : t + m])
                        # converted on the converter threads while the writer still writes the previous chunk
                        conversion = bfloat16_to_float32_later(bits[: b - a], block[: b - a]) if bits is not None else None
                        writes[k % 2] = writer.submit(_write_chunk, f, block, conversion, b - a)
                        bar.update(b - a)
                finally:  # the file stays open until its writes are done, error or not
                    settle(writes)
                if file_ex > n:
                    f.truncate((file_ex * L * T) * vec_bytes)  # zeros: rows past n_ex are never read
            first_ex += n


def _write_chunk(f: Any, block: np.ndarray, conversion: Future | None, n: int) -> None:
    """The writer thread's part of a chunk: once its bfloat16 bits (if any) are converted, append its bytes to ``f``."""
    if conversion is not None:
        conversion.result()
    f.write(memoryview(block[:n]).cast("B"))


def source_index_hash(ds: Any) -> str:
    """Identifies the source data: its tensor descriptors (with per-file sha256 when recorded) and texts.

    An export records it as ``data.source_index_sha256``: a dataset re-extracted in place (other
    prompts or values) no longer has it, so an export left in its folder is known not to belong.
    """
    h = hashlib.sha256()
    h.update(json.dumps(ds.info.get("tensors"), sort_keys=True).encode())
    for t in ds.texts:
        h.update(t.encode() + b"\0")
    return h.hexdigest()
