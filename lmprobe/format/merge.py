"""``lmprobe merge``: combine datasets written by independent jobs into one dataset.

Shards are linked (or copied when linking is impossible), not rewritten: each part's last-token
shards, then each part's sequence shards, renumbered, with the index's addresses shifted to
match. Parts must come from the same model with the same settings; anything else is refused
before a file is touched. Statistics merge exactly (Chan's parallel algorithm).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..base.atomic import atomic_output, atomic_write, move_into_place
from ..base.lock import OutputLock
from ..base.paths import check_output_path, format_relpath
from ..base.safeio import read_json
from ..errors import FormatError, InvalidArgumentError, OutputExistsError
from . import card, index
from .files import LocalFiles
from .metadata import encode_schema_metadata
from .reader import Dataset, open_local
from .spec import CARD_PATH, INDEX_PATH, RUN_SETTINGS
from .statistics import RunningStats, write_statistics

# extraction settings that may differ between parts of one job (the batch size: each part's runs record theirs)
_PART_SETTINGS = {"prompts_sha256", "num_prompts", "part", *RUN_SETTINGS}

#: what a merge in progress records in its output: the same command finds it and finishes the merge
_MARKER = ".lmprobe-merge.json"


def _compatible(parts: list[Dataset]) -> list[str]:
    first = parts[0]
    problems = []
    a_h = first.info["tensors"]["hidden_layers"]
    a_settings = {k: v for k, v in ((first.info.get("extraction") or {}).get("settings") or {}).items()
                  if k not in _PART_SETTINGS}
    for i, ds in enumerate(parts[1:], start=1):
        h = ds.info["tensors"]["hidden_layers"]
        for key in ("layers", "dim", "dtype", "storage", "key_pattern"):
            if h.get(key) != a_h.get(key):
                problems.append(f"part {i}: hidden_layers.{key} is {h.get(key)!r}, part 0 has {a_h.get(key)!r}")
        if ds.model != first.model:
            problems.append(f"part {i}: model {ds.model} differs from part 0's {first.model}")
        la, lb = first.info["tensors"].get("logits_topk"), ds.info["tensors"].get("logits_topk")
        if (la is None) != (lb is None) or (la and la["k"] != lb["k"]):
            problems.append(f"part {i}: logits differ from part 0's (k {lb and lb['k']} vs {la and la['k']})")
        if ds.schema.remove_metadata() != first.schema.remove_metadata():
            problems.append(f"part {i}: index columns differ from part 0's")
        s = {k: v for k, v in ((ds.info.get("extraction") or {}).get("settings") or {}).items()
             if k not in _PART_SETTINGS}
        if s != a_settings:
            diff = sorted(k for k in set(s) | set(a_settings) if s.get(k) != a_settings.get(k))
            problems.append(f"part {i}: extraction settings differ from part 0's ({', '.join(diff)})")
        if list(ds.meta.hookpoints) != list(first.meta.hookpoints):
            problems.append(f"part {i} stores hookpoints {list(ds.meta.hookpoints)}, part 0 "
                            f"{list(first.meta.hookpoints)}")
        if (ds.meta.statistics is None) != (first.meta.statistics is None):
            problems.append(f"part {i}: statistics are {'absent' if ds.meta.statistics is None else 'present'}, "
                            "unlike part 0")
    return problems


def _repeated(parts: list[Dataset]) -> str | None:
    """Two parts that hold the same prompts: the same dataset (a part given twice, its link or its copy: the
    same identity), or two extractions of the same prompts with the same settings (the same prompts_sha256)."""
    seen: dict[str, int] = {}
    for i, ds in enumerate(parts):
        if ds.identity in seen:
            return f"parts {seen[ds.identity]} and {i} are the same dataset ({parts[seen[ds.identity]].source}, {ds.source})"
        seen[ds.identity] = i
    seen = {}
    for i, ds in enumerate(parts):
        fp = ((ds.info.get("extraction") or {}).get("settings") or {}).get("prompts_sha256")
        if isinstance(fp, str) and fp in seen:
            return f"parts {seen[fp]} and {i} were extracted from the same prompts (prompts_sha256 {fp[:12]}...)"
        if isinstance(fp, str):
            seen[fp] = i
    return None


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() and os.path.samefile(src, dst):
        return  # linked by an interrupted run of this merge (renaming a link onto its twin would do nothing)
    with atomic_output(dst) as tmp:
        if tmp.exists():
            tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)


def merge_datasets(parts: list[Any], out: str | os.PathLike, *, overwrite: bool = False, move: bool = False,
                   settings: dict | None = None) -> Path:
    """Merge datasets ``parts`` (in order; Datasets or local folders) into a new dataset at ``out``; returns ``out``.

    >>> merge_datasets(["job-0", "job-1", "job-2"], "merged")  # doctest: +SKIP

    ``move=True`` moves the part files instead of linking them (used by multi-process extraction).
    """
    if len(parts) < 1:
        raise InvalidArgumentError("nothing to merge")
    dss = [p if isinstance(p, Dataset) else open_local(p) for p in parts]
    sources = [d.source for d in dss]
    problems = _compatible(dss)
    if problems:
        raise FormatError("cannot merge these datasets: " + "; ".join(problems))
    twice = _repeated(dss)
    if twice:
        raise InvalidArgumentError(f"cannot merge these datasets: {twice}: the merge would hold every prompt twice "
                                   "(and probe folds would share prompts); pass each part once")
    out = check_output_path(out, "merge output")
    for ds in dss:  # writing into an input would overwrite shards before they are read
        if isinstance(ds.files, LocalFiles) and not move:  # moving parts in (torchrun's own parts) reads nothing twice
            root = Path(os.path.realpath(ds.files.root))
            real = Path(os.path.realpath(out))
            if real == root or root in real.parents or real in root.parents:
                raise InvalidArgumentError(f"the output {out} is, contains or lies inside the input {ds.files.root}; "
                                           "merge into a new folder")
    with OutputLock(out):
        return _merge(dss, sources, out, overwrite=overwrite, move=move, settings=settings)


def _merge(dss: list[Dataset], sources: list[str], out: Path, *, overwrite: bool, move: bool,
           settings: dict | None) -> Path:
    if (out / INDEX_PATH).exists() and not overwrite:
        raise OutputExistsError(f"{out} already holds a dataset; pass --overwrite to replace it")
    # what this merge is: a re-run of the same command over a killed merge's files finishes it
    plan = {"sources": sources, "indexes": [d.identity for d in dss], "move": move}
    marker = out / _MARKER
    if out.exists() and not (out / INDEX_PATH).exists() and any(not c.name.startswith(".lmprobe-")
                                                                 for c in out.iterdir()):
        if not marker.is_file():
            raise OutputExistsError(f"{out} is not empty; choose an empty or new folder")
        if _read_marker(marker) != plan and not overwrite:
            raise OutputExistsError(f"{out} holds an interrupted merge of other inputs; re-run that merge to "
                                    "finish it, pass --overwrite to replace it, or choose a new folder")
    if (out / INDEX_PATH).exists():
        (out / INDEX_PATH).unlink()  # the index goes first, so a half-replaced folder never looks complete
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(marker, json.dumps(plan))

    merge = plan_merge(dss, sources=sources, settings=settings)
    transfer = move_into_place if move else _link
    for k, src, dst in merge.moves:
        transfer(dss[k].shards.fetch(src, "shard file"), out / dst)
    merge.finish(dss, out)
    marker.unlink()
    return out


@dataclass
class MergePlan:
    """What a merge does, decided from the parts' metadata alone (no shard is read).

    ``moves``: (part, file in the part, file in the merged dataset), every shard of every part once.
    ``finish`` then writes the merged statistics, card and, last, index into a local folder; an output
    elsewhere (object storage, a Hub repo) moves the shards there itself (server-side copies) and uploads
    those three files.
    """

    moves: list[tuple[int, str, str]]
    info: dict[str, Any]
    offsets: dict[str, np.ndarray]  # "last", "seq", "logits": each part's first shard in the merged numbering
    last_token_shards: list[int]  # each part's
    order: str  # "concat", "positions" or "documents" (``_ordered``)

    def finish(self, dss: list[Dataset], out: Path) -> list[str]:
        """Write the merged statistics, card and index (last) into ``out``; returns their paths, index last."""
        info = json.loads(json.dumps(self.info))
        written = []
        first = dss[0]
        if first.meta.statistics is not None:
            info["statistics"] = _merge_statistics(dss, out, first.meta.statistics.raw)
            written.append(info["statistics"]["file"])
        schema = first.schema.remove_metadata().with_metadata(encode_schema_metadata(info))
        atomic_write(out / CARD_PATH, card.render_card(info, schema))
        (out / "index").mkdir(parents=True, exist_ok=True)
        columns = schema.remove_metadata()
        with (atomic_output(out / INDEX_PATH) as tmp,  # last
              pq.ParquetWriter(tmp, schema, **index.encoding_options(columns)) as pw):
            # parts read a bounded table at a time, written a row group at a time: never the whole index in memory
            bounds = index.group_bounds(sum(d.num_prompts for d in dss),
                                        sum(index.file_entries(pq.read_metadata(d.index_path)) for d in dss))
            for group in index.row_groups(_ordered(dss, self), index.list_entries, bounds=bounds):
                pw.write_table(group.cast(columns), row_group_size=max(1, group.num_rows))
        return [*written, CARD_PATH, INDEX_PATH]

    def renumbered(self, k: int, ds: Dataset, t: pa.Table) -> pa.Table:
        """Rows of part ``k``'s index with its shard numbers shifted to the merged dataset's."""
        cols = {name: t.column(name) for name in t.column_names}
        cols["shard_index"] = pc.add(t.column("shard_index"), int(self.offsets["last"][k])).cast(pa.int32())
        if "token_shard_ids" in cols:
            # on the lists' flat values (a prompt's tokens: in the last-token shards or the sequence shards)
            ids = t.column("token_shard_ids").combine_chunks()
            flat, n_last = ids.values, self.last_token_shards[k]
            new_flat = pc.if_else(pc.less(flat, n_last), pc.add(flat, int(self.offsets["last"][k])),
                                  pc.add(flat, int(self.offsets["seq"][k]) - n_last))
            cols["token_shard_ids"] = pa.ListArray.from_arrays(ids.offsets, new_flat.cast(pa.int64()))
        if "shard_index_logits" in cols:
            cols["shard_index_logits"] = pc.add(t.column("shard_index_logits"), int(self.offsets["logits"][k])).cast(
                pa.int32())
        return pa.table(cols)


def plan_merge(dss: list[Dataset], *, sources: list[str] | None = None, settings: dict | None = None,
               order: str = "concat") -> MergePlan:
    """The merge of compatible parts ``dss`` (``_compatible``): shards renumbered (each part's last-token shards,
    then each part's sequence shards), metadata combined.

    ``order``: the merged index's row order. ``concat``: part after part (``lmprobe merge``). ``positions``: the
    parts of a multi-process extraction whose prompts were dealt round-robin (prompt i to part i % n): every
    prompt back at its position. ``documents``: the same for documents of a corpus (rows by document, then
    window), so that a multi-process corpus extraction's rows are in source order.
    """
    if order not in ("concat", "positions", "documents"):
        raise InvalidArgumentError(f"order must be 'concat', 'positions' or 'documents', got {order!r}")
    first = dss[0]
    full = first.meta.hidden.storage == "full_sequence"
    n_lts = [d.meta.hidden.last_token_shards for d in dss]
    n_seq = [len(d.meta.hidden.shards) - d.meta.hidden.last_token_shards for d in dss]
    lt_off = np.concatenate([[0], np.cumsum(n_lts)]).astype(int)
    seq_off = (sum(n_lts) + np.concatenate([[0], np.cumsum(n_seq)])).astype(int)
    lg0 = first.meta.logits
    lg_off = np.concatenate([[0], np.cumsum([len(d.meta.logits.shards) if lg0 else 0 for d in dss])]).astype(int)

    moves: list[tuple[int, str, str]] = []
    shards_lt, shards_seq, logits_shards = [], [], []
    for k, ds in enumerate(dss):
        h = ds.meta.hidden
        for s in range(len(h.shards)):
            new = (lt_off[k] + s) if s < h.last_token_shards else (seq_off[k] + s - h.last_token_shards)
            for hp, hd in ds.meta.hookpoints.items():  # every hookpoint shares the shard numbering
                for layer in hd.layers:
                    moves.append((k, hd.file(layer, s), first.meta.hookpoints[hp].file(layer, int(new))))
            (shards_lt if s < h.last_token_shards else shards_seq).append((k, s))
        if lg0:
            lg = ds.meta.logits
            for s, desc in enumerate(lg.shards):
                new_rel = _logits_rel(lg0, int(lg_off[k] + s))
                moves.append((k, lg.file(s), new_rel))
                logits_shards.append({**desc, "file": new_rel})

    info = json.loads(json.dumps(first.info))
    for hp, hd0 in first.meta.hookpoints.items():
        hidden = info["tensors"][hd0.name]
        hidden["shards"] = [dss[k].meta.hookpoints[hp].shards[s] for k, s in shards_lt + shards_seq]
        if full:
            hidden["last_token_shards"] = len(shards_lt)
    if lg0:
        info["tensors"]["logits_topk"]["shards"] = logits_shards
        info["tensors"]["logits_topk"]["file_pattern"] = lg0.file_pattern
    info["num_prompts"] = int(sum(d.num_prompts for d in dss))
    info["merged_from"] = sources if sources is not None else [d.source for d in dss]
    # every part's runs, each at the row where its part's rows now start (part 0's alone would mislead); rows
    # dealt round-robin have no such start: each run keeps its part's numbering, with the part named
    starts = np.concatenate([[0], np.cumsum([d.num_prompts for d in dss])]).tolist()
    runs = [{**r, "first_row": int(starts[k]) + r["first_row"]} if order == "concat" else {**r, "part": k}
            for k, d in enumerate(dss)
            for r in (d.info.get("runs") or []) if isinstance(r, dict) and isinstance(r.get("first_row"), int)]
    info.pop("runs", None)
    if runs:
        info["runs"] = runs
    ext = info.get("extraction") or {}
    if settings is not None:
        info["extraction"] = {**ext, "settings": settings}
    elif "settings" in ext:
        ext["settings"] = {k: v for k, v in ext["settings"].items() if k not in _PART_SETTINGS}
        ext["settings"]["num_prompts"] = info["num_prompts"]
    if first.meta.statistics is not None:
        info.get("tensors", {}).pop("statistics", None)  # where datasets written before 2026-11 kept it
    info.pop("extras", None)
    info.pop("attachments", None)
    info.pop("progress", None)  # a part's place in its share of the source, not the merged dataset's
    return MergePlan(moves, info, {"last": lt_off, "seq": seq_off, "logits": lg_off}, n_lts, order)


#: bytes of index rows read ahead from all parts together while putting rows back in source order
#: (``_ordered``), shared among the parts: the merge's memory, whatever the number of parts or tokens
_READ_AHEAD_BYTES = 4 << 20
#: bytes of index rows read at a time from a part merged part after part
_READ_BYTES = 4 << 20


def _ordered(dss: list[Dataset], merge: MergePlan) -> Iterator[pa.Table]:
    """The merged index's rows in ``merge.order``, a bounded table at a time (each part read a bounded table at a
    time: memory stays the same whatever the parts hold)."""
    n = len(dss)
    if merge.order == "concat":
        for k, ds in enumerate(dss):
            for t in ds.iter_index(max_bytes=_READ_BYTES):
                yield merge.renumbered(k, ds, t)
        return
    share = max(2, _READ_AHEAD_BYTES // n)  # each part's read-ahead, read in halves (a row at least)
    streams = [iter(ds.iter_index(max_bytes=share // 2)) for ds in dss]
    seen = [0] * n  # rows of each part read so far
    done = [False] * n

    def keys(k: int, t: pa.Table, first_row: int) -> np.ndarray:
        """Each row's place in the merged order: its prompt's position, or (document, window) as one number."""
        if merge.order == "positions":
            return (first_row + np.arange(t.num_rows, dtype=np.int64)) * n + k
        doc = t.column("document").to_numpy().astype(np.int64)
        win = t.column("window_start").to_numpy().astype(np.int64)
        return doc * (1 << 32) + win  # windows start within a document of under 4 G tokens

    pending: list[tuple[pa.Table, np.ndarray] | None] = [None] * n  # rows read and not written yet, with keys
    held = [0] * n  # bytes in pending[k]
    while True:
        for k in range(n):  # a bounded read-ahead of every part not yet exhausted
            while not done[k] and (pending[k] is None or held[k] < share):
                t = next(streams[k], None)
                if t is None:
                    done[k] = True
                    break
                t = merge.renumbered(k, dss[k], t)
                kk = keys(k, t, seen[k])
                seen[k] += t.num_rows
                held[k] += t.nbytes
                pending[k] = (t, kk) if pending[k] is None else (
                    pa.concat_tables([pending[k][0], t]), np.concatenate([pending[k][1], kk]))
        live = [k for k in range(n) if pending[k] is not None and len(pending[k][1])]
        if not live:
            return
        # rows up to the smallest "last key held" of the parts that still have more are safe to write
        limit = min((pending[k][1][-1] for k in live if not done[k]), default=None)
        out_t, out_k = [], []
        for k in live:
            t, kk = pending[k]
            take = len(kk) if limit is None else int(np.searchsorted(kk, limit, side="right"))
            if take:
                out_t.append(t.slice(0, take))
                out_k.append(kk[:take])
                pending[k] = (t.slice(take), kk[take:])
                held[k] = pending[k][0].nbytes
        if out_t:
            table = pa.concat_tables(out_t)
            order = np.argsort(np.concatenate(out_k), kind="stable")
            yield table.take(pa.array(order))


def _read_marker(path: Path) -> Any:
    """The recorded plan of an interrupted merge (None when unreadable: then it is not this merge's)."""
    try:
        return read_json(path, what="merge marker")
    except FormatError:
        return None


def _logits_rel(lg0: Any, shard: int) -> str:
    if lg0.file_pattern:
        return format_relpath(lg0.file_pattern, "logits_topk.file_pattern", shard=shard)
    return f"tensors/logits_topk_{shard:03d}.safetensors"


def _merge_statistics(dss: list[Dataset], out: Path, desc: dict) -> dict:
    layers = desc["layers"]
    hookpoints = list(dss[0].hookpoints)

    def merged(hp: str | None, layers: list[int]) -> dict[int, RunningStats]:
        m = {layer: RunningStats.empty(dss[0].hidden_desc(hp).dim) for layer in layers}
        for ds in dss:
            for layer in layers:
                m[layer] = m[layer].merge(RunningStats.from_result(ds.statistics(layer, hookpoint=hp)))
        return m

    others = {hp: merged(hp, layers) for hp in hookpoints[1:]}
    new = write_statistics(out, merged(None, layers), storage=dss[0].storage, checksums="sha256" in desc,
                           others=others)
    return {**desc, **{k: new[k] for k in ("file", "bytes", "sha256", "hookpoints") if k in new}}
