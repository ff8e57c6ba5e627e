"""``import_saelens``: a SAELens activation cache (a folder, or a Hub dataset repo) into an lmprobe dataset through
the public ``DatasetWriter``, a batch of rows at a time."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..base.display import escape_controls, one_line
from ..base.progress import Progress
from ..base.safeio import loads, read_json
from ..base.units import plural
from ..errors import LmprobeError, SaelensError
from ..format.datasetspec import DatasetSpec
from ..format.reader import open_local
from ..format.spec import INDEX_PATH
from ..format.writer import DatasetWriter
from ..storage.hub import HubFiles, parse_dataset_ref
from . import layout
from .layout import inside, parse_tl_hook

logger = logging.getLogger(__name__)


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
        state = read_json(inside(p, "state.json"), what=f"{p}/state.json", error=SaelensError)
        info = read_json(inside(p, "dataset_info.json"), what=f"{p}/dataset_info.json", error=SaelensError)
        names = _data_files(state, f"{p}/state.json")
        sizes = [inside(p, name).stat().st_size for name in names]  # present, regular files inside the folder
        identity = [os.path.realpath(p), names, sizes, state.get("_fingerprint")]
        return _cache_info(str(p), names, lambda name: inside(p, name), False, info, f"{p}/dataset_info.json", None,
                           identity)
    ref = parse_dataset_ref(cache, revision)
    if ref is None:
        raise SaelensError(f"{cache} is neither a folder nor a Hub dataset repo (owner/name)")
    return _hub_info(HubFiles(ref, token=token))



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
    rows = max(1, layout.BATCH_BYTES // (info.context * info.d_in * 4))
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
            logger.info("%s already holds this import of %s; nothing to do", out, info.source)
        return Path(out)
    made = not Path(out).exists()
    spec = DatasetSpec(layers=[info.layer], dim=info.d_in, model_name=name, storage="full_sequence", dtype="float32",
                       shard_size=shard_size, token_ids=info.has_tokens, hookpoints=(info.hookpoint,),
                       provenance={"imported_from": {"format": "saelens-activation-cache", "source": info.source,
                                                     "hook_name": info.hook, "cache_identity": info.identity}})
    writer = DatasetWriter(out, spec, resume=True, overwrite=overwrite, fingerprint={"saelens_cache": info.identity},
                           checkpoint_interval=checkpoint_interval)
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
        logger.info("imported %s x %s tokens of %s (layer %s, %s) to %s",
                    plural(n, 'window'), info.context, info.hook, info.layer, info.hookpoint, out)
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
