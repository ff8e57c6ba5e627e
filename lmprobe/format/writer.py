"""The streaming dataset writer.

Data flows in batches of prompts. Hidden states, top-k logits and the index rows go to three
independent shard streams (last-token, sequence, logits) whose files grow on disk as rows arrive,
so memory stays at one batch plus a small index buffer whatever the dataset size.

Crash safety: every file is written in ``.lmprobe-staging/`` and renamed into place; a checkpoint
(at most every ``checkpoint_interval`` seconds) syncs the open shards, writes the pending index
rows as a part file and then ``state.json``. An interrupted writer is reopened with the same
configuration and resumes at the last checkpoint: ``writer.num_prompts`` tells the caller where
to continue. The index is written last, so a folder with an index is a complete dataset.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ColumnTypeError, FormatError, OutputExistsError, ResumeMismatchError
from ..hashing import sha256_file
from ..units import parse_size
from . import card
from .metadata import decode_schema_metadata, encode_schema_metadata, parse_info
from .paths import check_pattern, format_relpath
from .safetensors_io import StreamingSafetensorsWriter, TensorSpec
from .spec import (
    CARD_PATH,
    DEFAULT_HIDDEN_FILE_PATTERN,
    DEFAULT_HIDDEN_KEY_PATTERN,
    DEFAULT_LOGITS_FILE_PATTERN,
    DEFAULT_SHARD_SIZE,
    DTYPES,
    FORMAT_VERSION,
    HIDDEN_DTYPES,
    INDEX_PATH,
    LOGITS_INDICES_KEY,
    LOGITS_VALUES_KEY,
    RESERVED_COLUMNS,
    STAGING_DIR,
    STORAGES,
)
from .values import COLUMN_TYPES, check_value, column_type_name, to_numpy, to_storage

STATE_VERSION = 1
_ROW_GROUP_ROWS = 65536
_MAX_PENDING_ROWS = 65536


def _atomic_write_bytes(path: Path, data: bytes, fsync: bool = False) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)



def default_provenance() -> dict[str, Any]:
    """Versions of the build environment, read from installed package metadata (no heavy imports)."""
    import platform
    from datetime import datetime, timezone
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    from .. import __version__

    return {
        "lmprobe_version": __version__,
        "extraction_backend": None,
        "nnsight_version": None,
        "torch_version": v("torch"),
        "transformers_version": v("transformers"),
        "python_version": platform.python_version(),
        "created_at": datetime.now(timezone.utc).isoformat(),
    }


@dataclass
class _Segment:
    close_before: bool
    row_lo: int  # rows of the batch array this segment writes
    row_hi: int


class _Stream:
    """One shard stream: a set of files ("slots", one per layer or a single one) cut at the same rows."""

    def __init__(
        self,
        name: str,
        slots: list[str],
        specs: Callable[[str], list[TensorSpec]],
        cap_rows: int,
        staging: Path,
        checksums: bool,
        executor: ThreadPoolExecutor,
        metadata: dict[str, str],
        fsync: bool = False,
    ):
        self.name = name
        self.slots = slots
        self.specs = specs  # slot -> one TensorSpec per tensor of the slot's file
        self.cap_rows = cap_rows
        self.staging = staging
        self.checksums = checksums
        self.executor = executor
        self.metadata = metadata
        self.fsync = fsync
        self.shard = 0  # index (within this stream) of the shard being filled
        self.rows = 0
        self.prompts = 0
        self.writers: dict[str, StreamingSafetensorsWriter] = {}
        self.closed: list[dict] = []
        self.futures: dict[tuple[int, str], Future] = {}
        self.obsolete: list[Path] = []  # side files of closed shards, deleted after the next checkpoint

    def staging_name(self, slot: str, shard: int) -> str:
        return f"{self.name}-{slot}-{shard:06d}.safetensors"

    def plan(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[_Segment]]:
        """Assign each prompt's ``counts[i]`` rows to (shard, offset); prompts never straddle shards."""
        if len(counts) and bool(np.all(counts == 1)):
            return self._plan_one_row_each(len(counts))
        shard_of = np.full(len(counts), -1, dtype=np.int64)
        offset_of = np.zeros(len(counts), dtype=np.int64)
        segments: list[_Segment] = []
        shard, rows, cursor = self.shard, self.rows, 0
        seg: _Segment | None = None
        for i, c in enumerate(counts.tolist()):
            if c == 0:
                continue
            close = rows > 0 and rows + c > self.cap_rows
            if close:
                shard, rows = shard + 1, 0
            if seg is None or close:
                seg = _Segment(close, cursor, cursor)
                segments.append(seg)
            shard_of[i], offset_of[i] = shard, rows
            rows += c
            cursor += c
            seg.row_hi = cursor
        return shard_of, offset_of, segments

    def _plan_one_row_each(self, n: int) -> tuple[np.ndarray, np.ndarray, list[_Segment]]:
        """``plan`` when every prompt has one row (last-token and logits streams), without a Python loop."""
        cap = self.cap_rows
        room = cap - self.rows  # rows left in the open shard (the whole cap when none is open)
        first = min(room, n)
        rest = np.arange(n - first, dtype=np.int64)
        shard_of = np.concatenate([np.full(first, self.shard, dtype=np.int64), self.shard + 1 + rest // cap])
        offset_of = np.concatenate([self.rows + np.arange(first, dtype=np.int64), rest % cap])
        segments = [_Segment(False, 0, first)] if first else []
        for lo in range(first, n, cap):
            segments.append(_Segment(True, lo, min(n, lo + cap)))
        return shard_of, offset_of, segments

    def write(self, segments: list[_Segment], arrays: dict[str, list[np.ndarray]], counts: np.ndarray,
              skip_last_of: np.ndarray | None = None) -> None:
        """Write planned segments; ``arrays[slot]`` lists one array per tensor spec.

        ``skip_last_of``: the arrays hold ``skip_last_of[i]`` rows per prompt, of which all but the
        last are this stream's (sequence shards): rows are written prompt by prompt, without a copy.
        """
        prompt_rows = np.cumsum(counts[counts > 0])
        if skip_last_of is not None:
            src_start = np.concatenate([[0], np.cumsum(skip_last_of)[:-1]])[counts > 0]
            dst_start = np.concatenate([[0], prompt_rows[:-1]])
        for seg in segments:
            if seg.close_before:
                self.close_shard()
            if not self.writers:
                for slot in self.slots:
                    self.writers[slot] = StreamingSafetensorsWriter(
                        self.staging / self.staging_name(slot, self.shard),
                        self.specs(slot),
                        metadata=self.metadata,
                    )
            for slot in self.slots:
                if skip_last_of is None:
                    self.writers[slot].append([a[seg.row_lo : seg.row_hi] for a in arrays[slot]])
                    continue
                first = int(np.searchsorted(dst_start, seg.row_lo))
                last = int(np.searchsorted(dst_start, seg.row_hi))
                for j in range(first, last):
                    n_rows = int(prompt_rows[j] - dst_start[j])
                    self.writers[slot].append([a[src_start[j] : src_start[j] + n_rows] for a in arrays[slot]])
            n_prompts = int(np.searchsorted(prompt_rows, seg.row_hi, "right")) - int(
                np.searchsorted(prompt_rows, seg.row_lo, "right")
            )
            self.rows += seg.row_hi - seg.row_lo
            self.prompts += n_prompts

    def close_shard(self) -> None:
        if not self.writers:
            return
        files = {}
        for slot, w in self.writers.items():
            self.obsolete += w.side_paths
            size = w.finish(fsync=self.fsync)
            staged = self.staging / self.staging_name(slot, self.shard)
            files[slot] = {"bytes": size, "staging": staged.name}
            if self.checksums:
                self.futures[(self.shard, slot)] = self.executor.submit(sha256_file, staged)
        self.closed.append({"num_prompts": self.prompts, "num_tokens": self.rows, "files": files})
        self.writers = {}
        self.shard += 1
        self.rows = 0
        self.prompts = 0

    def resolve_hashes(self) -> None:
        for (shard, slot), fut in list(self.futures.items()):
            self.closed[shard]["files"][slot]["sha256"] = fut.result()
            del self.futures[(shard, slot)]

    def flush(self) -> None:
        for w in self.writers.values():
            w.flush(fsync=self.fsync)

    def state(self) -> dict:
        return {"shard": self.shard, "rows": self.rows, "prompts": self.prompts, "closed": self.closed}

    def restore(self, st: dict) -> None:
        self.shard, self.rows, self.prompts = st["shard"], st["rows"], st["prompts"]
        self.closed = st["closed"]
        if self.rows:
            for slot in self.slots:
                self.writers[slot] = StreamingSafetensorsWriter(
                    self.staging / self.staging_name(slot, self.shard),
                    self.specs(slot),
                    metadata=self.metadata,
                    resume_rows=self.rows,
                )

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()
        self.writers = {}


class DatasetWriter:
    """Write an lmprobe format 2.0 dataset, batch by batch.

    >>> import numpy as np, tempfile
    >>> out = tempfile.mkdtemp()
    >>> with DatasetWriter(out, layers=[0, 1], dim=4, model_name="demo") as w:
    ...     w.add_batch(texts=["a b", "c"], num_tokens=[2, 1],
    ...                 hidden={0: np.zeros((2, 4)), 1: np.ones((2, 4))})
    >>> import lmprobe
    >>> lmprobe.load(out).hidden(1).shape
    (2, 4)

    ``hidden`` maps each layer to a (batch, dim) array for pooled storage, or to the batch's tokens
    packed prompt after prompt, (sum(num_tokens), dim), for full_sequence storage.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        layers: Sequence[int],
        dim: int,
        model_name: str,
        model_revision: str | None = None,
        storage: Literal["pooled", "full_sequence"] = "pooled",
        dtype: Literal["float32", "float16", "bfloat16"] = "float32",
        shard_size: int | str = DEFAULT_SHARD_SIZE,
        logits_k: int | None = None,
        label_type: Literal["int", "string"] | None = None,
        columns: Mapping[str, str | pa.DataType] | None = None,
        perplexity: bool = False,
        token_ids: bool = False,
        token_strings: bool = False,
        token_perplexity: bool = False,
        prompt_ordering: str = "input",
        provenance: Mapping[str, Any] | None = None,
        extra_info: Mapping[str, Any] | None = None,
        fingerprint: Mapping[str, Any] | None = None,
        file_pattern: str = DEFAULT_HIDDEN_FILE_PATTERN,
        key_pattern: str = DEFAULT_HIDDEN_KEY_PATTERN,
        logits_file_pattern: str = DEFAULT_LOGITS_FILE_PATTERN,
        checksums: bool = True,
        fsync: bool = False,
        statistics: bool = False,
        on_file_complete: Callable[[str], None] | None = None,
        resume: bool = True,
        overwrite: bool = False,
        checkpoint_interval: float = 30.0,
    ):
        # --- check the configuration before touching the disk
        layers = [int(x) for x in layers]
        if not layers or any(x < 0 for x in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"layers must be distinct non-negative integers, got {layers}")
        if not isinstance(dim, (int, np.integer)) or dim <= 0:
            raise ValueError(f"dim must be a positive integer, got {dim!r}")
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
        if dtype not in HIDDEN_DTYPES:
            raise ValueError(f"dtype must be one of {HIDDEN_DTYPES}, got {dtype!r}")
        if logits_k is not None and (not isinstance(logits_k, (int, np.integer)) or logits_k <= 0):
            raise ValueError(f"logits_k must be a positive integer or None, got {logits_k!r}")
        if label_type not in (None, "int", "string"):
            raise ValueError(f"label_type must be 'int', 'string' or None, got {label_type!r}")
        if not isinstance(model_name, str) or not model_name:
            raise ValueError("model_name must be a non-empty string")
        check_pattern(file_pattern, ("layer", "shard"), "file_pattern")
        check_pattern(key_pattern, ("layer",), "key_pattern")
        check_pattern(logits_file_pattern, ("shard",), "logits_file_pattern")
        for f in ("layer", "shard"):
            if "{" + f not in file_pattern:
                raise ValueError(f"file_pattern {file_pattern!r} must use {{{f}}} so that every shard has its own file")
        if "{shard" not in logits_file_pattern:
            raise ValueError(f"logits_file_pattern {logits_file_pattern!r} must use {{shard}}")
        self.columns: dict[str, str] = {}
        for name, t in (columns or {}).items():
            if name in RESERVED_COLUMNS:
                raise ValueError(f"user column {name!r} collides with a column of the format; rename it")
            self.columns[name] = column_type_name(t)

        self.out_dir = Path(out_dir)
        self.layers = layers
        self.dim = int(dim)
        self.storage = storage
        self.dtype = dtype
        self.shard_size = parse_size(shard_size)
        self.logits_k = int(logits_k) if logits_k else None
        self.label_type = label_type
        self.flags = {
            "perplexity": bool(perplexity),
            "token_ids": bool(token_ids),
            "token_strings": bool(token_strings),
            "token_perplexity": bool(token_perplexity),
        }
        self.file_pattern = file_pattern
        self.key_pattern = key_pattern
        self.logits_file_pattern = logits_file_pattern
        self.model = {"name": model_name, "revision": model_revision}
        self.prompt_ordering = prompt_ordering
        self.provenance = {**default_provenance(), **dict(provenance or {})}
        self.extra_info = dict(extra_info or {})
        self.checksums = checksums
        self.fsync = fsync
        self.statistics = bool(statistics)
        self.on_file_complete = on_file_complete  # called with each shard's path once it is final
        from .statistics import RunningStats

        self._stats = {layer: RunningStats.empty(self.dim) for layer in layers} if self.statistics else {}
        self.checkpoint_interval = float(checkpoint_interval)
        self.row_bytes = self.dim * DTYPES[dtype].itemsize
        self.fingerprint = self._fingerprint(fingerprint)

        self.staging = self.out_dir / STAGING_DIR
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmprobe-sha256")
        self._pending: dict[str, list] = {c: [] for c in self._staging_schema().names}
        self._n_pending = 0
        self.num_prompts = 0
        self._n_parts = 0
        self._phase = "writing"
        self._closed = False
        self._last_checkpoint = time.monotonic()

        st_meta = {"format": "pt"}
        cap = max(1, self.shard_size // self.row_bytes)
        def hidden_spec(slot: str) -> list[TensorSpec]:  # slots are layer numbers
            return [TensorSpec(key_pattern.format(layer=int(slot)), dtype, (self.dim,))]

        slots = [str(x) for x in layers]
        self._last = _Stream("last", slots, hidden_spec, cap, self.staging, checksums, self._executor, st_meta, fsync)
        self._seq = (
            _Stream("seq", slots, hidden_spec, cap, self.staging, checksums, self._executor, st_meta, fsync)
            if storage == "full_sequence"
            else None
        )
        self._logits = None
        if self.logits_k:
            k = self.logits_k

            def specs(slot: str) -> list[TensorSpec]:
                return [TensorSpec(LOGITS_VALUES_KEY, "float32", (k,)), TensorSpec(LOGITS_INDICES_KEY, "int32", (k,))]

            lcap = max(1, self.shard_size // (8 * self.logits_k))
            self._logits = _Stream("logits", ["all"], specs, lcap, self.staging, checksums, self._executor, st_meta, fsync)

        self._prepare_output(resume=resume, overwrite=overwrite)

    # ------------------------------------------------------------------ configuration

    def _fingerprint(self, extra: Mapping[str, Any] | None) -> dict:
        fp = {
            "format_version": FORMAT_VERSION,
            "layers": self.layers,
            "dim": self.dim,
            "storage": self.storage,
            "dtype": self.dtype,
            "shard_size": self.shard_size,
            "logits_k": self.logits_k,
            "label_type": self.label_type,
            "columns": self.columns,
            "file_pattern": self.file_pattern,
            "key_pattern": self.key_pattern,
            "logits_file_pattern": self.logits_file_pattern,
            "model": self.model,
            **self.flags,
            "statistics": self.statistics,
        }
        if extra:
            fp["caller"] = json.loads(json.dumps(dict(extra), default=str))
        return fp

    def _staging_schema(self) -> pa.Schema:
        fields = [
            ("text", pa.string()),
            ("label", pa.string() if self.label_type == "string" else pa.int32()),
            ("num_tokens", pa.int32()),
            ("shard_index", pa.int32()),
            ("row_offset", pa.int32()),
        ]
        if self.storage == "full_sequence":
            fields += [("_seq_shard", pa.int32()), ("_seq_offset", pa.int64())]
        if self.logits_k:
            fields += [("shard_index_logits", pa.int32()), ("row_offset_logits", pa.int32())]
        if self.flags["perplexity"]:
            fields += [(c, pa.float64()) for c in ("perplexity_mean", "perplexity_min", "perplexity_max")]
        if self.flags["token_ids"]:
            fields.append(("token_ids", pa.list_(pa.int64())))
        if self.flags["token_perplexity"]:
            fields.append(("token_perplexity", pa.list_(pa.float64())))
        if self.flags["token_strings"]:
            fields.append(("token_strings", pa.list_(pa.string())))
        fields += [(name, COLUMN_TYPES[t]) for name, t in self.columns.items()]
        fields.append(("_position", pa.int64()))
        return pa.schema(fields)

    def _final_schema(self) -> pa.Schema:
        fields = []
        for f in self._staging_schema():
            if f.name == "_seq_shard":
                fields += [
                    pa.field("token_offset", pa.int64()),
                    pa.field("token_shard_ids", pa.list_(pa.int64())),
                    pa.field("token_shard_offsets", pa.list_(pa.int64())),
                ]
            elif f.name not in ("_seq_offset", "_position"):
                fields.append(f)
        return pa.schema(fields)

    # ------------------------------------------------------------------ output folder states

    def _prepare_output(self, *, resume: bool, overwrite: bool) -> None:
        out = self.out_dir
        state_path = self.staging / "state.json"
        if (out / INDEX_PATH).exists():
            if not overwrite:
                raise OutputExistsError(
                    f"{out} already holds a complete lmprobe dataset; pass overwrite=True "
                    "(--overwrite) to replace it, or choose another output folder"
                )
            self._remove_previous()
        elif state_path.exists():
            if overwrite:
                self._remove_previous()
            elif not resume:
                raise OutputExistsError(
                    f"{out} holds a partial dataset from an interrupted run; resume it, or pass "
                    "overwrite=True (--overwrite) to start over"
                )
            else:
                self._restore(json.loads(state_path.read_text()))
                return
        elif out.exists() and not out.is_dir():
            raise OutputExistsError(f"{out} exists and is not a folder; choose a new or empty folder")
        elif out.exists() and any(p.name != STAGING_DIR for p in out.iterdir()):
            raise OutputExistsError(
                f"{out} is not empty and holds no lmprobe dataset; choose an empty or new folder"
            )
        if self.staging.exists():
            shutil.rmtree(self.staging)  # a run that died before its first checkpoint: nothing to keep
        (self.staging / "index").mkdir(parents=True)

    def _remove_previous(self) -> None:
        """Delete what an earlier lmprobe run wrote here (and nothing else)."""
        out = self.out_dir
        victims: list[Path] = []
        index = out / INDEX_PATH
        if index.exists():
            try:
                info = parse_info(decode_schema_metadata(pq.read_schema(index).metadata))
            except (FormatError, OSError, pa.ArrowInvalid):
                info = None
            if info and info.hidden:
                victims += [
                    out / info.hidden.file(layer, s) for layer in info.hidden.layers for s in range(len(info.hidden.shards))
                ]
            if info and info.logits:
                victims += [out / info.logits.file(s) for s in range(len(info.logits.shards))]
            stats = (info.raw.get("tensors") or {}).get("statistics") if info else None
            if isinstance(stats, dict) and isinstance(stats.get("file"), str):
                victims.append(out / stats["file"])
            victims += [index, out / CARD_PATH]
        state_path = self.staging / "state.json"
        if state_path.exists():
            st = json.loads(state_path.read_text())
            for _stream, finals in self._final_names_from_state(st):
                victims += [out / f for f in finals]
        for v in victims:
            if v.is_file() and (v.resolve().parent == out.resolve() or out.resolve() in v.resolve().parents):
                v.unlink()
        if self.staging.exists():
            shutil.rmtree(self.staging)

    def _final_names_from_state(self, st: dict):
        for name in ("last", "logits"):
            for shard, d in enumerate(st["streams"].get(name, {}).get("closed", [])):
                yield name, [self._final_name(name, slot, shard) for slot in d["files"]]

    def _final_name(self, stream: str, slot: str, shard: int) -> str:
        if stream == "logits":
            return format_relpath(self.logits_file_pattern, "logits_file_pattern", shard=shard)
        return format_relpath(self.file_pattern, "file_pattern", layer=int(slot), shard=shard)

    def _restore(self, st: dict) -> None:
        if st.get("version") != STATE_VERSION:
            raise ResumeMismatchError(f"{self.staging}/state.json was written by another lmprobe version; pass overwrite=True")
        old = st["fingerprint"]
        if old != self.fingerprint:
            keys = sorted(k for k in set(old) | set(self.fingerprint) if old.get(k) != self.fingerprint.get(k))
            details = "; ".join(f"{k}: was {old.get(k)!r}, now {self.fingerprint.get(k)!r}" for k in keys)
            raise ResumeMismatchError(
                f"{self.out_dir} holds a partial dataset written with a different configuration ({details}); "
                "re-run with the original settings to resume, or pass overwrite=True (--overwrite) to start over"
            )
        self.num_prompts = st["num_prompts"]
        self._n_parts = st["index_parts"]
        self._phase = st["phase"]
        self.provenance["created_at"] = st.get("created_at", self.provenance["created_at"])
        # parts written after the checkpoint do not count
        for p in (self.staging / "index").glob("part-*.parquet"):
            if int(p.stem.split("-")[1]) >= self._n_parts:
                p.unlink()
        for p in self.staging.glob("*.tmp"):
            p.unlink()
        for stream in self._streams():
            stream.restore(st["streams"][stream.name])
        self._stats_file = st.get("statistics_file")
        if self._stats and self._stats_file:
            from .statistics import load_accumulators

            self._stats = load_accumulators(self.staging / self._stats_file, self.layers)
            self._ckpt_id = int(self._stats_file.split("-")[1].split(".")[0])
        # keep staged shards the checkpoint knows about; drop ones closed after it
        known = {f["staging"] for s in self._streams() for d in s.closed for f in d["files"].values()}
        open_names = {s.staging_name(slot, s.shard) for s in self._streams() if s.rows for slot in s.slots}
        known |= open_names | {f"{n}.t1" for n in open_names}
        if st.get("statistics_file"):
            known.add(st["statistics_file"])
        for p in self.staging.glob("*.safetensors*"):
            if p.name not in known:
                p.unlink()
        self._publish_closed()

    def _streams(self) -> list[_Stream]:
        return [s for s in (self._last, self._seq, self._logits) if s is not None]

    # ------------------------------------------------------------------ adding data

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add(self, *, text: str, hidden: Mapping[int, Any], num_tokens: int, label: Any = None, **kw: Any) -> None:
        """Add one prompt; ``hidden[layer]`` is (dim,) pooled or (num_tokens, dim) full-sequence.

        Other keyword arguments are those of ``add_batch`` for a single prompt (``logits_values``
        (k,), ``token_ids`` list, ``columns`` dict of scalars, ...).
        """
        batch: dict[str, Any] = {}
        for k, v in kw.items():
            if k == "columns":
                batch[k] = {c: [x] for c, x in (v or {}).items()}
            elif k in ("logits_values", "logits_indices"):
                batch[k] = to_numpy(v)[None] if v is not None else None
            else:
                batch[k] = [v]
        hidden_b = {
            layer: (to_numpy(h)[None] if self.storage == "pooled" else h) for layer, h in hidden.items()
        }
        self.add_batch(texts=[text], hidden=hidden_b, num_tokens=[num_tokens], labels=[label], **batch)

    def add_batch(
        self,
        *,
        texts: Sequence[str],
        hidden: Mapping[int, Any],
        num_tokens: Sequence[int],
        labels: Sequence[Any] | None = None,
        columns: Mapping[str, Sequence[Any]] | None = None,
        logits_values: Any = None,
        logits_indices: Any = None,
        perplexity_mean: Sequence[float] | None = None,
        perplexity_min: Sequence[float] | None = None,
        perplexity_max: Sequence[float] | None = None,
        token_ids: Sequence[Sequence[int]] | None = None,
        token_strings: Sequence[Sequence[str]] | None = None,
        token_perplexity: Sequence[Sequence[float]] | None = None,
        positions: Sequence[int] | None = None,
    ) -> None:
        """Add a batch of prompts. Everything is checked before any byte of the batch is written.

        ``positions`` gives each prompt's row in the final index when prompts arrive out of order
        (extraction sorts them by length); the index is then sorted by it when the dataset closes,
        and the positions of all batches must form 0..N-1. By default prompts keep arrival order.
        """
        if self._closed:
            raise RuntimeError("this DatasetWriter is closed")
        if self._phase != "writing":
            raise RuntimeError("this dataset is already being finalized; call close()")
        b = len(texts)
        base = self.num_prompts
        counts = np.asarray(num_tokens, dtype=np.int64)
        if counts.shape != (b,):
            raise ValueError(f"num_tokens has {counts.size} entries for {b} texts")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ColumnTypeError(f"row {base + i}, column 'text': expected a string, got {type(t).__name__}")
        if b and counts.min() < 1:
            i = int(np.argmin(counts))
            raise ValueError(f"row {base + i}: num_tokens must be >= 1, got {counts[i]}")

        if positions is None:
            pos = list(range(base, base + b))
        else:
            pos = [int(x) for x in to_numpy(positions).reshape(-1).tolist()]
            if len(pos) != b or (b and min(pos) < 0):
                raise ValueError(f"positions must hold {b} non-negative row numbers")
        label_vals = self._check_labels(labels, b, base)
        user = self._check_columns(columns, b, base)
        arrays = self._check_hidden(hidden, counts, base)
        logits = self._check_logits(logits_values, logits_indices, b)
        extras = self._check_extras(
            b, base, counts, perplexity_mean, perplexity_min, perplexity_max, token_ids, token_strings, token_perplexity
        )
        if b == 0:
            return

        # --- write: last-token rows, then the other tokens, then logits
        ones = np.ones(b, dtype=np.int64)
        if self.storage == "pooled":
            last_rows = arrays
        else:
            ends = np.cumsum(counts) - 1
            last_rows = {layer: a[ends] for layer, a in arrays.items()}
        shard_of, offset_of, segs = self._last.plan(ones)
        self._last.write(segs, {str(layer): [a] for layer, a in last_rows.items()}, ones)
        cols = self._pending
        cols["shard_index"] += shard_of.tolist()
        cols["row_offset"] += offset_of.tolist()
        if self._seq is not None:
            seq_counts = counts - 1
            sshard, soff, ssegs = self._seq.plan(seq_counts)
            self._seq.write(ssegs, {str(layer): [a] for layer, a in arrays.items()}, seq_counts,
                            skip_last_of=counts)
            cols["_seq_shard"] += sshard.tolist()
            cols["_seq_offset"] += soff.tolist()
        if self._logits is not None:
            lshard, loff, lsegs = self._logits.plan(ones)
            self._logits.write(lsegs, {"all": list(logits)}, ones)
            cols["shard_index_logits"] += lshard.tolist()
            cols["row_offset_logits"] += loff.tolist()
        if self._stats:
            from .statistics import RunningStats
            from .values import bfloat16_bits_to_float32

            for layer, a in arrays.items():  # every stored vector: last tokens, and the others when kept
                x = bfloat16_bits_to_float32(a) if self.dtype == "bfloat16" else a
                self._stats[layer] = self._stats[layer].merge(RunningStats.of(x))
        cols["text"] += list(texts)
        cols["label"] += label_vals
        cols["num_tokens"] += counts.tolist()
        cols["_position"] += pos
        for name, vals in {**extras, **user}.items():
            cols[name] += vals
        self.num_prompts += b
        self._n_pending += b
        if (
            time.monotonic() - self._last_checkpoint >= self.checkpoint_interval
            or self._n_pending >= _MAX_PENDING_ROWS
        ):
            self.checkpoint()

    def _check_labels(self, labels: Sequence[Any] | None, b: int, base: int) -> list:
        if labels is None:
            if self.label_type is not None:
                raise ValueError(f"this dataset has {self.label_type} labels; pass labels= for every batch")
            return [None] * b
        if len(labels) != b:
            raise ValueError(f"labels has {len(labels)} entries for {b} texts")
        kind = "int32" if self.label_type in (None, "int") else "string"
        out = [check_value(v, kind, row=base + i, column="label") for i, v in enumerate(labels)]
        if self.label_type is None and any(v is not None for v in out):
            raise ValueError("labels were given but the writer was created with label_type=None; pass label_type='int' or 'string'")
        return out

    def _check_columns(self, columns: Mapping[str, Sequence[Any]] | None, b: int, base: int) -> dict[str, list]:
        columns = dict(columns or {})
        unknown = set(columns) - set(self.columns)
        if unknown:
            raise ColumnTypeError(
                f"unknown user column(s) {sorted(unknown)}; declare them with columns={{name: type}} "
                "when creating the writer"
            )
        out = {}
        for name, t in self.columns.items():
            vals = columns.get(name)
            if vals is None:
                out[name] = [None] * b
                continue
            if len(vals) != b:
                raise ValueError(f"column {name!r} has {len(vals)} values for {b} texts")
            out[name] = [check_value(v, t, row=base + i, column=name) for i, v in enumerate(vals)]
        return out

    def _check_hidden(self, hidden: Mapping[int, Any], counts: np.ndarray, base: int) -> dict[int, np.ndarray]:
        missing = [x for x in self.layers if x not in hidden]
        extra = [x for x in hidden if x not in self.layers]
        if missing or extra:
            raise ValueError(f"hidden must hold exactly layers {self.layers}; missing {missing}, unexpected {extra}")
        rows = len(counts) if self.storage == "pooled" else int(counts.sum())
        out = {}
        for layer in self.layers:
            a = to_storage(hidden[layer], self.dtype)
            if a.shape != (rows, self.dim):
                what = "(batch, dim)" if self.storage == "pooled" else "(sum(num_tokens), dim)"
                raise ValueError(
                    f"hidden[{layer}] has shape {tuple(a.shape)}; expected {what} = {(rows, self.dim)} "
                    f"for prompts {base}..{base + len(counts) - 1}"
                )
            out[layer] = a
        return out

    def _check_logits(self, values: Any, indices: Any, b: int) -> tuple[np.ndarray, np.ndarray] | None:
        if self.logits_k is None:
            if values is not None or indices is not None:
                raise ValueError("logits were given but the writer was created without logits_k")
            return None
        if values is None or indices is None:
            raise ValueError(f"this dataset stores top-{self.logits_k} logits; pass logits_values and logits_indices")
        v = np.ascontiguousarray(to_numpy(values), dtype=np.float32)
        ix = to_numpy(indices)
        if ix.dtype.kind not in "iu":
            raise TypeError(f"logits_indices must be integers, got {ix.dtype}")
        if v.shape != (b, self.logits_k) or ix.shape != (b, self.logits_k):
            raise ValueError(
                f"logits_values/logits_indices have shapes {v.shape}/{ix.shape}; expected {(b, self.logits_k)}"
            )
        if ix.size and (ix.min() < 0 or ix.max() > np.iinfo(np.int32).max):
            raise ValueError("logits_indices must fit in int32")
        return v, np.ascontiguousarray(ix, dtype=np.int32)

    def _check_extras(self, b, base, counts, p_mean, p_min, p_max, token_ids, token_strings, token_ppl) -> dict:
        out: dict[str, list] = {}
        given = {"perplexity_mean": p_mean, "perplexity_min": p_min, "perplexity_max": p_max}
        if self.flags["perplexity"]:
            for name, vals in given.items():
                if vals is None:
                    raise ValueError(f"this dataset stores perplexity; pass {name}")
                vals = [float(x) for x in to_numpy(vals).reshape(-1).tolist()]
                if len(vals) != b:
                    raise ValueError(f"{name} has {len(vals)} values for {b} texts")
                out[name] = vals
        elif any(v is not None for v in given.values()):
            raise ValueError("perplexity values were given but the writer was created with perplexity=False")
        lists = {
            "token_ids": (token_ids, 0, int),
            "token_strings": (token_strings, 0, str),
            "token_perplexity": (token_ppl, 1, float),
        }
        for name, (vals, short, conv) in lists.items():
            if not self.flags[name]:
                if vals is not None:
                    raise ValueError(f"{name} were given but the writer was created with {name}=False")
                continue
            if vals is None:
                raise ValueError(f"this dataset stores {name}; pass {name}")
            if len(vals) != b:
                raise ValueError(f"{name} has {len(vals)} entries for {b} texts")
            rows = []
            for i, seq in enumerate(vals):
                seq = to_numpy(seq).tolist() if not isinstance(seq, list) else seq
                want = int(counts[i]) - short
                if len(seq) != want:
                    raise ValueError(
                        f"row {base + i}: {name} has {len(seq)} entries, expected {want} "
                        f"(num_tokens{' - 1' if short else ''})"
                    )
                rows.append([conv(x) for x in seq])
            out[name] = rows
        return out

    # ------------------------------------------------------------------ checkpoints and closing

    def checkpoint(self) -> None:
        """Make everything added so far durable: a crash after this resumes from here."""
        for s in self._streams():
            s.flush()
            s.resolve_hashes()
        if self._n_pending:
            table = pa.table(self._pending, schema=self._staging_schema())
            part = self.staging / "index" / f"part-{self._n_parts:06d}.parquet"
            pq.write_table(table, part.with_name(part.name + ".tmp"))
            os.replace(part.with_name(part.name + ".tmp"), part)
            self._n_parts += 1
            self._pending = {c: [] for c in self._pending}
            self._n_pending = 0
        stats_name = None
        if self._stats:
            from .statistics import save_accumulators

            # named per checkpoint: a crash between this file and state.json must not pair the old
            # state with newer statistics
            self._ckpt_id = getattr(self, "_ckpt_id", 0) + 1
            stats_name = f"statistics-{self._ckpt_id:08d}.safetensors"
            save_accumulators(self.staging / stats_name, self._stats)
        state = {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "num_prompts": self.num_prompts,
            "index_parts": self._n_parts,
            "phase": self._phase,
            "created_at": self.provenance["created_at"],
            "streams": {s.name: s.state() for s in self._streams()},
            "statistics_file": stats_name,
        }
        _atomic_write_bytes(self.staging / "state.json", json.dumps(state).encode(), self.fsync)
        for s in self._streams():
            for p in s.obsolete:
                p.unlink(missing_ok=True)
            s.obsolete = []
        for p in self.staging.glob("statistics-*.safetensors"):
            if p.name != stats_name:
                p.unlink(missing_ok=True)
        self._publish_closed()
        self._last_checkpoint = time.monotonic()

    def _publish_closed(self) -> None:
        """Move closed last-token and logits shards to their final names (idempotent)."""
        for s in (self._last, self._logits):
            if s is None:
                continue
            for shard, d in enumerate(s.closed):
                for slot, f in d["files"].items():
                    src = self.staging / f["staging"]
                    if src.exists():
                        rel = self._final_name(s.name, slot, shard)
                        dst = self.out_dir / rel
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        os.replace(src, dst)
                        if self.on_file_complete is not None:
                            self.on_file_complete(rel)

    def close(self) -> Path:
        """Finish every shard, write the card and, last, the index. Returns the dataset folder."""
        if self._closed:
            return self.out_dir
        if self._phase == "writing":
            for s in self._streams():
                s.close_shard()
            self._phase = "finalizing"
            self.checkpoint()
        self._finalize()
        self._closed = True
        self._executor.shutdown()
        return self.out_dir

    def abort(self) -> None:
        """Stop without finalizing; the folder stays resumable from the last checkpoint."""
        for s in self._streams():
            s.abort()
        self._executor.shutdown(wait=True)
        self._closed = True

    def _finalize(self) -> None:
        n_last = len(self._last.closed)
        seq_closed = self._seq.closed if self._seq else []
        for j, d in enumerate(seq_closed):
            for slot, f in d["files"].items():
                src = self.staging / f["staging"]
                rel = self._final_name("seq", slot, n_last + j)
                dst = self.out_dir / rel
                if src.exists():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(src, dst)
                    if self.on_file_complete is not None:
                        self.on_file_complete(rel)
                elif not dst.exists():
                    raise FormatError(f"sequence shard {dst} is missing; the partial output is damaged, pass overwrite=True")
        stats_desc = self._write_statistics() if self._stats else None
        if stats_desc and self.on_file_complete is not None:
            self.on_file_complete(stats_desc["file"])
        info = self._info(n_last, seq_closed)
        if stats_desc:
            info["tensors"]["statistics"] = stats_desc
        card_text = card.render_card(info, self._final_schema())
        _atomic_write_bytes(self.out_dir / CARD_PATH, card_text.encode(), self.fsync)
        self._write_index(info, n_last)
        shutil.rmtree(self.staging, ignore_errors=True)

    def _write_statistics(self) -> dict:
        from .statistics import KEY_PATTERN, STATS_FILE, save_stats

        final = self.out_dir / STATS_FILE
        final.parent.mkdir(parents=True, exist_ok=True)
        save_stats(final, self._stats)
        desc = {
            "type": "statistics",
            "file": STATS_FILE,
            "layers": self.layers,
            "key_pattern": KEY_PATTERN,
            "stats": ["count", "mean", "std", "mean_norm"],
            "over": "every stored vector" + (" (all tokens)" if self.storage == "full_sequence" else " (last tokens)"),
            "ddof": 0,
            "dtype": "float64",
            "bytes": final.stat().st_size,
        }
        if self.checksums:
            desc["sha256"] = sha256_file(final)
        return desc

    def _shard_descriptor(self, d: dict, *, tokens: bool, stream: str, shard: int) -> dict:
        out: dict[str, Any] = {"num_prompts": d["num_prompts"]}
        if tokens:
            out["num_tokens"] = d["num_tokens"]
        files = {slot: {k: v for k, v in f.items() if k != "staging"} for slot, f in d["files"].items()}
        if stream == "logits":
            out = {"file": self._final_name("logits", "all", shard), **out, **files["all"]}
        else:
            out["files"] = files
        return out

    def _info(self, n_last: int, seq_closed: list[dict]) -> dict:
        full = self.storage == "full_sequence"
        shards = [self._shard_descriptor(d, tokens=full, stream="last", shard=i) for i, d in enumerate(self._last.closed)]
        shards += [self._shard_descriptor(d, tokens=True, stream="seq", shard=n_last + j) for j, d in enumerate(seq_closed)]
        hidden: dict[str, Any] = {
            "type": "hidden",
            "layers": self.layers,
            "dim": self.dim,
            "dtype": self.dtype,
            "layout": "per_layer",
            "file_pattern": self.file_pattern,
            "key_pattern": self.key_pattern,
            "storage": self.storage,
        }
        if full:
            hidden["last_token_shards"] = n_last
        else:
            hidden["pooling"] = "last_token"
        hidden["row_bytes"] = self.row_bytes
        hidden["shards"] = shards
        tensors: dict[str, Any] = {"hidden_layers": hidden}
        if self._logits is not None:
            tensors["logits_topk"] = {
                "type": "logits_topk",
                "k": self.logits_k,
                "dtype": "float32",
                "indices_dtype": "int32",
                "keys": {"values": LOGITS_VALUES_KEY, "indices": LOGITS_INDICES_KEY},
                "pooling": "last_token",
                "file_pattern": self.logits_file_pattern,
                "row_bytes": 8 * self.logits_k,
                "shards": [
                    self._shard_descriptor(d, tokens=False, stream="logits", shard=i)
                    for i, d in enumerate(self._logits.closed)
                ],
            }
        info = {
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "num_prompts": self.num_prompts,
            "prompt_ordering": self.prompt_ordering,
            "tensors": tensors,
            "provenance": self.provenance,
        }
        info.update(self.extra_info)
        return info

    def _write_index(self, info: dict, n_last: int) -> None:
        schema = self._final_schema().with_metadata(encode_schema_metadata(info))
        final = self.out_dir / INDEX_PATH
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + ".tmp")
        parts = sorted((self.staging / "index").glob("part-*.parquet"))
        positions = [pq.read_table(p, columns=["_position"]).column("_position").to_numpy() for p in parts]
        all_pos = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
        in_order = bool(np.array_equal(all_pos, np.arange(len(all_pos))))
        if not in_order and not np.array_equal(np.sort(all_pos), np.arange(len(all_pos))):
            raise FormatError(
                f"the positions given to add_batch do not form 0..{len(all_pos) - 1} (duplicates or gaps); "
                "the index cannot be ordered"
            )
        with pq.ParquetWriter(tmp, schema) as pw:
            if not in_order:
                # prompts arrived out of order: the index (one row per prompt) is sorted in memory
                whole = pa.concat_tables([self._finalize_part(pq.read_table(p), n_last, schema, keep_position=True)
                                          for p in parts])
                whole = whole.take(np.argsort(whole.column("_position").to_numpy(), kind="stable"))
                pw.write_table(whole.drop_columns(["_position"]), row_group_size=_ROW_GROUP_ROWS)
            else:
                batch: list[pa.Table] = []
                rows = 0
                for p in parts:
                    t = pq.read_table(p)
                    batch.append(self._finalize_part(t, n_last, schema))
                    rows += t.num_rows
                    if rows >= _ROW_GROUP_ROWS:
                        pw.write_table(pa.concat_tables(batch), row_group_size=_ROW_GROUP_ROWS)
                        batch, rows = [], 0
                if batch:
                    pw.write_table(pa.concat_tables(batch), row_group_size=_ROW_GROUP_ROWS)
            if not parts:
                pw.write_table(schema.empty_table())
        if self.fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, final)

    def _finalize_part(self, t: pa.Table, n_last: int, schema: pa.Schema, keep_position: bool = False) -> pa.Table:
        out = self._finalize_columns(t, n_last, schema)
        if keep_position:
            out = out.append_column("_position", t.column("_position"))
        return out

    def _finalize_columns(self, t: pa.Table, n_last: int, schema: pa.Schema) -> pa.Table:
        if self.storage != "full_sequence":
            return t.select(schema.names).cast(schema.remove_metadata())
        n = t.column("num_tokens").to_numpy().astype(np.int64)
        seq = t.column("_seq_shard").to_numpy().astype(np.int64)
        seq_off = t.column("_seq_offset").to_numpy().astype(np.int64)
        si = t.column("shard_index").to_numpy().astype(np.int64)
        ro = t.column("row_offset").to_numpy().astype(np.int64)
        list_offsets = np.zeros(len(n) + 1, dtype=np.int64)
        np.cumsum(n, out=list_offsets[1:])
        starts, ends = list_offsets[:-1], list_offsets[1:] - 1
        pos = np.arange(int(list_offsets[-1]), dtype=np.int64) - np.repeat(starts, n)
        ids = np.repeat(n_last + seq, n)
        offs = np.repeat(seq_off, n) + pos
        ids[ends] = si
        offs[ends] = ro
        cols = {name: t.column(name) for name in t.column_names if not name.startswith("_seq")}
        cols["token_offset"] = pa.array(ro)
        cols["token_shard_ids"] = pa.LargeListArray.from_arrays(list_offsets, ids).cast(pa.list_(pa.int64()))
        cols["token_shard_offsets"] = pa.LargeListArray.from_arrays(list_offsets, offs).cast(pa.list_(pa.int64()))
        return pa.table({name: cols[name] for name in schema.names}).cast(schema.remove_metadata())
