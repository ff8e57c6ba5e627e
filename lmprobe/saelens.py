"""SAELens' activation cache, both ways (docs/saelens.md).

SAELens' ``CacheActivationsRunner`` saves a Hugging Face ``datasets`` dataset to disk:

    DIR/state.json  dataset_info.json  data-00000-of-0000N.arrow ...  [cache-<fingerprint>.arrow]

Each row is one context window: a column named after the TransformerLens hook (e.g.
``blocks.6.hook_resid_post``), an ``Array2D`` of shape (context_size, d_in), and ``token_ids``, a
list of context_size int32. The data files are Arrow IPC streams listed, in order, by state.json's
``_data_files``; ``cache-*.arrow`` is the index mapping of ``dataset.shuffle(seed)``, which the
runner computes after saving and which state.json does not reference, so ``datasets.load_from_disk``
(and SAELens' ``ActivationsStore``) read the rows in ``_data_files`` order. Pushed to the Hub with
``push_to_hub``, the same dataset is Parquet files under ``data/``.

``export_saelens`` writes that layout from a full_sequence lmprobe dataset, one row per stored
prompt (window), with pyarrow only; ``import_saelens`` reads it (a folder, or a Hub dataset repo)
into an lmprobe dataset through the public ``DatasetWriter``. Both stream: a batch of rows at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .atomic import atomic_write, move_into_place
from .display import escape_controls, one_line
from .errors import LayerNotFoundError, LmprobeError, SaelensError, UnsafePathError
from .format.reader import Dataset, open_local
from .format.spec import INDEX_PATH
from .format.writer import DatasetWriter
from .lock import OutputLock
from .opening import load
from .paths import check_output_path, resolve_inside
from .progress import Progress, logger
from .safeio import check_regular, loads, read_json
from .storage.hub import HubFiles, parse_dataset_ref
from .units import plural

#: the SAELens release the layout was checked against (with the datasets release it installs)
SAELENS_CHECKED = "sae-lens 6.54.12 (datasets 5.2.0)"
#: lmprobe hookpoint -> TransformerLens hook of block {layer} (docs/hookpoints.md)
TL_HOOKS = {
    "resid_pre": "blocks.{layer}.hook_resid_pre",
    "attn_out": "blocks.{layer}.hook_attn_out",
    "resid_mid": "blocks.{layer}.hook_resid_mid",
    "mlp_in": "blocks.{layer}.ln2.hook_normalized",
    "mlp_out": "blocks.{layer}.hook_mlp_out",
    "resid_post": "blocks.{layer}.hook_resid_post",
    "self_attn.o_proj:input": "blocks.{layer}.attn.hook_z",
}
_TL_NAME = re.compile(r"blocks\.(\d{1,6})\.(.+)")
_ARRAY2D = "datasets.features.features.Array2DExtensionType"
#: datasets' default max_shard_size for save_to_disk
SHARD_BYTES = 500 * 2**20
_BATCH_BYTES = 64 * 2**20


def tl_hook_name(hookpoint: str, layer: int) -> str:
    """The TransformerLens (and SAELens) name of an lmprobe hookpoint of block ``layer``.

    >>> tl_hook_name("resid_post", 6)
    'blocks.6.hook_resid_post'
    """
    if hookpoint not in TL_HOOKS:
        raise SaelensError(f"hookpoint {hookpoint!r} has no TransformerLens hook name; SAELens caches can hold "
                           f"{sorted(TL_HOOKS)}")
    return TL_HOOKS[hookpoint].format(layer=int(layer))


def parse_tl_hook(name: str) -> tuple[int, str]:
    """(layer, lmprobe hookpoint) of a TransformerLens hook name such as ``blocks.6.hook_resid_post``."""
    m = _TL_NAME.fullmatch(name)
    if m:
        for hp, pattern in TL_HOOKS.items():
            if pattern.format(layer=m.group(1)) == name:
                return int(m.group(1)), hp
    raise SaelensError(f"activation column {escape_controls(name)!r} is not a TransformerLens hook lmprobe maps "
                       f"(blocks.<L>.{{{', '.join(p.split('.', 2)[2] for p in TL_HOOKS.values())}}})")


# ---------------------------------------------------------------------------------------------- export


def _features(hook: str, context: int, d_in: int, with_tokens: bool) -> dict:
    f: dict[str, Any] = {hook: {"shape": [context, d_in], "dtype": "float32", "_type": "Array2D"}}
    if with_tokens:
        f["token_ids"] = {"feature": {"dtype": "int32", "_type": "Value"}, "length": context, "_type": "List"}
    return f


def _schema(hook: str, context: int, d_in: int, with_tokens: bool) -> pa.Schema:
    """The Arrow schema datasets writes for these features (Array2D as its extension type's storage)."""
    fields = [pa.field(hook, pa.list_(pa.list_(pa.float32())), metadata={
        "ARROW:extension:metadata": json.dumps([[context, d_in], "float32"]),
        "ARROW:extension:name": _ARRAY2D})]
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


def plan_export(ds: Dataset, source_desc: str, *, layer: int | None, hookpoint: str | None,
                context_len: int | None = None, shard_bytes: int = SHARD_BYTES, windows: str = "pack") -> ExportPlan:
    """Check the source and choose rows, windows and files, before anything is written."""
    if windows not in WINDOWS:
        raise SaelensError(f"windows must be 'pack' or 'exact', got {windows!r}")
    if ds.storage != "full_sequence":
        raise SaelensError(f"{source_desc} is pooled (it stores only each prompt's last token); a SAELens cache "
                           "holds every token of each window: extract with --storage full_sequence")
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
        layer = ds.check_layer(layer, hp)  # -1: the last stored layer, as everywhere
    except LayerNotFoundError:
        raise SaelensError(f"layer {layer} is not in {source_desc} (it stores {ds.layers})") from None
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
                print(f"{out} already holds this export of {ds.source}; nothing to do", file=sys.stderr)
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
        info = read_json(_inside(out, "dataset_info.json"), error=SaelensError)
        _inside(out, "state.json")
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
        ids, offs, _ = ds.token_addresses(chunk)
        acts = np.asarray(ds.read_hidden_rows(plan.layer, ids, offs, hookpoint=plan.hookpoint), dtype=np.float32)
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
    batch_windows = max(1, _BATCH_BYTES // (plan.context * plan.d_in * 4))
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
        logger.info(f"{head}{how}; configure SAELens with context_size={plan.context}, hook_name={plan.hook!r}, "
                    f"d_in={plan.d_in}")
    return out


# ---------------------------------------------------------------------------------------------- import


@dataclass(frozen=True)
class CacheInfo:
    """A SAELens cache as read from its description: where its rows are and what they hold."""

    source: str
    files: list[str]  # data files in row order (Arrow streams, or Parquet from the Hub)
    fetch: Callable[[str], Path]  # a data file's local path (from the Hub: downloaded on first use)
    parquet: bool
    hook: str
    layer: int
    hookpoint: str
    context: int
    d_in: int
    has_tokens: bool
    model_name: str | None
    dtype: str = "float32"  # the activations' declared dtype
    token_dtype: str | None = None  # token_ids' declared integer dtype
    identity: str = ""  # what a resumed import checks it is reading the same cache (names, sizes or commit)


_FLOATS = ("float32", "float16", "float64")
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _features_of(features: Any, where: str) -> tuple[str, int, int, str, str | None]:
    """(hook, context, d_in, activation dtype, token_ids dtype or None) that dataset_info.json declares."""
    if not isinstance(features, dict):
        raise SaelensError(f"{where}: features must be an object")
    arrays = [k for k, v in features.items() if isinstance(v, dict) and v.get("_type") == "Array2D"]
    if len(arrays) != 1:
        raise SaelensError(f"{where}: a SAELens cache holds one Array2D activation column, found "
                           f"{[escape_controls(a) for a in arrays]}")
    hook = arrays[0]
    shape, dtype = features[hook].get("shape"), features[hook].get("dtype")
    if (not isinstance(shape, list) or len(shape) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                  and 0 < x < 2**24 for x in shape)):
        raise SaelensError(f"{where}: {escape_controls(hook)!r} shape must be [context_size, d_in], got "
                           f"{escape_controls(shape)}")
    if dtype not in _FLOATS:
        raise SaelensError(f"{where}: activation dtype {escape_controls(dtype)!r} is not float32, float16 or float64")
    tok = features.get("token_ids")
    if tok is None:
        return hook, shape[0], shape[1], dtype, None
    inner = tok.get("feature") if isinstance(tok, dict) else None
    length = tok.get("length", -1) if isinstance(tok, dict) else None
    if (not isinstance(inner, dict) or tok.get("_type") not in ("List", "Sequence") or inner.get("_type") != "Value"
            or inner.get("dtype") not in _INTS or length not in (-1, shape[0])):
        raise SaelensError(f"{where}: token_ids must be a List of integer Values of length {shape[0]}, got "
                           f"{escape_controls(json.dumps(tok)[:200])}")
    return hook, shape[0], shape[1], dtype, inner["dtype"]


def read_cache_info(cache: str | os.PathLike, *, revision: str | None = None, token: str | bool | None = None
                    ) -> CacheInfo:
    """Read and check a SAELens cache's description (a local folder, or a Hub dataset repo) without its data."""
    p = Path(cache)
    if p.is_dir():
        state = read_json(_inside(p, "state.json"), what=f"{p}/state.json", error=SaelensError)
        info = read_json(_inside(p, "dataset_info.json"), what=f"{p}/dataset_info.json", error=SaelensError)
        names = _data_files(state, f"{p}/state.json")
        sizes = [_inside(p, name).stat().st_size for name in names]  # present, regular files inside the folder
        identity = [os.path.realpath(p), names, sizes, state.get("_fingerprint")]
        return _cache_info(str(p), names, lambda name: _inside(p, name), False, info, f"{p}/dataset_info.json", None,
                           identity)
    ref = parse_dataset_ref(cache, revision)
    if ref is None:
        raise SaelensError(f"{cache} is neither a folder nor a Hub dataset repo (owner/name)")
    return _hub_info(HubFiles(ref, token=token))


def _inside(root: Path, name: str) -> Path:
    try:
        return check_regular(resolve_inside(root, name, "cache file"), "cache file")
    except UnsafePathError as exc:
        raise SaelensError(str(exc)) from None
    except FileNotFoundError:
        raise SaelensError(f"{root}: {name} is missing") from None


def _data_files(state: Any, where: str) -> list[str]:
    """state.json's ``_data_files``: plain file names, in row order."""
    if not isinstance(state, dict) or not isinstance(state.get("_data_files"), list) or not state["_data_files"]:
        raise SaelensError(f"{where} lists no _data_files; is this a datasets save_to_disk folder?")
    if state.get("_indices_data_files"):
        raise SaelensError(f"{where} has an indices mapping (an old datasets layout): load it with datasets "
                           "and save_to_disk it again")
    names = [f.get("filename") if isinstance(f, dict) else None for f in state["_data_files"]]
    bad = [n for n in names if not isinstance(n, str) or "/" in n or "\\" in n or n in ("", ".", "..")]
    if bad:
        raise SaelensError(f"{where}: data file names must be plain file names, got {escape_controls(bad[:3])}")
    return names


def _cache_info(source: str, files: list[str], fetch: Callable[[str], Path], parquet: bool, info: Any, where: str,
                model_name: str | None, identity: Any) -> CacheInfo:
    features = info.get("features") if isinstance(info, dict) else None
    hook, context, d_in, dtype, token_dtype = _features_of(features, where)
    layer, hp = parse_tl_hook(hook)
    ident = hashlib.sha256(json.dumps([identity, hook, context, d_in, dtype, token_dtype]).encode()).hexdigest()
    return CacheInfo(source, files, fetch, parquet, hook, layer, hp, context, d_in, token_dtype is not None,
                     model_name, dtype, token_dtype, ident[:16])


def _hub_info(hub: HubFiles) -> CacheInfo:
    model = None
    if "cache_activations_runner_cfg.json" in hub.repo_files:
        cfg = read_json(hub.fetch("cache_activations_runner_cfg.json", what="runner config"), error=SaelensError)
        model = cfg.get("model_name") if isinstance(cfg, dict) and isinstance(cfg.get("model_name"), str) else None

    def fetch(name: str) -> Path:
        return hub.fetch(name, what="cache data file")

    if "state.json" in hub.repo_files:  # a save_to_disk folder uploaded as it is
        state = read_json(hub.fetch("state.json", what="state.json"), what=f"{hub}/state.json", error=SaelensError)
        info = read_json(hub.fetch("dataset_info.json", what="dataset_info.json"), what=f"{hub}/dataset_info.json",
                         error=SaelensError)
        names = _data_files(state, f"{hub}/state.json")
        missing = [n for n in names if n not in hub.repo_files]
        if missing:
            raise SaelensError(f"{hub}: data files {escape_controls(missing[:3])} listed in state.json are missing")
        return _cache_info(str(hub), names, fetch, False, info, f"{hub}/dataset_info.json", model, [hub.commit, names])
    names = sorted(f for f in hub.repo_files if f.startswith("data/") and f.endswith(".parquet"))
    if not names:
        raise SaelensError(f"{hub} holds neither state.json nor data/*.parquet: not a SAELens activation cache")
    import pyarrow.parquet as pq

    try:  # push_to_hub writes the features into each Parquet file's schema metadata
        meta = pq.read_schema(fetch(names[0])).metadata or {}
    except (pa.ArrowException, OSError) as exc:
        raise SaelensError(f"{hub}/{names[0]} is not a Parquet file ({escape_controls(str(exc)[:200])})") from None
    hf = loads(meta.get(b"huggingface", b"{}"), what=f"{hub}/{names[0]} huggingface metadata", error=SaelensError)
    return _cache_info(str(hub), names, fetch, True, hf.get("info") if isinstance(hf, dict) else None,
                       f"{hub}/{names[0]}", model, [hub.commit, names])


def _unreadable(name: str, info: CacheInfo, exc: BaseException) -> SaelensError:
    return SaelensError(f"{name} of {info.source} cannot be read as Arrow data "
                        f"({escape_controls(one_line(exc))[:200]})")


def _batches(info: CacheInfo) -> Iterator[pa.RecordBatch]:
    """The cache's rows in order, at most ~64 MiB of activations at a time (memory-mapped Arrow streams,
    whose record batches datasets writes 1,000 rows long, are sliced; Parquet is read in batches).

    Each record batch is validated in full first: list offsets that point outside their buffers would
    otherwise read other memory, or abort the process."""
    rows = max(1, _BATCH_BYTES // (info.context * info.d_in * 4))
    for name in info.files:
        path = info.fetch(name)
        try:
            if info.parquet:
                import pyarrow.parquet as pq

                source: Iterator[pa.RecordBatch] = pq.ParquetFile(path).iter_batches(batch_size=rows)
                yield from (_valid(batch, name, info) for batch in source)
            else:
                with pa.memory_map(str(path)) as src:
                    for batch in pa.ipc.open_stream(src):
                        _valid(batch, name, info)
                        for a in range(0, len(batch), rows):
                            yield batch.slice(a, rows)
        except (pa.ArrowException, OSError) as exc:
            raise _unreadable(name, info, exc) from None


def _valid(batch: pa.RecordBatch, name: str, info: CacheInfo) -> pa.RecordBatch:
    try:
        batch.validate(full=True)
    except pa.ArrowException as exc:
        raise SaelensError(f"{name} of {info.source} is damaged: its Arrow data fails validation "
                           f"({escape_controls(one_line(exc))[:200]})") from None
    return batch


def _check_files(info: CacheInfo) -> int:
    """Every data file opens, holds the columns dataset_info.json declares with exactly the declared types, and
    the rows they hold (returned) are counted: from the schemas and the row counts alone, before anything is
    written. A type that differs is refused, never cast (2^40 + 1 as float32 loses its 1, 1.7 as int32 is 1)."""
    n = 0
    for name in info.files:
        try:
            if info.parquet:
                import pyarrow.parquet as pq

                f = pq.ParquetFile(info.fetch(name))
                schema, rows = f.schema_arrow, f.metadata.num_rows
            else:
                with pa.memory_map(str(info.fetch(name))) as src:
                    reader = pa.ipc.open_stream(src)
                    schema, rows = reader.schema, sum(b.num_rows for b in reader)
        except (pa.ArrowException, OSError) as exc:
            raise _unreadable(name, info, exc) from None
        where = f"{name} of {info.source}"
        _check_type(schema, info.hook, 2, info.dtype, where)
        if info.token_dtype is not None:
            _check_type(schema, "token_ids", 1, info.token_dtype, where)
        n += rows
    return n


def _check_type(schema: pa.Schema, column: str, depth: int, dtype: str, where: str) -> None:
    """``column`` is ``depth`` levels of lists of ``dtype`` values, as declared."""
    i = schema.get_field_index(column)
    if i < 0:
        raise SaelensError(f"{where} has no column {escape_controls(column)!r}")
    t = schema.field(i).type
    shown = t
    for _ in range(depth):
        if isinstance(t, pa.ExtensionType):
            t = t.storage_type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
            t = None
            break
        t = t.value_type
    if t != pa.type_for_alias(dtype):
        raise SaelensError(f"{where}: column {escape_controls(column)!r} is {escape_controls(shown)}, but "
                           f"dataset_info.json declares {'lists of ' * depth}{dtype}; the data and its description "
                           "disagree (values are never cast)")


def _column_values(batch: pa.RecordBatch, name: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """A nested-list column as a (rows, *shape) array, every list checked to have its declared length."""
    i = batch.schema.get_field_index(name)
    if i < 0:
        raise SaelensError(f"{where}: column {escape_controls(name)!r} is missing")
    arr: Any = batch.column(i)
    if isinstance(arr, pa.ExtensionArray):
        arr = arr.storage
    for n in shape:
        if arr.null_count:
            raise SaelensError(f"{where}: column {escape_controls(name)!r} holds nulls")
        if pa.types.is_fixed_size_list(arr.type):
            if arr.type.list_size != n:
                raise SaelensError(f"{where}: column {escape_controls(name)!r} lists are not {n} long")
        elif pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            lengths = np.asarray(arr.value_lengths())
            if len(lengths) and (lengths != n).any():
                raise SaelensError(f"{where}: column {escape_controls(name)!r} lists are not all {n} long")
        else:
            raise SaelensError(f"{where}: column {escape_controls(name)!r} is {arr.type}, not nested lists")
        arr = arr.flatten()
    if arr.null_count:
        raise SaelensError(f"{where}: column {escape_controls(name)!r} holds nulls")
    return arr.to_numpy(zero_copy_only=False).reshape(len(batch), *shape)


def import_saelens(cache: str | os.PathLike, out: str | os.PathLike, *, model_name: str | None = None,
                   revision: str | None = None, token: str | bool | None = None, shard_size: int | str = "1GiB",
                   overwrite: bool = False, checkpoint_interval: float = 30.0, quiet: bool = False) -> Path:
    """Write a SAELens activation cache (a folder or a Hub dataset repo) as an lmprobe dataset; no model needed.

    >>> import_saelens("activations/gpt2-l6", "out/gpt2-l6")  # doctest: +SKIP
    >>> lmprobe.load("out/gpt2-l6").token_hidden(0, 6).shape  # doctest: +SKIP
    (128, 768)

    Each cache row (a window of context_size tokens) becomes one prompt of a full_sequence
    dataset, in the order state.json lists the data files (the order ``datasets.load_from_disk``
    gives). The hook name gives the layer and hookpoint; texts are empty (a cache stores token ids,
    kept as ``token_ids``, not text). ``model_name``: recorded as the model (default: the runner
    config's, on the Hub; else "unknown"). An interrupted import resumes when run again (a
    checkpoint every ``checkpoint_interval`` seconds); ``overwrite=True`` replaces a dataset in ``out``.
    """
    info = read_cache_info(cache, revision=revision, token=token)
    n_rows = _check_files(info)  # before the output is created
    if n_rows == 0:
        raise SaelensError(f"{info.source} holds no rows")
    name = model_name or info.model_name or "unknown"
    if not overwrite and _imported_already(Path(out), info, name):
        if not quiet:
            print(f"{out} already holds this import of {info.source}; nothing to do", file=sys.stderr)
        return Path(out)
    made = not Path(out).exists()
    writer = DatasetWriter(out, layers=[info.layer], dim=info.d_in, model_name=name, storage="full_sequence",
                           dtype="float32", shard_size=shard_size, token_ids=info.has_tokens,
                           hookpoints=(info.hookpoint,), resume=True, overwrite=overwrite,
                           fingerprint={"saelens_cache": info.identity}, checkpoint_interval=checkpoint_interval,
                           provenance={"imported_from": {"format": "saelens-activation-cache", "source": info.source,
                                                         "hook_name": info.hook, "cache_identity": info.identity}})
    done = writer.num_prompts  # rows a resumed import wrote already
    bar = Progress(n_rows, desc="import-saelens", unit="window", initial=done, quiet=quiet)
    n = 0
    try:
        for batch in _batches(info):
            if n + len(batch) <= done:
                n += len(batch)
                continue
            batch = batch.slice(max(0, done - n))
            n = max(n, done)
            where = f"{info.source} rows {n}..{n + len(batch) - 1}"
            acts = _column_values(batch, info.hook, (info.context, info.d_in), where)
            with np.errstate(over="ignore", invalid="ignore"):  # a float64 beyond float32's range: refused next
                acts = acts.reshape(-1, info.d_in).astype(np.float32, copy=False)
            if not np.isfinite(acts).all():
                row = n + int(np.flatnonzero(~np.isfinite(acts).all(axis=1))[0]) // info.context
                raise SaelensError(f"{info.source} row {row}: activations that are not finite as float32 (NaN, "
                                   "infinity, or beyond float32's range)")
            kw: dict[str, Any] = {}
            if info.has_tokens:
                tok = _column_values(batch, "token_ids", (info.context,), where)
                if len(tok) and (tok.min() < 0 or tok.max() >= 2**31):
                    raise SaelensError(f"{where}: token_ids outside 0..2**31-1")
                kw["token_ids"] = tok.tolist()
            writer.add_batch(texts=[""] * len(batch), num_tokens=[info.context] * len(batch),
                             hidden={info.layer: acts}, **kw)
            n += len(batch)
            bar.update(len(batch))
        if n != n_rows:  # the files changed while they were read
            raise SaelensError(f"{info.source} held {n_rows} rows when checked and {n} when read; run it again")
    except SaelensError:
        writer.discard()  # the cache is unusable: nothing half-made is left
        if made and Path(out).is_dir() and not any(Path(out).iterdir()):
            Path(out).rmdir()
        raise
    except BaseException:
        writer.abort()  # interrupted: the same command resumes from the last checkpoint
        raise
    finally:
        bar.close()
    writer.close()
    if not quiet:
        print(f"imported {plural(n, 'window')} x {info.context} tokens of {info.hook} (layer {info.layer}, {info.hookpoint}) "
              f"to {out}", file=sys.stderr)
    return Path(out)


def _imported_already(out: Path, info: CacheInfo, model_name: str) -> bool:
    """Whether ``out`` holds a finished import of this very cache with this model name (a re-run has nothing to do;
    any other dataset there is the writer's to refuse, or to replace with overwrite=True)."""
    if not (out / INDEX_PATH).is_file():
        return False
    try:
        ds = open_local(out)
    except LmprobeError:
        return False
    prov = ds.info.get("provenance")
    done = prov.get("imported_from") if isinstance(prov, dict) else None
    return isinstance(done, dict) and done.get("cache_identity") == info.identity and ds.model.get("name") == model_name
