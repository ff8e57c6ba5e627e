"""The streaming dataset writer.

Data flows in batches of prompts. Hidden states, top-k logits and the index rows go to three
independent shard series (last-token, sequence, logits) whose files grow on disk as rows arrive,
so memory stays at one batch plus a small index buffer whatever the dataset size.

Crash safety: every file is written in ``.lmprobe-staging/`` and renamed into place; a checkpoint
(at most every ``checkpoint_interval`` seconds) syncs the open shards, writes the pending index
rows as a part file and then ``state.json``. An interrupted writer is reopened with the same
configuration and resumes at the last checkpoint: ``writer.num_prompts`` tells the caller where
to continue. The index is written last, so a folder with an index is a complete dataset.

The concerns live in their own modules: ``datasetspec`` (what the dataset stores), ``batch``
(checks), ``layout`` (shard planning, pure), ``shards`` (shard files), ``staging`` (folder states
and checkpoints), ``resume`` (reopening a partial output), ``refill`` (a checkpoint reopened on
another machine), ``index`` (the parquet index), ``metadata`` (the ``lmprobe:`` keys). What is left
here is past 600 lines on purpose: one object's state (the series, the pending index rows, the
statistics, the phase) that every method reads and changes together.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ..base.atomic import atomic_write, move_into_place
from ..base.lock import OutputLock
from ..base.paths import check_output_path, format_relpath
from ..errors import FormatError, InvalidArgumentError
from . import card, index
from .batch import check_batch, hidden_by_slot
from .datasetspec import DatasetSpec, renamed_keywords
from .dtypes import DTYPES
from .layout import plan
from .metadata import (
    build_hidden_descriptor,
    build_info,
    build_logits_descriptor,
    default_provenance,
    encode_schema_metadata,
)
from .refill import Refill
from .resume import (
    Checkpoint,
    Replay,
    check_progress,
    check_settings,
    open_output,
    read_checkpoint,
    refusing_damage,
)
from .safetensors_io import TensorSpec
from .shards import ShardSeries
from .spec import CARD_PATH, INDEX_PATH, LOGITS_INDICES_KEY, LOGITS_VALUES_KEY, hookpoint_tensor_name
from .staging import STATE_VERSION, Staging, provisional_name, remove_files_inside
from .statistics import RunningStats, load_accumulators, save_accumulators, write_statistics
from .values import one_torch_thread, to_numpy

_MAX_PENDING_ROWS = 65536
#: index rows wait in memory until a checkpoint writes them as a part: bounded by prompts and by tokens,
#: so that a part, and the memory to finalize it, stays small whatever the prompts' lengths. A corpus row holds
#: its window's text and, with token ids, 8 bytes a token: at 2^20 tokens a rank's writer grew 40-50 MiB
#: between 6 x 10^5 and 2.4 x 10^6 tokens (the buffer filling up) and its close 50-70 MiB more; at 2^18 it is
#: flat from 6 x 10^5 tokens on (docs/performance.md, "The merge and the index at scale")
_MAX_PENDING_TOKENS = 1 << 18
#: with ``on_file_complete`` (files that leave the machine), a checkpoint hands shards over as soon as this many
#: have closed since the last one, whatever the interval: local staging holds a few shards, not 30 s of them
_HANDOVER_SHARDS = 2


def _takes_keyword(fn: Callable | None, name: str) -> bool:
    if fn is None:
        return False
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


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

    What the dataset holds is a ``DatasetSpec``: given as ``spec``, or built from its fields given
    as keywords (``layers=[0, 1], dim=4, model_name="demo"`` above), never both. The other
    keywords are this session's options:

    - ``resume``: continue a partial dataset found in ``out_dir`` (written with the same spec and
      ``fingerprint``); ``overwrite``: replace what an earlier lmprobe run left there instead.
    - ``checkpoint_interval``: seconds between checkpoints (what a crash loses at most);
      ``fsync``: sync files to the disk at each checkpoint.
    - ``fingerprint``: the caller's settings, compared on resume like the spec's; ``resumable``:
      the names among them a resumed run may change.
    - ``run``: what this run writes with (batch size, device), listed per run in ``lmprobe:runs``;
      ``name``: what messages call the output (default: ``out_dir``).
    - ``on_file_complete(rel, sha256=None)``: called with the path, relative to ``out_dir``, of
      each shard and of the statistics file once it is final and will not change (with its
      SHA-256 when the callback takes a ``sha256`` keyword; None when not hashed). The writer no
      longer needs the file: the caller may copy it elsewhere and delete it (an upload). A
      checkpoint then waits for the hashes of closed shards, and hands files over as soon as a
      few have closed. The card and the index are not handed over: ``close`` writes them last.
    - ``on_file_renamed(old, new)`` (needs ``on_file_complete``): sequence shards, whose numbers
      are known only at the end, are then handed over as they close under provisional names
      (``tensors/.provisional/...``) and this callback says, when the dataset closes, which final
      name each one takes: the caller renames its copy.
    - ``on_checkpoint(staging, state, files)`` (needs ``on_file_complete``): called after each checkpoint with
      the staging folder, the state just written (its closed shards all hashed and handed over) and
      ``recorded_files()``, for a caller
      that keeps a copy of the checkpoint elsewhere. A writer reopened on such a copy without the open shards'
      partial files (they never leave the machine) recomputes them: ``refill_from`` is then the first prompt to
      give again, to ``refill_batch``, before ``add_batch`` continues at ``num_prompts``. A caller that
      reads its source in order (a corpus) gives again from ``replay`` instead (its rows, stored tokens and
      ``progress`` before the batch that opened the earliest open shard, as the checkpoint recorded them:
      at most ``refill_from``), in the batches it gave then.

    ``hidden`` maps each layer to a (batch, dim) array for pooled storage, or to the batch's tokens
    packed prompt after prompt, (sum(num_tokens), dim), for full_sequence storage.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        spec: DatasetSpec | None = None,
        *,
        resume: bool = True,
        overwrite: bool = False,
        checkpoint_interval: float = 30.0,
        fsync: bool = False,
        fingerprint: Mapping[str, Any] | None = None,
        resumable: Iterable[str] = (),
        run: Mapping[str, Any] | None = None,
        name: str | None = None,
        on_file_complete: Callable[..., None] | None = None,
        on_file_renamed: Callable[[str, str], None] | None = None,
        on_checkpoint: Callable[[Path, dict[str, Any], dict[str, tuple[int, str]]], None] | None = None,
        **fields: Any,
    ):
        # --- check the configuration before touching the disk
        if spec is None:
            spec = DatasetSpec(**renamed_keywords(fields, stacklevel=2))  # logits_k=: the old logits_topk=, warned
        elif fields:
            raise TypeError(f"DatasetWriter takes a DatasetSpec or its fields as keywords, not both (got a spec and "
                            f"{', '.join(sorted(fields))})")
        elif not isinstance(spec, DatasetSpec):
            raise TypeError(f"spec must be a DatasetSpec, got {type(spec).__name__}")
        self.spec = spec
        self.out_dir = Path(out_dir)
        # what messages call the output: the folder, or the remote output it is staged for
        self.name = name or str(self.out_dir)
        self.provenance = {**default_provenance(), **spec.provenance}
        self.fsync = fsync
        # called with each shard's path once it is final, and its sha256 (None: not hashed yet) when it takes a
        # ``sha256`` keyword: an upload then need not read the file to hash it again
        self.on_file_complete = on_file_complete
        self._complete_takes_sha256 = _takes_keyword(on_file_complete, "sha256")
        # with on_file_renamed too, sequence shards leave as they close, under provisional names (their numbers
        # follow the last-token shards', known only at the end), and are renamed where they went when it comes
        if on_file_renamed is not None and on_file_complete is None:
            raise InvalidArgumentError("on_file_renamed needs on_file_complete: it renames files handed over")
        self.on_file_renamed = on_file_renamed
        if on_checkpoint is not None and on_file_complete is None:
            raise InvalidArgumentError("on_checkpoint needs on_file_complete: it publishes a checkpoint of files handed over")
        self.on_checkpoint = on_checkpoint
        self._refill: Refill | None = None  # a checkpoint whose open shards are not on this machine (refill.py)
        self.checkpoint_interval = float(checkpoint_interval)
        self.fingerprint = spec.fingerprint()
        if fingerprint:
            self.fingerprint["caller"] = json.loads(json.dumps(dict(fingerprint), default=str))
        self.resumable = frozenset(resumable)
        # what this run writes with (batch size, device, ...): an output resumed under other such settings lists
        # every run, each with the first row it wrote, in `lmprobe:runs`
        self._run = json.loads(json.dumps(dict(run), default=str)) if run else None
        self.runs: list[dict[str, Any]] = []

        self.staging = Staging(self.out_dir, fsync=fsync)
        self._stats = ({slot: RunningStats.empty(spec.dim_of(hp)) for slot, (hp, _) in spec.sites.items()}
                       if spec.statistics else {})
        self._stats_checkpoint = 0
        self._stats_worker: ThreadPoolExecutor | None = None  # made when a batch comes without partials
        # one hashing thread per stored site, up to the cores but one: sha256 runs at ~1.3 GB/s a core, so
        # a GPU node writing several layers at ~1 GB/s each needs several (docs/performance.md)
        hashers = max(1, min(len(spec.sites) + (1 if spec.logits_topk else 0), (os.cpu_count() or 2) - 1))
        self._hasher = ThreadPoolExecutor(max_workers=hashers, thread_name_prefix="lmprobe-sha256")
        self._pending: dict[str, list] = {c: [] for c in index.staging_schema(spec).names}
        self._n_pending = 0
        self._n_pending_tokens = 0
        self.num_prompts = 0
        self.num_tokens = 0  # stored tokens (sum of num_tokens)
        self.progress: dict[str, int] | None = None  # the caller's position in its source (add_batch)
        # where each series' open shard can be recomputed from: the writer's (prompts, tokens, progress) before the
        # batch that opened it. A checkpoint records the earliest of the open ones (``replay``): a checkpoint copied
        # to another machine lacks its open shards, and a source read in order is replayed from there (refill.py)
        self._opened_at: dict[str, Replay] = {}
        self.replay: Replay | None = None  # a refill's: where the caller's source is to be replayed from
        self._n_parts = 0
        self._phase = "writing"
        self._closed = False
        self._last_checkpoint = time.monotonic()
        self._closed_at_checkpoint = 0

        self._open_series()
        check_output_path(self.out_dir)
        self._lock = OutputLock(self.out_dir).acquire()  # one writer per output, refused at once
        try:
            st = open_output(self.staging, resume=resume, overwrite=overwrite, shard_file=self._final_name)
            if st is not None:
                self._resume(st)
        except BaseException:
            self._release()
            raise
        if self._run is not None:
            if self.runs and self.runs[-1].get("first_row") == self.num_prompts:
                self.runs.pop()  # the run before wrote nothing: this one replaces it
            self.runs.append({"first_row": self.num_prompts, **self._run,
                              "started_at": datetime.now(timezone.utc).isoformat()})

    def _open_series(self) -> None:
        """The three shard series (last-token, sequence, logits), each writing its tensors' shards in staging."""
        spec = self.spec
        st_meta = {"format": "pt"}
        sites = spec.sites

        def hidden_spec(slot: str) -> list[TensorSpec]:  # a slot is one (hookpoint, layer)
            hp, layer = sites[slot]  # a scaled dtype's per-row scales go beside the codes (dtypes.scale_key)
            key = spec.patterns(hp)[1].format(layer=layer)
            return [TensorSpec(k, dt, shape) for k, dt, shape in DTYPES[spec.dtype].tensors(key, spec.dim_of(hp))]

        def series(name: str, slots: list[str], specs, cap: int) -> ShardSeries:
            return ShardSeries(name, slots, specs, cap, self.staging.path, checksums=spec.checksums,
                               hasher=self._hasher, metadata=st_meta, fsync=self.fsync)

        slots = list(sites)
        self._last = series("last", slots, hidden_spec, spec.rows_per_shard)
        self._seq = series("seq", slots, hidden_spec, spec.rows_per_shard) if spec.full_sequence else None
        self._logits = None
        if spec.logits_topk:
            k = spec.logits_topk

            def logits_spec(slot: str) -> list[TensorSpec]:
                return [TensorSpec(LOGITS_VALUES_KEY, "float32", (k,)), TensorSpec(LOGITS_INDICES_KEY, "int32", (k,))]

            self._logits = series("logits", ["all"], logits_spec, spec.logits_rows_per_shard)

    def _release(self) -> None:
        # after close() every hash is recorded; after abort() the pending ones are not needed (a resume
        # re-hashes what its checkpoint lacks)
        self._hasher.shutdown(wait=True, cancel_futures=True)
        if self._stats_worker is not None:
            self._stats_worker.shutdown(wait=True, cancel_futures=True)
        self._lock.release()

    # ------------------------------------------------------------------ the output folder

    def _series(self) -> list[ShardSeries]:
        return [s for s in (self._last, self._seq, self._logits) if s is not None]

    def _final_name(self, series: str, slot: str, shard: int) -> str:
        if series == "logits":
            return format_relpath(self.spec.logits_file_pattern, "logits_file_pattern", shard=shard)
        hp, layer = self.spec.sites[slot]
        return format_relpath(self.spec.patterns(hp)[0], "file_pattern", layer=layer, shard=shard)

    def _resume(self, st: dict) -> None:
        """Continue from a partial output's checkpoint: same settings, sound values (resume.py), else refused."""
        check_settings(st, self.fingerprint, self.resumable, self.name)
        with refusing_damage(self.staging.state_path):
            self._restore(read_checkpoint(st, {s.name: s.slots for s in self._series()}))

    def _restore(self, cp: Checkpoint) -> None:
        self.num_prompts, self.num_tokens = cp.num_prompts, cp.num_tokens
        self.progress, self.runs = cp.progress, cp.runs
        if cp.replay is not None:  # (an earlier version's checkpoint records none: its shards are here)
            self._opened_at = {s.name: cp.replay for s in self._series()}
        self._n_parts, self._phase = cp.index_parts, cp.phase
        if cp.created_at is not None:
            self.provenance["created_at"] = cp.created_at
        targets = {}
        for s in self._series():
            if self.on_file_complete is not None and not s.open_shard_here(cp.streams[s.name]):
                targets[s.name] = s.restore_empty(cp.streams[s.name])  # (its partial file stayed on another machine)
            else:
                s.restore(cp.streams[s.name])
        if targets:
            self.replay = cp.replay  # (None: an earlier version's copy; prompts are refilled without it)
            self._refill = Refill(targets, self.staging.parts(self._n_parts), self.num_prompts, self.name)
        known = cp.staged_names()
        for s in self._series():
            known |= s.open_staging_names()
        self.staging.prune(self._n_parts, known)
        if self._stats and cp.statistics_file:
            self._stats = load_accumulators(self.staging.path / cp.statistics_file, list(self.spec.sites))
            self._stats_checkpoint = cp.statistics_number
        self._rehash_closed()  # opened before they are published: a published file may leave the machine
        self._publish_closed()

    @property
    def refill_from(self) -> int | None:
        """The first prompt to give again to ``refill_batch`` (None: nothing to refill)."""
        return self._refill.start if self._refill is not None else None

    def refill_batch(self, *, first: int, statistics: Any = None, progress: Any = None, **batch_kw: Any) -> None:
        """Give again prompts ``first ..`` (recomputed as before, up to ``num_prompts``; ``add_batch``'s arguments)
        whose rows were in shards that a checkpoint left open on another machine (refill.py)."""
        if self._refill is None:
            raise RuntimeError("this DatasetWriter has nothing to refill")
        batch = check_batch(self.spec, first, **batch_kw)
        if self._refill.write(self._series(), batch, first, full_sequence=self.spec.full_sequence):
            self._refill = None
            self.checkpoint()

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
        sites = self.spec.sites
        hidden_b = {sites[slot]: (to_numpy(h)[None] if not self.spec.full_sequence else h)
                    for slot, h in hidden_by_slot(self.spec, hidden).items()}
        self.add_batch(texts=[text], hidden=hidden_b, num_tokens=[num_tokens], labels=[label], **batch)

    def _write_rows(self, batch: Any) -> None:
        """A checked batch's rows into the shard series: last-token rows, then the other tokens, then logits; each
        series' shard and row of every prompt go to the pending index columns."""
        b = len(batch)
        counts = batch.counts
        ones = np.ones(b, dtype=np.int64)
        if self.spec.full_sequence:
            ends = np.cumsum(counts) - 1
            last_rows = {slot: [t[ends] for t in ts] for slot, ts in batch.hidden.items()}
        else:
            last_rows = batch.hidden
        cols = self._pending  # per column, one chunk per batch (lists, numpy or Arrow arrays)
        p = plan(self._last.cursor, ones, self._last.cap_rows)
        self._last.write(p, last_rows, ones)
        cols["shard_index"].append(p.shard_of)
        cols["row_offset"].append(p.offset_of)
        if self._seq is not None:
            seq_counts = counts - 1
            p = plan(self._seq.cursor, seq_counts, self._seq.cap_rows)
            self._seq.write(p, batch.hidden, seq_counts, packed_counts=counts)
            cols["_seq_shard"].append(p.shard_of)
            cols["_seq_offset"].append(p.offset_of)
        if self._logits is not None:
            p = plan(self._logits.cursor, ones, self._logits.cap_rows)
            self._logits.write(p, {"all": list(batch.logits)}, ones)
            cols["shard_index_logits"].append(p.shard_of)
            cols["row_offset_logits"].append(p.offset_of)

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
        document: Sequence[int] | None = None,
        window_start: Sequence[int] | None = None,
        truncated_tokens: Sequence[int] | None = None,
        progress: Mapping[str, int] | None = None,
        statistics: Mapping[Any, RunningStats] | None = None,
    ) -> None:
        """Add a batch of prompts. Everything is checked before any byte of the batch is written.

        ``positions`` gives each prompt's row in the final index when prompts arrive out of order
        (extraction sorts them by length); the index is then sorted by it when the dataset closes,
        and the positions of all batches must form 0..N-1. By default prompts keep arrival order.

        ``document``/``window_start``: where each row came from, for a writer made with ``corpus=True``.
        ``truncated_tokens``: how many tokens of each prompt were cut off, for a writer made with ``truncation=True``.
        ``progress``: the caller's position in its source after this batch (small ints); a checkpoint
        records it with the rows, and a resumed writer gives it back as ``writer.progress``.

        ``statistics``: each site's partial statistics of this batch's stored vectors
        (``statistics.batch_statistics``, computed where the activations were, keyed like ``hidden``),
        for a writer made with ``statistics=True``; without them the writer computes them from the arrays.
        """
        if self._closed:
            raise RuntimeError("this DatasetWriter is closed")
        if self._phase != "writing":
            raise RuntimeError("this dataset is already being finalized; call close()")
        if self._refill is not None:
            raise RuntimeError(f"give prompts {self.refill_from}..{self.num_prompts - 1} to refill_batch first")
        batch = check_batch(
            self.spec, self.num_prompts, texts=texts, hidden=hidden, num_tokens=num_tokens, labels=labels,
            columns=columns, logits_values=logits_values, logits_indices=logits_indices,
            perplexity_mean=perplexity_mean, perplexity_min=perplexity_min, perplexity_max=perplexity_max,
            token_ids=token_ids, token_strings=token_strings, token_perplexity=token_perplexity, positions=positions,
            document=document, window_start=window_start, truncated_tokens=truncated_tokens,
        )
        b = len(batch)
        if b == 0:
            return
        parts = self._batch_statistics(batch.hidden, statistics)  # computed alongside the writes below
        before = Replay(self.num_prompts, self.num_tokens, self.progress)
        shards = {s.name: s.cursor.shard for s in self._series()}

        self._write_rows(batch)
        counts = batch.counts
        cols = self._pending
        for slot, part in parts.items():
            self._stats[slot] = self._stats[slot].merge(part if isinstance(part, RunningStats) else part.result())
        cols["text"].append(batch.texts)
        cols["label"].append(batch.labels)
        cols["num_tokens"].append(counts)
        cols["_position"].append(batch.positions)
        for name, vals in batch.columns.items():
            cols[name].append(vals)
        for s in self._series():
            if s.cursor.shard != shards[s.name]:
                self._opened_at[s.name] = before
        self.num_prompts += b
        self.num_tokens += int(counts.sum())
        if progress is not None:
            self.progress = check_progress(progress)
        self._n_pending += b
        self._n_pending_tokens += int(counts.sum())
        if self._checkpoint_due():
            self.checkpoint()

    def _checkpoint_due(self) -> bool:
        """Whether a checkpoint is due: the interval passed, the pending rows or tokens reached their cap, or enough
        shards closed since the last one to hand over."""
        return (
            time.monotonic() - self._last_checkpoint >= self.checkpoint_interval
            or self._n_pending >= _MAX_PENDING_ROWS
            or self._n_pending_tokens >= _MAX_PENDING_TOKENS
            or (self.on_file_complete is not None and self._closed_count() - self._closed_at_checkpoint >= _HANDOVER_SHARDS)
        )

    def _batch_statistics(self, hidden: dict[str, list[np.ndarray]], given: Mapping[Any, Any] | None) -> dict[str, Any]:
        """Each slot's statistics of a checked batch: the caller's partials (checked), or a future of them.

        Partials the caller did not give are computed on the writer's statistics thread (one torch
        thread, set in that thread only) while this thread writes the batch's shards.
        """
        if not self._stats:
            if given is not None:
                raise InvalidArgumentError("statistics were given but the writer was created with statistics=False")
            return {}
        by_slot = hidden_by_slot(self.spec, given) if given is not None else {}
        out = {}
        for slot, tensors in hidden.items():  # every stored vector: last tokens, and the others when kept
            a = tensors[0]
            part = by_slot.get(slot)
            if part is None:
                if self._stats_worker is None:
                    self._stats_worker = ThreadPoolExecutor(1, thread_name_prefix="lmprobe-stats",
                                                            initializer=one_torch_thread)
                part = self._stats_worker.submit(RunningStats.of_stored, DTYPES[self.spec.dtype], tensors)
            elif not isinstance(part, RunningStats) or part.count != len(a) or part.mean.shape != a.shape[1:]:
                hp, layer = self.spec.sites[slot]
                raise InvalidArgumentError(
                    f"statistics for {hp} layer {layer} must be a RunningStats of the batch's {len(a)} stored "
                    f"vectors of width {a.shape[1]} (statistics.batch_statistics), got {part!r:.80}")
            out[slot] = part
        return out

    # ------------------------------------------------------------------ checkpoints and closing

    def checkpoint(self, *, wait_hashes: bool = False) -> None:
        """Make everything added so far durable: a crash after this resumes from here.

        Hashes of closed shards still on the hasher thread are not waited for (``wait_hashes``:
        they are); a resumed writer re-hashes the closed shards whose hash this checkpoint lacks.
        With ``on_file_complete`` (an upload that removes the local file), they are always waited
        for: a shard leaves the machine only with its hash recorded.
        """
        leaving = self.on_file_complete is not None
        for s in self._series():
            s.flush()
            s.resolve_hashes(wait=wait_hashes or leaving)
        if self._n_pending:
            index.write_part(self.staging.part_path(self._n_parts), self._pending, self.spec)
            self._n_parts += 1
            self._pending = {c: [] for c in self._pending}
            self._n_pending = 0
            self._n_pending_tokens = 0
        stats_name = None
        if self._stats:
            # named per checkpoint: a crash between this file and state.json must not pair the old
            # state with newer statistics
            self._stats_checkpoint += 1
            stats_name = f"statistics-{self._stats_checkpoint:08d}.safetensors"
            save_accumulators(self.staging.path / stats_name, self._stats)
        state = {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "num_prompts": self.num_prompts,
            "num_tokens": self.num_tokens,
            "progress": self.progress,
            "replay": self._replay_point().to_json(),
            "runs": self.runs,
            "index_parts": self._n_parts,
            "phase": self._phase,
            "created_at": self.provenance["created_at"],
            "streams": {s.name: s.state() for s in self._series()},
            "statistics_file": stats_name,
        }
        self.staging.write_state(state)
        for s in self._series():
            for p in s.obsolete:
                p.unlink(missing_ok=True)
            s.obsolete = []
        for p in self.staging.path.glob("statistics-*.safetensors"):
            if p.name != stats_name:
                p.unlink(missing_ok=True)
        self._publish_closed()
        if self.on_checkpoint is not None and self._refill is None:
            self.on_checkpoint(self.staging.path, json.loads(json.dumps(state)), self.recorded_files())
        self._last_checkpoint = time.monotonic()
        self._closed_at_checkpoint = self._closed_count()

    def _replay_point(self) -> Replay:
        """The earliest point the open shards' rows can be recomputed from (the writer's now when none is open)."""
        start = Replay(0, 0, None)
        points = [self._opened_at.get(s.name, start) for s in self._series() if s.cursor.rows]
        return min(points, key=lambda r: r.prompts) if points else Replay(self.num_prompts, self.num_tokens,
                                                                           self.progress)

    def _closed_count(self) -> int:
        """Shards closed so far, every series together."""
        return sum(len(s.closed) for s in self._series())

    def _rehash_closed(self) -> None:
        """Hash again the closed shards whose hash the checkpoint lacks (still on the hasher when it was taken)."""
        for s in self._series():
            for shard, slot in s.missing_hashes():
                staged = self.staging.path / s.closed[shard]["files"][slot]["staging"]
                path = staged if staged.exists() else self.out_dir / self._final_name(s.name, slot, shard)
                if not path.is_file():
                    raise FormatError(f"shard {path} is missing; the partial output is damaged, pass overwrite=True")
                s.hash_later(shard, slot, open(path, "rb", buffering=0))

    def _hand_over(self, rel: str, sha256: str | None) -> None:
        """Tell ``on_file_complete`` of a final file (with its sha256 when the callback takes one)."""
        if self.on_file_complete is None:
            return
        if self._complete_takes_sha256:
            self.on_file_complete(rel, sha256=sha256)
        else:
            self.on_file_complete(rel)

    def _publish(self, series: str, slot: str, shard: int, f: dict, *, required: bool = False) -> None:
        """Move a closed shard (``f``, its record) from staging to its final name (idempotent: done once)."""
        src = self.staging.path / f["staging"]
        rel = self._final_name(series, slot, shard)
        if src.exists():
            move_into_place(src, self.out_dir / rel)
            self._hand_over(rel, f.get("sha256"))
        elif required and not (self.out_dir / rel).exists() and self.on_file_complete is None:
            # (with on_file_complete, a shard that is nowhere here was handed over and has left the machine: an
            # upload deletes it once it is up, and the uploader checks the bucket before the index goes up)
            raise FormatError(f"shard {self.out_dir / rel} is missing; the partial output is damaged, pass overwrite=True")

    def _publish_closed(self) -> None:
        """Move closed last-token and logits shards to their final names (sequence shards move at close), and
        hand closed sequence shards over under provisional names when they leave the machine."""
        for s in (self._last, self._logits):
            if s is not None:
                for shard, d in enumerate(s.closed):
                    for slot, f in d["files"].items():
                        self._publish(s.name, slot, shard, f)
        if self.on_file_renamed is not None and self._seq is not None and self._phase == "writing":
            for d in self._seq.closed:  # (when finalizing, the last ones go under their final names at once)
                for f in d["files"].values():
                    src = self.staging.path / f["staging"]
                    if "provisional" not in f and ("sha256" in f or not self.spec.checksums) and src.exists():
                        f["provisional"] = provisional_name(f["staging"])
                        move_into_place(src, self.out_dir / f["provisional"])
                        self._hand_over(f["provisional"], f.get("sha256"))

    def recorded_files(self) -> dict[str, tuple[int, str]]:
        """The closed files this writer recorded with their hash: path (a sequence shard's provisional path) ->
        (bytes, sha256). What a remote output may commit for it, and nothing else."""
        return {(provisional_name(f["staging"]) if s is self._seq else self._final_name(s.name, slot, shard)):
                (f["bytes"], f["sha256"]) for s in self._series() for shard, d in enumerate(s.closed)
                for slot, f in d["files"].items() if "sha256" in f}

    def close(self) -> Path:
        """Finish every shard, write the card and, last, the index. Returns the dataset folder."""
        if self._closed:
            return self.out_dir
        if self._phase == "writing":
            for s in self._series():
                s.close_shard()
            self._phase = "finalizing"
            self.checkpoint(wait_hashes=True)  # only the last shards' hashing is serial
        self._finalize()
        self._closed = True
        self._release()
        return self.out_dir

    def abort(self) -> None:
        """Stop without finalizing; the folder stays resumable from the last checkpoint."""
        for s in self._series():
            s.abort()
        self._closed = True
        self._release()

    def discard(self) -> None:
        """Stop and delete the unfinished dataset (the staging folder, and the shards already moved into place),
        for a caller whose input turned out to be unusable halfway: nothing half-made is left behind. Other
        files in the folder are not touched."""
        published = [self.out_dir / self._final_name(s.name, slot, shard) for s in (self._last, self._logits)
                     if s is not None for shard, d in enumerate(s.closed) for slot in d["files"]]
        for s in self._series():
            s.abort()
        self._closed = True
        try:  # under the lock: nobody else writes here meanwhile
            remove_files_inside(self.out_dir, published)
            self.staging.remove()
            for d in sorted({p.parent for p in published}, key=lambda p: len(p.parts), reverse=True):
                if d != self.out_dir and d.is_dir() and not any(d.iterdir()):
                    d.rmdir()  # tensors/, when this writer made it and nothing else is in it
        finally:
            self._release()

    def _finalize(self) -> None:
        n_last = len(self._last.closed)
        seq_closed = self._seq.closed if self._seq else []
        for j, d in enumerate(seq_closed):  # sequence shards are numbered after the last-token shards
            for slot, f in d["files"].items():
                if self.on_file_renamed is not None and not (self.staging.path / f["staging"]).exists():
                    # handed over as it closed (also when a crash came before the checkpoint recording it: the
                    # provisional name follows from the staging name): renamed where it went
                    self.on_file_renamed(provisional_name(f["staging"]), self._final_name("seq", slot, n_last + j))
                else:
                    self._publish("seq", slot, n_last + j, f, required=True)
        spec = self.spec
        tensors: dict[str, Any] = {"hidden_layers": build_hidden_descriptor(spec, self._last.closed, seq_closed)}
        for hp in spec.hookpoints:  # each other hookpoint: one more descriptor with the same shards
            if hp != spec.primary_hookpoint:
                tensors[hookpoint_tensor_name(hp)] = build_hidden_descriptor(spec, self._last.closed, seq_closed, hp)
        if self._logits is not None:
            tensors["logits_topk"] = build_logits_descriptor(self.spec, self._logits.closed)
        extra = dict(self.spec.metadata)
        if self.runs:
            extra["runs"] = self.runs
        if self.progress is not None:  # where the source stood at the end (a part of a multi-process job replays
            extra["progress"] = self.progress  # its share's planning from it when the same job runs again)
        if self._stats:
            by_hp: dict[str, dict[int, RunningStats]] = {}
            for slot, st in self._stats.items():
                hp, layer = spec.sites[slot]
                by_hp.setdefault(hp, {})[layer] = st
            primary = by_hp.pop(spec.primary_hookpoint)
            desc = write_statistics(self.out_dir, primary, storage=spec.storage, checksums=self.spec.checksums,
                                    others=by_hp)
            self._hand_over(desc["file"], desc.get("sha256"))
            extra["statistics"] = desc  # its own key: every entry of `tensors` holds shards
        info = build_info(self.spec, num_prompts=self.num_prompts, tensors=tensors, provenance=self.provenance,
                          prompt_ordering=self.spec.prompt_ordering, extra=extra)
        schema = index.final_schema(self.spec)
        atomic_write(self.out_dir / CARD_PATH, card.render_card(info, schema), fsync=self.fsync)
        index.write_index(self.out_dir / INDEX_PATH, self.staging.parts(self._n_parts), spec=self.spec, n_last=n_last,
                          metadata=encode_schema_metadata(info), fsync=self.fsync, num_rows=self.num_prompts,
                          num_tokens=self.num_tokens)
        self.staging.remove()
