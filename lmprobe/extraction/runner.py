"""Running an extraction: a prepared job (preparation.py) into its output (outputs.py: a folder, object storage or
the Hub), one check of "does the output already hold this extraction?" for all of them, the batch loop
(loop.py) feeding the writer, and a torchrun job's parts merged into one dataset.
Every input error surfaces before the weights load (preparation.py), and a plan past the output's limits
before the model runs.
"""

from __future__ import annotations

import errno
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..base.units import format_size, plural
from ..errors import (
    ExtractionError,
    OutOfSpaceError,
    OutputExistsError,
)
from ..format.datasetspec import DatasetSpec
from ..format.reader import Dataset
from ..format.staging import describe_mismatch
from ..format.writer import DatasetWriter
from ..storage.outputs import Output, open_output
from .backend_nnsight import nnsight_version
from .config import RESUMABLE_SETTINGS, ExtractionConfig, same_extraction
from .corpus import exchanges, stream_windows
from .examine import ranges
from .loop import run_corpus, run_prompts
from .plan import JobPlan
from .preparation import Job, check_plan, prepare
from .torchrun import Ranks, start_ranks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What an extraction did: the dataset, opened, and whether this run wrote it."""

    dataset: Dataset
    wrote: bool  # False: the output already held this extraction, and nothing was done


def execute(cfg: ExtractionConfig, *, token: str | None = None) -> Outcome:
    """Run the extraction ``cfg`` describes; return the dataset, opened, and whether anything was written (the
    command line's last line depends on it). The runner's step of ``lmprobe.api.run_extraction``, the one function
    that runs an extraction (it adds the push and the one-line wording of a peer's failure): call that. Re-running
    the same extraction after an interruption continues where it stopped; a different configuration against a
    partial output is an error unless ``overwrite`` is set. ``token``:
    the Hub identity of every Hub call of the extraction (never stored): the output's, the model's download, an
    ``hf://`` prompt or corpus source's reads."""
    output = open_output(cfg.out, token=token)  # a bad --out is an error before the tokenizer and the weights load
    output.check()  # (a pull request that is not open: before the model's config is read)
    ranks = start_ranks()
    rank, world = ranks.rank, ranks.world
    output = output.for_world(world)
    job = prepare(cfg, ranks, token=token)
    check_plan(job)
    done = _finished(job, output)
    if done is not None:
        if not cfg.quiet and rank == 0:
            logger.info("%s already holds this extraction (%s, %s, %s); nothing to do",
                        output, rows_text(done, corpus=cfg.corpus), done.storage, done.dtype)
        return Outcome(done, wrote=False)
    try:
        if world > 1:
            return Outcome(_extract_parallel(job, output, rank, world), wrote=True)
        return Outcome(_extract(job, output), wrote=True)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise OutOfSpaceError(f"the disk holding {output.staging()} is full ({exc.strerror}); free some space and run "
                              "the same command again: it resumes from its last checkpoint") from exc


def plan(cfg: ExtractionConfig, *, token: str | None = None) -> JobPlan:
    """The plan of the extraction ``cfg`` describes (plan.py), made as a real run makes it, without loading the
    weights or running anything: the cluster is the plan options' (``world_size``, ``gpus_per_node``,
    ``gpu_memory``) or this machine's. ``token``: as ``execute``'s (the model's config, the source)."""
    open_output(cfg.out, token=token)  # a bad --out is an error here too
    job = prepare(cfg, Ranks(0, 1, None), token=token)
    assert job.plan is not None
    return job.plan


def rows_text(ds: Dataset, *, corpus: bool) -> str:
    """What a dataset holds, for the last line: ``48 prompts x 6 layers x 128 dims``."""
    rows = plural(ds.num_prompts, "prompt")
    if corpus:
        rows = f"{plural(ds.num_prompts, 'window')} ({plural(int(ds.column('num_tokens').sum()), 'token')})"
    hps = "" if ds.hookpoints == ["resid_post"] else \
        f" x {plural(len(ds.hookpoints), 'hookpoint')} ({', '.join(ds.hookpoints)})"
    return f"{rows} x {plural(len(ds.layers), 'layer')}{hps} x {ds.dim} dims"


def _finished(job: Job, output: Output) -> Dataset | None:
    """The output, when it already holds this extraction (finished, with the same settings); None when it holds
    none (or ``overwrite``); an error naming the difference when it holds another one."""
    cfg = job.config
    if cfg.overwrite:
        return None
    ds = output.finished()
    if ds is None:
        return None
    recorded = _recorded_settings(ds)
    if same_extraction(recorded, job.settings):
        return ds
    raise OutputExistsError(f"{output} already holds a dataset made with other settings "
                            f"({describe_mismatch(recorded, job.settings)}); pass --overwrite to replace it, "
                            "or choose another --out")


def _recorded_settings(ds: Dataset) -> dict:
    """The extraction settings a dataset records ({} when it records none)."""
    extraction = ds.info.get("extraction")
    recorded = extraction.get("settings") if isinstance(extraction, dict) else None
    return recorded if isinstance(recorded, dict) else {}


def _extract(job: Job, output: Output) -> Dataset | None:
    """Extract into ``output``: the writer writes in its staging folder while its session takes finished files."""
    cfg, settings = job.config, job.settings
    out = output.staging()
    session = output.session(overwrite=cfg.overwrite, settings=settings, shard_bytes=job.shard_bytes)
    if session.finishing:  # killed in its tail: what the closed writer recorded is staged or on the Hub
        return session.finish()
    try:
        if not cfg.overwrite:
            # a part whose node is gone: its checkpoint on the Hub (a corpus is replayed from the source position
            # the checkpoint records for its open shards: the writer's ``replay``)
            session.seed(settings)
        dataset_spec = DatasetSpec(  # what the dataset will hold; the writer's keywords below are this run's
            **cfg.spec_settings(),  # the settings as asked for (the config's fields marked spec=)
            layers=settings["layers"],  # and as resolved for this job
            dim=job.spec.hidden_size,
            model_name=job.spec.name,
            model_revision=settings["revision"],
            shard_size=job.shard_bytes,
            label_type=job.prompts.label_type if job.prompts else None,
            columns=job.prompts.column_types if job.prompts else None,
            token_ids=settings["token_ids"],
            provenance=_provenance(cfg),
            metadata={"extraction": {"settings": settings, "architecture": _architecture_record(job)}},
            corpus=job.corpus is not None,
            truncation=job.cut is not None,  # each prompt's cut tokens, in `truncated_tokens`
            hookpoint_dims=job.hookpoint_dims,
            layout=job.layout,
        )
        writer = DatasetWriter(
            out,
            dataset_spec,
            fingerprint=settings,
            # the budget only says when to stop; a batch size changes no stored value beyond float rounding
            resumable=RESUMABLE_SETTINGS + (("max_tokens",) if job.corpus is not None else ()),
            overwrite=cfg.overwrite,
            checkpoint_interval=cfg.checkpoint_interval,
            run={"batch_size": cfg.batch_size, **job.placement.record(), "checkpoint_interval": cfg.checkpoint_interval},
            name=str(output) if output.local else f"{output} (staged in {out})",
            **session.writer_callbacks(),
        )
    except BaseException:
        session.abort()
        raise
    try:
        if not cfg.overwrite:
            session.resume(writer.recorded_files())
        _announce(job, writer, out, local=output.local)
        if job.corpus is not None:
            run_corpus(writer, job)
        else:
            run_prompts(writer, job)
    except BaseException:
        writer.abort()
        session.abort()
        raise
    writer.close()
    ds = session.finish()  # None: a job's part, committed with the other ranks' when the job ends
    if not output.local and not cfg.quiet:
        part = settings.get("part")  # a rank's part of a torchrun job (_extract_parallel): not yet the dataset
        what = f"part {part[0]} of {part[1]} of the dataset" if part else "the dataset"
        later = "" if ds is not None else " (rank 0 commits it with the other parts when the job ends)"
        logger.info("uploaded %s to %s%s", what, output, later)
    return ds


def _extract_parallel(job: Job, output: Output, rank: int, world: int) -> Dataset:
    """One rank of ``torchrun``: extract this rank's share (prompts or documents i with i % world == rank, read
    and tokenized by this rank only) into its own part of the output, then rank 0 merges the parts into one
    dataset (local moves, server-side copies: no shard passes through one machine), in prompt or source order,
    and every rank returns it."""
    import dataclasses

    import torch.distributed as dist

    cfg = job.config  # the rank's GPU (or, with --device-map, its group of GPUs) was chosen in prepare: placement.py
    # the Hub's: every rank uploads its own files, rank 0 commits them all (one commit budget for the job)
    output = output.start_job(dist.distributed_c10d._get_default_store(), rank=rank, world=world,
                              settings=job.settings, overwrite=cfg.overwrite)
    part = output.part(rank)
    if job.prompts is not None:
        what = {"prompts_sha256": job.prompts.fingerprint(), "num_prompts": len(job.prompts)}
    else:
        what = {}
    part_job = dataclasses.replace(job, config=dataclasses.replace(cfg, quiet=cfg.quiet),  # every rank shows its own
                                   settings={**job.settings, **what, "part": [rank, world]})
    done = _finished(part_job, part)
    if done is None:
        _extract(part_job, part)
    elif job.corpus is not None and exchanges(job.corpus, world):
        # a finished part still takes part in planning the budget, or the other ranks would wait for it
        for _ in stream_windows(job.corpus, job.tokenizer, cfg.text_column, resume=done.info.get("progress"),
                                rank=rank, world=world, all_gather=job.ranks.all_gather):
            pass
    dist.barrier()
    if rank == 0:
        output.end_job()
        output.merge([output.part(r) for r in range(world)], settings=job.settings,
                     order="documents" if job.corpus is not None else "positions", quiet=cfg.quiet)
    dist.barrier()
    part.release_staging()  # (a Hub part's staging stays until its last files are committed: a kill before resumes)
    ds = output.finished()
    if ds is None:  # pragma: no cover - rank 0 merged before the barrier
        raise ExtractionError(f"{output} holds no dataset after the merge")
    return ds


def _architecture_record(job: Job) -> dict[str, Any]:
    """How each stored hookpoint was read, by layer range, and what the check ran on (``lmprobe:extraction``)."""
    arch = job.arch
    readings = {}
    for c in job.captures:
        by_reading: dict[str, list[int]] = {}
        for layer, reading in sorted(c.readings.items()):
            by_reading.setdefault(str(reading), []).append(layer)
        readings[c.hookpoint] = {ranges(layers): how for how, layers in by_reading.items()}
    return {"checked_on": arch.checked_on, "block_path": arch.block_path, "num_layers": arch.num_layers,
            "inputs": {"padding_side": arch.inputs.padding_side, "position_ids": arch.inputs.position_ids,
                       "decoder_inputs": arch.inputs.decoder_inputs},
            "readings": readings}


def _provenance(cfg: ExtractionConfig) -> dict:
    if cfg.backend != "nnsight":
        return {"extraction_backend": "local"}
    return {"extraction_backend": "nnsight", "nnsight_version": nnsight_version(), "nnsight_remote": cfg.remote}


def _planned_bytes(job: Job, writer: DatasetWriter) -> tuple[int | None, str]:
    """Bytes the extraction will still write (None when the source's length is unknown), and what they are."""
    cfg = job.config
    per_vector = job.vector_bytes
    logits = (cfg.logits_topk or 0) * 8
    n_layers = len(job.settings['layers'])
    hps = "" if len(job.captures) == 1 else f" x {len(job.captures)} hookpoints"
    what = f"{n_layers} layer{'s' if n_layers != 1 else ''}{hps} x {job.spec.hidden_size} dims, {cfg.dtype}"
    if job.corpus is not None:
        per_row = per_vector if cfg.storage == "full_sequence" else 0
        if job.corpus.max_tokens is None:
            return None, (f"every token of {job.corpus.source.description} in windows of {job.corpus.context_len} "
                          f"({what}: {format_size(per_vector)} per {'token' if per_row else 'window'})")
        left = job.corpus.max_tokens - writer.num_tokens
        if cfg.storage == "full_sequence":
            n = left * per_vector + (left // max(job.corpus.context_len, 1) + 1) * logits
        else:  # pooled: one vector per window, at least max_tokens / context_len of them
            n = (left // job.corpus.context_len + 1) * (per_vector + logits)
        return n, f"{job.corpus.max_tokens:,} tokens in windows of {job.corpus.context_len} ({what})"
    p, lengths = job.prompts, job.lengths
    assert p is not None and lengths is not None
    rows = len(p) - writer.num_prompts
    order = np.lexsort((np.arange(len(p)), -lengths))
    if cfg.storage == "full_sequence":
        tokens = int(lengths[order[writer.num_prompts:]].sum())  # an upper bound when special tokens are dropped
        return tokens * per_vector + rows * logits, f"{plural(len(p), 'prompt')}, {plural(int(lengths.sum()), 'token')} ({what})"
    return rows * (per_vector + logits), f"{plural(len(p), 'prompt')} ({what})"


def _announce(job: Job, writer: DatasetWriter, out: Path, *, local: bool) -> None:
    """Say what is about to be written, and stop when the disk cannot hold it (before the model loads)."""
    cfg = job.config
    planned, what = _planned_bytes(job, writer)
    if not cfg.quiet:
        size = "size unknown (no --max-tokens)" if planned is None else f"about {format_size(planned)}"
        resumed = (f", resuming after {plural(writer.num_prompts, 'row')} ({plural(writer.num_tokens, 'token')})"
                   if writer.num_prompts else "")
        if writer.refill_from is not None:  # a checkpoint from another node: its open shards' rows again
            resumed += f", recomputing the last {plural(writer.num_prompts - writer.refill_from, 'row')} of them"
        logger.info("lmprobe: writing %s: %s%s", what, size, resumed)
    if planned is None or not cfg.space_check:
        return
    if not local and job.plan is not None and job.plan.known:
        # shards go to the Hub or the bucket as they close: this node stages a few of them, not the dataset
        planned = min(planned, job.plan.staging_bytes_per_node)
    free = shutil.disk_usage(out).free
    if free < planned:
        raise OutOfSpaceError(
            f"{out} has {format_size(free)} free but this extraction will write about {format_size(planned)}; free "
            "some space, choose another --out, or pass --no-space-check to start anyway")
