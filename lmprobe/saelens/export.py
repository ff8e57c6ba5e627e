"""``export_saelens``: a full_sequence lmprobe dataset as a SAELens activation cache (the layout: ``layout.py``),
with pyarrow only, a batch of rows at a time."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..base.atomic import atomic_write, move_into_place
from ..base.lock import OutputLock
from ..base.paths import check_output_path
from ..base.progress import Progress
from ..base.safeio import read_json
from ..base.units import plural
from ..errors import LayerNotFoundError, SaelensError
from ..format.reader import Dataset
from ..opening import load
from . import layout
from .layout import ARRAY2D, SHARD_BYTES, inside, tl_hook_name

logger = logging.getLogger(__name__)


def _features(hook: str, context: int, d_in: int, with_tokens: bool) -> dict:
    f: dict[str, Any] = {hook: {"shape": [context, d_in], "dtype": "float32", "_type": "Array2D"}}
    if with_tokens:
        f["token_ids"] = {"feature": {"dtype": "int32", "_type": "Value"}, "length": context, "_type": "List"}
    return f


def _schema(hook: str, context: int, d_in: int, with_tokens: bool) -> pa.Schema:
    """The Arrow schema datasets writes for these features (Array2D as its extension type's storage)."""
    fields = [pa.field(hook, pa.list_(pa.list_(pa.float32())), metadata={
        "ARROW:extension:metadata": json.dumps([[context, d_in], "float32"]),
        "ARROW:extension:name": ARRAY2D})]
    if with_tokens:
        fields.append(pa.field("token_ids", pa.list_(pa.int32(), context)))
    info = {"info": {"features": _features(hook, context, d_in, with_tokens)}}
    return pa.schema(fields, metadata={"huggingface": json.dumps(info)})


def _record_batch(schema: pa.Schema, acts_btd: np.ndarray, tokens_bt: np.ndarray | None) -> pa.RecordBatch:
    b, t, d = acts_btd.shape
    inner = pa.ListArray.from_arrays(pa.array(np.arange(b * t + 1, dtype=np.int32) * d),
                                     pa.array(acts_btd.reshape(-1), type=pa.float32()))
    outer = pa.ListArray.from_arrays(pa.array(np.arange(b + 1, dtype=np.int32) * t), inner)
    cols = [outer]
    if tokens_bt is not None:
        cols.append(pa.FixedSizeListArray.from_arrays(pa.array(tokens_bt.reshape(-1).astype(np.int32)), t))
    return pa.RecordBatch.from_arrays(cols, schema=schema)


#: how rows become SAELens windows (``--windows``)
WINDOWS = ("pack", "exact")


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes: which rows of the source, how their tokens become windows, how windows split into files.

    ``pack``: every stored token of ``rows``, in index order, cut into windows of ``context`` tokens
    (the last partial window is left out). ``exact``: one window per row of exactly ``context`` tokens.
    """

    hook: str
    layer: int
    hookpoint: str
    context: int
    d_in: int
    rows: np.ndarray  # source rows exported, in index order
    n_skipped: int  # exact: rows of another length, left out; pack: tokens of the last partial window, left out
    rows_per_file: int  # windows per data file
    mode: str = "exact"
    n_windows: int = 0

    @property
    def n_files(self) -> int:
        return max(1, -(-self.n_windows // self.rows_per_file))


def choose_hook(ds: Dataset, source_desc: str, *, layer: int | None, hookpoint: str | None) -> tuple[str, int]:
    """The (hookpoint, layer) a SAELens cache of ``ds`` holds: the arguments checked against the metadata alone
    (no index, no shard), so that the command line answers a missing ``--layer`` before it says anything else."""
    hp = hookpoint or ds.hookpoints[0]
    if hp not in ds.hookpoints:
        raise SaelensError(f"hookpoint {hp!r} is not in {source_desc} (it stores {ds.hookpoints})")
    if layer is None:
        here = ds.default_layers(hp)  # a partial copy: the layers it holds
        if len(here) != 1:
            raise SaelensError(f"{source_desc} stores layers {here} and a SAELens cache holds one hook: "
                               "pass --layer")
        layer = here[0]
    try:
        return hp, ds.check_layer(layer, hp)  # -1: the last stored layer, as everywhere
    except LayerNotFoundError:
        raise SaelensError(f"layer {layer} is not in {source_desc} (it stores {ds.layers})") from None


def plan_export(ds: Dataset, source_desc: str, *, layer: int | None, hookpoint: str | None,
                context_len: int | None = None, shard_bytes: int = SHARD_BYTES, windows: str = "pack") -> ExportPlan:
    """Check the source and choose rows, windows and files, before anything is written."""
    if windows not in WINDOWS:
        raise SaelensError(f"windows must be 'pack' or 'exact', got {windows!r}")
    if ds.storage != "full_sequence":
        raise SaelensError(f"{source_desc} is pooled (it stores only each prompt's last token); a SAELens cache "
                           "holds every token of each window: extract with --storage full_sequence")
    hp, layer = choose_hook(ds, source_desc, layer=layer, hookpoint=hookpoint)
    hook = tl_hook_name(hp, layer)
    lengths = ds.token_lengths()
    if not len(lengths):
        raise SaelensError(f"{source_desc} holds no prompts")
    context = int(lengths.max()) if context_len is None else int(context_len)
    d_in = ds.hidden_desc(hp).dim
    per_file = max(1, shard_bytes // (context * d_in * 4 + context * 4))
    if windows == "pack":
        total = int(lengths.sum())
        if total < context:
            raise SaelensError(f"{source_desc} holds {total:,} tokens, fewer than one window of {context}; pass a "
                               "smaller --context-len")
        return ExportPlan(hook, int(layer), hp, context, d_in, np.arange(len(lengths)), total % context, per_file,
                          "pack", total // context)
    rows = np.flatnonzero(lengths == context)
    if not len(rows):
        raise SaelensError(f"no prompt of {source_desc} holds exactly {context} tokens (lengths "
                           f"{int(lengths.min())}..{int(lengths.max())}); SAELens windows all have one length: "
                           "--windows pack (the default) packs prompts of any length")
    return ExportPlan(hook, int(layer), hp, context, d_in, rows, int(len(lengths) - len(rows)), per_file, "exact",
                      len(rows))


def export_saelens(source: Any, out: str | os.PathLike, *, layer: int | None = None, hookpoint: str | None = None,
                   context_len: int | None = None, tokens: bool | None = None, shard_bytes: int = SHARD_BYTES,
                   windows: str = "pack", quiet: bool = False) -> Path:
    """Write a full_sequence lmprobe dataset as the activation cache SAELens' ``CacheActivationsRunner`` writes.

    >>> export_saelens("out/acts", "saelens-cache", layer=6)  # doctest: +SKIP

    SAELens' windows all hold ``context_len`` tokens (default: the longest stored prompt's length).
    ``windows="pack"`` (the default) concatenates every stored token in index order, as SAELens'
    own caching packs a corpus, and cuts it into windows: everything but the last partial window is
    kept, and a window may start inside a prompt. ``windows="exact"`` writes one window per prompt
    of exactly ``context_len`` tokens and leaves the others out (counted): whole prompts, each from
    its first token (a corpus extraction's windows, for instance). Train with
    ``LanguageModelSAERunnerConfig(cached_activations_path=out, context_size=<that length>,
    hook_name=<the column>)``. Values are float32 (half-precision sources are converted).
    ``tokens``: write ``token_ids`` (None: when the source stores them).
    """
    ds = source if isinstance(source, Dataset) else load(source)
    source_desc = str(source) if isinstance(source, (str, os.PathLike)) else ds.source
    plan = plan_export(ds, source_desc, layer=layer, hookpoint=hookpoint, context_len=context_len,
                       shard_bytes=shard_bytes, windows=windows)
    has_ids = "token_ids" in ds.column_names
    if tokens and not has_ids:
        raise SaelensError(f"{source_desc} has no token_ids column: extract with --token-ids, or leave them out")
    with_tokens = has_ids if tokens is None else bool(tokens)
    out = check_output_path(out, "SAELens cache folder")
    if out.exists() and any(out.iterdir()):
        if _exported_already(out, _export_id(ds, plan, with_tokens)):
            if not quiet:
                logger.info("%s already holds this export of %s; nothing to do", out, ds.source)
            return out
        raise SaelensError(f"{out} is not empty; SAELens caches are written into a new or empty folder")
    with OutputLock(out):
        return _write_cache(ds, plan, out, with_tokens, quiet)


def _export_id(ds: Dataset, plan: ExportPlan, with_tokens: bool) -> str:
    """What an export is: the source's version, the hook, the rows and the columns (recorded in its description)."""
    what = [ds.identity, plan.hook, plan.context, plan.d_in, with_tokens, plan.rows_per_file, plan.mode,
            hashlib.sha256(plan.rows.astype(np.int64).tobytes()).hexdigest()]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def _exported_already(out: Path, export_id: str) -> bool:
    """Whether ``out`` is a finished export (state.json written last) recorded as ``export_id``."""
    try:
        info = read_json(inside(out, "dataset_info.json"), error=SaelensError)
        inside(out, "state.json")
    except SaelensError:
        return False
    return isinstance(info, dict) and isinstance(info.get("description"), str) \
        and info["description"].endswith(f"(export {export_id})")


def _window_batches(ds: Dataset, plan: ExportPlan, with_tokens: bool,
                    batch_windows: int) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """The windows in order, a batch of about ``batch_windows`` at a time: ((b, context, d_in) float32, (b, context)
    token ids or None). Packed, each batch reads the next prompts whole and carries their last partial window on."""
    import pyarrow.compute as pc

    T, lengths = plan.context, ds.token_lengths()
    carry_acts = np.empty((0, plan.d_in), np.float32)
    carry_ids = np.empty(0, np.int64)
    p, rows = 0, plan.rows
    while p < len(rows):
        if plan.mode == "exact":
            chunk = rows[p : p + batch_windows]
        else:  # prompts up to about batch_windows windows' tokens, at least one
            ends = np.cumsum(lengths[rows[p:]])
            chunk = rows[p : p + max(1, int(np.searchsorted(ends, batch_windows * T, side="right")))]
        p += len(chunk)
        ids, offs, _ = ds.shards.token_addresses(chunk)
        acts = np.asarray(ds.shards.read_hidden_rows(plan.layer, ids, offs, hookpoint=plan.hookpoint), dtype=np.float32)
        tok = None
        if with_tokens:
            tok = pc.list_flatten(ds.token_columns(["token_ids"], chunk)["token_ids"]).to_numpy(zero_copy_only=False)
        if plan.mode == "exact":
            yield acts.reshape(len(chunk), T, plan.d_in), tok.reshape(len(chunk), T) if tok is not None else None
            continue
        acts = np.concatenate([carry_acts, acts])
        tok = np.concatenate([carry_ids, tok]) if tok is not None else None
        n = len(acts) // T
        carry_acts = acts[n * T :]
        carry_ids = tok[n * T :] if tok is not None else carry_ids
        if n:
            yield acts[: n * T].reshape(n, T, plan.d_in), tok[: n * T].reshape(n, T) if tok is not None else None


def _write_cache(ds: Dataset, plan: ExportPlan, out: Path, with_tokens: bool, quiet: bool) -> Path:
    partial = out.parent / f".{out.name}.partial"
    if partial.is_symlink() or (partial.exists() and not partial.is_dir()):
        partial.unlink()  # not an export's folder, but in its way: a link goes (never followed), its target stays
    elif partial.exists():
        shutil.rmtree(partial)  # an interrupted export's files; this one writes them all again
    partial.mkdir(parents=True)
    schema = _schema(plan.hook, plan.context, plan.d_in, with_tokens)
    batch_windows = max(1, layout.BATCH_BYTES // (plan.context * plan.d_in * 4))
    names = [f"data-{i:05d}-of-{plan.n_files:05d}.arrow" for i in range(plan.n_files)]
    digest = hashlib.sha256(json.dumps([plan.hook, plan.context, plan.d_in, ds.source, plan.mode]).encode())
    batches = _window_batches(ds, plan, with_tokens, batch_windows)
    pending: tuple[np.ndarray, np.ndarray | None] | None = None  # windows read but not written yet
    with Progress(plan.n_windows, desc="export-saelens", unit="window", quiet=quiet) as bar:
        for i, name in enumerate(names):
            want = min(plan.rows_per_file, plan.n_windows - i * plan.rows_per_file)
            with pa.OSFile(str(partial / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
                while want:
                    if pending is None:
                        pending = next(batches)
                    acts, tok = pending
                    k = min(want, len(acts))
                    writer.write_batch(_record_batch(schema, acts[:k], tok[:k] if tok is not None else None))
                    digest.update(acts[:k].tobytes())
                    pending = (acts[k:], tok[k:] if tok is not None else None) if k < len(acts) else None
                    want -= k
                    bar.update(k)
    info = {"citation": "", "description": f"lmprobe export-saelens of {ds.source} (export "
            f"{_export_id(ds, plan, with_tokens)})", "features":
            _features(plan.hook, plan.context, plan.d_in, with_tokens), "homepage": "", "license": ""}
    atomic_write(partial / "dataset_info.json", json.dumps(info, indent=2))
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": digest.hexdigest()[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}
    atomic_write(partial / "state.json", json.dumps(state, indent=2))  # last: it lists the data files
    if out.exists():
        out.rmdir()  # empty (checked before writing)
    move_into_place(partial, out)
    if not quiet:
        head = f"wrote {plural(plan.n_windows, 'window')} x {plan.context} tokens x {plan.d_in} dims of {plan.hook} to {out}"
        if plan.mode == "pack":
            total = int(ds.token_lengths().sum())
            how = (f": the {total:,} stored tokens of {plural(len(plan.rows), 'prompt')} packed in index order"
                   + (f" (the last {plan.n_skipped} left out; --windows exact keeps whole prompts of one length "
                      "instead)" if plan.n_skipped else ""))
        else:
            how = f"; {plan.n_skipped} prompt(s) of another length left out" if plan.n_skipped else ""
        logger.info("%s%s; configure SAELens with context_size=%s, hook_name=%r, d_in=%s",
                    head, how, plan.context, plan.hook, plan.d_in)
    return out


# ---------------------------------------------------------------------------------------------- import

