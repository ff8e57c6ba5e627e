"""The batch loop: a prepared job's prompts or corpus windows through the model, batch by batch, into the writer
(on a thread of its own, one batch ahead), with a progress bar; an interruption keeps every finished batch."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base.allocator import HeapTrimmer, bound_allocator_cache
from ..base.progress import Progress
from ..base.worker import BackgroundWorker
from ..errors import ExtractionError
from ..format.dtypes import DTYPES
from ..format.values import torch_dtype
from ..format.writer import DatasetWriter
from .backend_hf import TransformersBackend
from .backend_nnsight import build_backend
from .corpus import (
    batches,
    pad,
    progress_after,
    stream_windows,
)
from .model import (
    get_module,
    load_model,
)
from .preparation import Job, no_bars
from .tokens import Encoder
from .windows import Budget


def load_backend(job: Job) -> Any:
    cfg = job.config
    model, job.model = job.model, None  # loaded early to locate the hookpoints, or loaded now
    if cfg.backend == "nnsight":
        if model is None and cfg.remote is not True:
            model = load_model(job.spec, placement=job.placement, compute_dtype=cfg.compute_dtype, quiet=no_bars(cfg))[0]
        return build_backend(job.spec, model, job.tokenizer, block_path=job.arch.block_path, inputs=job.arch.inputs,
                             remote=cfg.remote)
    if model is None:
        model, _commit = load_model(job.spec, placement=job.placement, compute_dtype=cfg.compute_dtype, quiet=no_bars(cfg))
    blocks = get_module(model, job.arch.block_path)
    return TransformersBackend(model, blocks, causal_lm=job.spec.causal_lm, inputs=job.arch.inputs)


def _bar_name(job: Job) -> str:
    """What a progress bar is called: ``extract``, or ``extract rank 1/2`` (every node shows its own rank's bar)."""
    ranks = job.ranks
    return "extract" if ranks is None or ranks.world == 1 else f"extract rank {ranks.rank}/{ranks.world}"


def _writer_thread(writer: DatasetWriter, done: int) -> BackgroundWorker:
    """The thread that writes the loop's batches: a batch whose first row is before ``done`` (the rows a checkpoint
    from another node left in open shards) goes to ``refill_batch``, the others to ``add_batch``."""

    def write(item: dict) -> None:
        row = item.pop("first")
        if row < done:
            writer.refill_batch(first=row, **item)
        else:
            writer.add_batch(**item)

    return BackgroundWorker(write, max_pending=1, name="lmprobe-writer")


def run_prompts(writer: DatasetWriter, job: Job) -> None:
    cfg = job.config
    bound_allocator_cache()  # one arena: freed batch buffers are reused by every thread
    n = len(job.prompts)
    # longest first (an out-of-memory batch shows at once), ties in input order; deterministic, so a
    # resumed run continues in the same order after the writer's num_prompts
    order = np.lexsort((np.arange(n), -job.lengths))
    done = writer.num_prompts
    if done >= n and writer.refill_from is None:
        return
    backend = load_backend(job)
    tok = job.tokenizer
    if cfg.truncate:
        tok.truncation_side = cfg.truncate
    encoder = Encoder(tok, chat_template=cfg.chat_template, drop_special_tokens=cfg.drop_special_tokens,
                      max_length=job.settings["max_length"], truncate=cfg.truncate)
    # a checkpoint from another node (hubresume.py): the prompts of the shards it left open are computed again, in
    # the batches they were computed in (from a multiple of the batch size), and only those shards take them
    refill = writer.refill_from
    start = done if refill is None else refill // cfg.batch_size * cfg.batch_size

    bg = _writer_thread(writer, done)
    bar = Progress(n, initial=done, desc=_bar_name(job), unit="prompt", quiet=cfg.quiet, tokens=True)  # its share
    try:
        _loop(bg, backend, encoder, job, order, start, done, bar)
    except BaseException:
        bg.stop()
        if bg.error is None:
            # interrupted, or the forward pass failed (a remote error, OOM): keep every finished
            # batch, so the next run resumes after it
            writer.checkpoint()
        raise
    finally:
        bar.close()
    bg.finish()


def _loop(bg: BackgroundWorker, backend: Any, encoder: Encoder, job: Job, order: np.ndarray, start: int, done: int,
          bar: Progress) -> None:
    """Prompts ``start ..`` in ``order``, batch by batch, to the writer (those before ``done``: a refill)."""
    import torch

    cfg, p = job.config, job.prompts
    kind = DTYPES[cfg.dtype]
    out_dtype = torch_dtype(kind.compute)  # int8 is encoded by the writer, from float32
    # the statistics of a scaled dtype are of its decoded values: the writer computes them
    statistics = cfg.statistics and not kind.scaled
    layers = job.settings["layers"]
    bs = cfg.batch_size
    trim = HeapTrimmer()  # after the model loaded
    with torch.inference_mode():
        s = start
        while s < len(order):
            idx = order[s : min(s + bs, done) if s < done else s + bs]
            texts = [p.texts[i] for i in idx]
            input_ids, attention_mask, keep = encoder.batch(
                texts, ids=[p.input_ids[i] for i in idx] if p.input_ids is not None else None)
            res = backend.run(input_ids, attention_mask, layers=layers, storage=cfg.storage, out_dtype=out_dtype,
                              logits_topk=cfg.logits_topk, perplexity=cfg.perplexity,
                              keep=None if encoder.plain else keep, captures=job.captures, statistics=statistics)
            item = _batch_item(job, texts, res)
            item["positions"], item["first"] = idx, s
            if p.label_type is not None:
                item["labels"] = [p.labels[i] for i in idx]
            if p.columns:
                item["columns"] = {c: [v[i] for i in idx] for c, v in p.columns.items()}
            if job.cut is not None:
                item["truncated_tokens"] = job.cut[idx]
            bg.submit(item)
            n_tokens = int(res.num_tokens.sum())
            del item, res  # the writer owns the batch now; free it while the next one computes
            trim()
            if s >= done:  # (a refill is not progress)
                bar.update(len(idx), tokens=n_tokens)
            s += len(idx)


def _batch_item(job: Job, texts: list[str], res: Any) -> dict[str, Any]:
    """The writer's ``add_batch`` arguments for one forward pass's results."""
    cfg = job.config
    item: dict[str, Any] = {"texts": texts, "hidden": res.hidden, "num_tokens": res.num_tokens}
    if res.statistics is not None:  # computed on the model's device: the writer only merges them
        item["statistics"] = res.statistics
    if cfg.logits_topk:
        item["logits_values"], item["logits_indices"] = res.logits_values, res.logits_indices
    if cfg.perplexity:
        item["perplexity_mean"] = res.perplexity["mean"]
        item["perplexity_min"] = res.perplexity["min"]
        item["perplexity_max"] = res.perplexity["max"]
        item["token_perplexity"] = res.perplexity["token"]
    if job.settings["token_ids"]:
        item["token_ids"] = res.token_ids
    if cfg.token_strings:
        item["token_strings"] = [job.tokenizer.batch_decode([[t] for t in ids]) for ids in res.token_ids]
    return item


def run_corpus(writer: DatasetWriter, job: Job) -> None:
    """Stream the source's documents as windows, in source order, until it ends or the budget is spent."""
    import torch

    cfg, plan, tok, ranks = job.config, job.corpus, job.tokenizer, job.ranks
    assert plan is not None
    # a checkpoint from another node (hubresume.py) lacks its open shards: the source is replayed from where the
    # earliest of them began (the writer's ``replay``), those windows' rows go to refill_batch, and the stream
    # runs on past the checkpoint as one (the same batches as the run that was stopped)
    done, first, progress, tokens = writer.num_prompts, writer.num_prompts, writer.progress, writer.num_tokens
    if writer.refill_from is not None:
        if writer.replay is None:
            raise ExtractionError(f"{writer.name}: its checkpoint from another node does not say where in the source "
                                  "its open shards began; pass --overwrite to start over")
        first, progress, tokens = writer.replay.prompts, writer.replay.progress, writer.replay.tokens
    if ranks.world > 1:  # a share of the job's budget, planned with the other ranks (ranks.py)
        stream = stream_windows(plan, tok, cfg.text_column, resume=progress, rank=ranks.rank,
                                world=ranks.world, all_gather=ranks.all_gather)
    else:
        if plan.max_tokens is not None and writer.num_tokens > plan.max_tokens:
            raise ExtractionError(f"the partial output already holds {writer.num_tokens:,} tokens, more than "
                                  f"--max-tokens {plan.max_tokens:,}; pass --max-tokens {writer.num_tokens} or more to "
                                  "finish it, or --overwrite to start over")
        budget = Budget(plan.max_tokens, tokens)
        if Budget(plan.max_tokens, writer.num_tokens).spent and writer.refill_from is None:
            return
        stream = stream_windows(plan, tok, cfg.text_column, resume=progress, budget=budget)
    bound_allocator_cache()
    backend = load_backend(job)
    kind = DTYPES[cfg.dtype]
    out_dtype = torch_dtype(kind.compute)  # int8 is encoded by the writer, from float32
    # the statistics of a scaled dtype are of its decoded values: the writer computes them
    statistics = cfg.statistics and not kind.scaled
    layers = job.settings["layers"]
    left = tok.padding_side == "left"
    bg = _writer_thread(writer, done)
    # a rank's share of a budget is planned round by round with the others (ranks.py), unknown up front: its bar
    # counts its tokens without a total (max_tokens // world stopped at 88% on one rank, passed 100% on another)
    total = plan.max_tokens if ranks.world == 1 else None
    desc = _bar_name(job) if ranks.world == 1 or plan.max_tokens is None else \
        f"{_bar_name(job)}, of the job's {plan.max_tokens:,}"
    bar = Progress(total, initial=writer.num_tokens, desc=desc, unit="tok", quiet=cfg.quiet)
    trim = HeapTrimmer()
    try:
        with torch.inference_mode():
            for batch in batches(stream, cfg.batch_size):
                input_ids, attention_mask = pad(batch, tok.pad_token_id, left)
                res = backend.run(input_ids, attention_mask, layers=layers, storage=cfg.storage, out_dtype=out_dtype,
                                  logits_topk=cfg.logits_topk, perplexity=cfg.perplexity, captures=job.captures,
                                  statistics=statistics)
                item = _batch_item(job, [w.text for w in batch], res)
                item["document"] = [w.document for w in batch]
                item["window_start"] = [w.start for w in batch]
                item["progress"], item["first"] = progress_after(batch), first
                bg.submit(item)
                if first >= done:  # (a refill is not progress)
                    bar.update(int(res.num_tokens.sum()), note=f"document {batch[-1].document + 1:,}")
                first += len(batch)
                del item, res
                trim()
    except BaseException:
        bg.stop()
        if bg.error is None:
            writer.checkpoint()  # keep every finished batch: the next run resumes after it
        raise
    finally:
        bar.close()
    bg.finish()
