"""Running an extraction: prompts + model -> an lmprobe dataset, resumable, with the writer on a thread.

Every input error surfaces before the weights load: the config checks itself, then prompts,
the model's config and the tokenizer are read and checked, and only then does the model load.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..base.allocator import HeapTrimmer, bound_allocator_cache
from ..base.display import one_line
from ..base.progress import Progress, logger, on_terminal
from ..base.units import format_size, plural
from ..base.worker import BackgroundWorker
from ..errors import (
    ExtractionError,
    InvalidArgumentError,
    LmprobeError,
    ModelError,
    OutOfSpaceError,
    OutputExistsError,
)
from ..format.reader import Dataset
from ..format.spec import HUB_FOLDER_ENTRIES, HUB_REPO_FILES, MAX_SHARD_SIZE, NESTED_FROM_SHARDS
from ..format.staging import describe_mismatch
from ..format.values import torch_dtype
from ..format.writer import DatasetWriter
from .backend_hf import TransformersBackend
from .backend_nnsight import build_backend, check_api_key, nnsight_version, require_nnsight
from .config import RESUMABLE_SETTINGS, ExtractionConfig, same_extraction
from .corpus import (
    CorpusPlan,
    batches,
    check_first_record,
    pad,
    progress_after,
    stream_windows,
)
from .examine import TOLERANCE, Architecture, examine, plan_captures, ranges, site_widths
from .hookpoints import NAMED, Capture
from .miniature import build_miniature, skeleton
from .model import (
    ModelSpec,
    get_module,
    load_model,
    load_tokenizer,
    parse_layers,
    pick_device,
    read_model_spec,
)
from .outputs import Output, open_output
from .prompts import Prompts, check_token_ids, read_prompts
from .ranks import Gather
from .sources import Record, open_source
from .tokens import Encoder
from .windows import Budget, affixes_of


@dataclass(frozen=True)
class Ranks:
    """This process's place in a multi-process job: rank, world size, and how the ranks exchange small values."""

    rank: int
    world: int
    all_gather: Gather | None  # one value per rank, by rank (a gloo group of its own); None for one process

    def agree(self, check: Callable[[], None]) -> None:
        """Run ``check`` on every rank; when it fails on any, every rank raises the first rank's error (one
        rank cannot stop alone: the others would wait for it)."""
        if self.world == 1:
            check()
            return
        try:
            check()
            mine = None
        except LmprobeError as exc:
            mine = str(exc)
        found = [m for m in self.all_gather(mine) if m is not None]
        if found:
            raise ExtractionError(found[0])


@dataclass
class _Job:
    """An extraction whose inputs have been read and checked: what the runner needs besides the config."""

    config: ExtractionConfig
    prompts: Prompts | None  # prompt mode: every prompt, read and checked
    spec: ModelSpec
    tokenizer: Any
    lengths: np.ndarray | None  # prompt mode: model input length of every prompt (after truncation)
    settings: dict[str, Any]  # recorded in the dataset and compared on resume
    device: str
    corpus: CorpusPlan | None = None  # corpus mode: the source and its windows
    captures: list[Capture] = field(default_factory=list)  # what to read in each block
    model: Any = None  # the loaded model, when examining the model needed it before the writer opened
    cut: np.ndarray | None = None  # prompt mode with --truncate: tokens cut from each prompt (0: none)
    arch: Architecture | None = None  # the model's blocks, hookpoints and inputs (examine.py)
    layout: str = "flat"  # the shard file layout: nested for 1,000 shards a layer or more (format/spec.py)
    ranks: Ranks = field(default_factory=lambda: Ranks(0, 1, None))  # this process's place in a torchrun job

    @property
    def hookpoint_dims(self) -> tuple[int, ...]:
        """Widths in the config's hookpoint order, or () when every hookpoint is as wide as the model."""
        width = {c.hookpoint: c.width or self.spec.hidden_size for c in self.captures}
        dims = tuple(width[hp] for hp in self.config.hookpoints)
        return () if all(d == self.spec.hidden_size for d in dims) else dims

    @property
    def vector_bytes(self) -> int:
        """Bytes of one stored token or prompt: every hookpoint of every layer."""
        item = np.dtype("float16" if self.config.dtype == "bfloat16" else self.config.dtype).itemsize
        return len(self.settings["layers"]) * sum(c.width or self.spec.hidden_size for c in self.captures) * item


def _default_max_length(tok: Any, config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(text, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    m = getattr(tok, "model_max_length", None)
    return m if isinstance(m, int) and 0 < m < 10**7 else None


def _where(prompts: Prompts, i: int) -> str:
    return f"prompt {i}" if prompts.source in ("prompts", "DataFrame", "<memory>") else prompts.where(i)


def _prepare(cfg: ExtractionConfig, ranks: Ranks | None = None) -> _Job:
    """Read and check everything but the weights."""
    if cfg.backend == "nnsight":
        require_nnsight()
        if cfg.remote is True:
            check_api_key()
    ranks = ranks or Ranks(0, 1, None)
    if cfg.corpus:
        p = None
        source = open_source(cfg.prompts, text_column=cfg.text_column, config=cfg.dataset_config, split=cfg.split)
    elif isinstance(cfg.prompts, Prompts):
        p = cfg.prompts
    else:  # a rank reads and checks its own share only (prompt i goes to rank i % world)
        p = read_prompts(cfg.prompts, text_column=cfg.text_column, label_column=cfg.label_column,
                         dataset_config=cfg.dataset_config, split=cfg.split, rank=ranks.rank, world=ranks.world,
                         all_gather=ranks.all_gather)
    spec = read_model_spec(cfg.model, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    layer_list = parse_layers(cfg.layers, spec.num_layers)
    if (cfg.logits_topk or cfg.perplexity) and not spec.causal_lm:
        asked = "--logits-topk" if cfg.logits_topk else "--perplexity"
        kind = ", ".join(spec.config.architectures or [spec.config.model_type])
        raise ModelError(
            f"{spec.name} has no language-model head ({kind}); it gives hidden states only, so {asked} "
            "cannot be computed"
        )
    text_cfg = spec.config.get_text_config() if hasattr(spec.config, "get_text_config") else spec.config
    vocab = getattr(text_cfg, "vocab_size", None)
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
    if cfg.logits_topk and vocab and cfg.logits_topk > vocab:
        raise ExtractionError(f"logits_topk={cfg.logits_topk} is larger than the vocabulary ({vocab})")
    dev = pick_device(cfg.device)
    tok = load_tokenizer(spec)
    arch, model = _examine_model(cfg, spec, tok, dev)
    if arch.num_layers != spec.num_layers:
        layer_list = parse_layers(cfg.layers, arch.num_layers)
    tok.padding_side = arch.inputs.padding_side  # what gives every prompt its own values (examine.py)
    captures, model = _plan_captures(cfg, spec, arch, layer_list, model, dev)
    limit = cfg.max_length or _default_max_length(tok, spec.config)
    if p is None:
        job = _prepare_corpus(cfg, source, spec, tok, limit, vocab, layer_list, dev, ranks)
        job.captures, job.model, job.arch = captures, model, arch
        job.layout = _layout(job)
        return job
    if p.input_ids is not None:
        ranks.agree(lambda: _check_pretokenized(cfg, p, tok, vocab))
    encoder = Encoder(tok, chat_template=cfg.chat_template, drop_special_tokens=cfg.drop_special_tokens,
                      max_length=limit, truncate=cfg.truncate)
    lengths, stored = encoder.lengths(p.texts, ids=p.input_ids)

    def check_lengths() -> None:
        if lengths.min(initial=1) < 1 or stored.min(initial=1) < 1:
            i = int(np.argmin(np.minimum(lengths, stored)))
            raise ExtractionError(f"{_where(p, i)} leaves no token to store: {p.texts[i]!r}")
        if limit is not None and lengths.max(initial=0) > limit and cfg.truncate is None:
            too_long = np.flatnonzero(lengths > limit)
            i = int(too_long[0])
            raise ExtractionError(
                f"{_where(p, i)} has {lengths[i]} tokens, more than --max-length {limit} "
                f"({len(too_long)} prompt(s) are too long); pass --truncate left (keep the end) or "
                "--truncate right (keep the start), or a larger --max-length, or --context-len to cut long "
                "documents into windows"
            )

    ranks.agree(check_lengths)
    cut = None  # with --truncate: how many tokens each prompt loses (recorded per prompt)
    if cfg.truncate:
        cut = np.maximum(lengths - limit, 0) if limit is not None else np.zeros(len(lengths), np.int64)
    if limit is not None:
        lengths = np.minimum(lengths, limit)
    # the whole job's prompts: a multi-process job records the prompt set's identity (the same for any number of
    # ranks, from every share's digest); each part records its share's fingerprint (_extract_parallel)
    whole, n_prompts = (p.fingerprint(), len(p)) if ranks.world == 1 else (p.set_identity(), p.total)
    settings = cfg.settings(model_name=spec.name, revision=spec.recorded_revision, prompts_sha256=whole,
                            num_prompts=n_prompts, layers=layer_list, max_length=limit)
    job = _Job(cfg, p, spec, tok, lengths, settings, dev, captures=captures, model=model, cut=cut, arch=arch,
               ranks=ranks)
    job.layout = _layout(job)
    return job


def planned_shards(job: _Job, *, world: int = 1) -> int | None:
    """How many shards each stored site (layer and hookpoint) will hold, all ranks of a ``world``-process job
    together (None: the source's length is unknown)."""
    cfg = job.config
    widest = max((c.width or job.spec.hidden_size) for c in job.captures) if job.captures else job.spec.hidden_size
    per_shard = max(1, cfg.shard_bytes // (widest * np.dtype("float16" if cfg.dtype == "bfloat16" else cfg.dtype).itemsize))
    if job.corpus is not None:
        if job.corpus.max_tokens is None:
            return None
        windows = -(-job.corpus.max_tokens // max(1, job.corpus.context_len - 1)) + 1
        rows, last = (job.corpus.max_tokens, windows) if cfg.storage == "full_sequence" else (windows, 0)
    else:
        n = len(job.prompts) * world
        rows, last = (int(job.lengths.sum()) * world, n) if cfg.storage == "full_sequence" else (n, 0)
    return -(-rows // per_shard) + (-(-last // per_shard) if last else 0)


def _check_fits(job: _Job, output: Output, world: int) -> None:
    """A Hub output takes < 10,000 entries a folder and < 100,000 files a repo: an extraction planned past either
    is an error before the weights load (a corpus without --max-tokens is not known in advance)."""
    if output.local or not str(output).startswith("hf://"):
        return
    n = planned_shards(job, world=world)
    if n is None:
        return
    sites = len(job.settings["layers"]) * len(job.captures) + bool(job.config.logits_topk)
    if n < HUB_FOLDER_ENTRIES and n * sites + 10 < HUB_REPO_FILES:
        return
    raise InvalidArgumentError(
        f"--out {output}: this extraction makes about {n:,} shards per layer and hookpoint ({n * sites:,} files), "
        f"past the Hub's {HUB_FOLDER_ENTRIES:,} entries per folder or {HUB_REPO_FILES:,} files per repo; pass a "
        f"larger --shard-size (at most {MAX_SHARD_SIZE // 2**30}G) or extract fewer layers or tokens per repo")


def _layout(job: _Job) -> str:
    """``nested`` (a folder per site, 5-digit numbers) for 1,000 shards a site or more, or an unknown number."""
    n = planned_shards(job, world=_ranks()[1])
    return "nested" if n is None or n >= NESTED_FROM_SHARDS else "flat"


#: architectures examined on a miniature in this process, by config and tokenizer padding (examining is
#: deterministic, and a notebook extracts from the same model again and again)
_EXAMINED: dict[tuple, Architecture] = {}


def examine_model(model: str, *, revision: str | None = None, trust_remote_code: bool = False,
                  block_path: str | None = None, device: str = "cpu", compute_dtype: str = "auto") -> Architecture:
    """What ``extract`` finds about ``model`` before it loads the weights: its block list, where each named
    hookpoint is on every block (or why it does not exist there) and the inputs its forward wants."""
    cfg = ExtractionConfig(model=model, prompts=[], out=".", revision=revision, trust_remote_code=trust_remote_code,
                           block_path=block_path, device=device, compute_dtype=compute_dtype, quiet=True)
    spec = read_model_spec(model, revision=revision, trust_remote_code=trust_remote_code)
    arch, loaded = _examine_model(cfg, spec, load_tokenizer(spec), pick_device(device))
    del loaded
    return arch


def _examine_model(cfg: ExtractionConfig, spec: ModelSpec, tok: Any, dev: str) -> tuple[Architecture, Any]:
    """The model's blocks, hookpoints and inputs, found and checked on a miniature of it with random weights
    (examine.py), so that a hookpoint this architecture lacks, or an architecture lmprobe cannot read right,
    is an error before the weights load. When no miniature can be built or run, the loaded model is
    examined instead and returned, so that it loads once."""
    key = (spec.config.to_json_string(), spec.causal_lm, tok.pad_token_id, tok.padding_side, cfg.block_path,
           spec.trust_remote_code)
    if key in _EXAMINED:
        return _EXAMINED[key], None
    try:
        mini = build_miniature(spec.config, causal_lm=spec.causal_lm, trust_remote_code=spec.trust_remote_code,
                               token_ids=[i for i in (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
                                          if isinstance(i, int)])
    except ModelError as exc:
        why = str(exc)
    else:
        try:
            arch = examine(mini, pad_token_id=tok.pad_token_id, padding_side=tok.padding_side,
                           block_path=cfg.block_path)
            while len(_EXAMINED) >= 8:  # a notebook that extracts from a few models keeps their answers
                del _EXAMINED[next(iter(_EXAMINED))]
            _EXAMINED[key] = arch
            return arch, None
        except ModelError:
            raise
        except Exception as exc:  # the miniature does not run: the real model decides
            why = f"the miniature does not run ({type(exc).__name__}: {one_line(exc)})"
        finally:
            del mini
    if cfg.backend == "nnsight" and cfg.remote is True:
        raise ModelError(f"cannot check this architecture without its weights here ({why}); run with --remote local")
    model, _ = load_model(spec, device=dev, compute_dtype=cfg.compute_dtype, quiet=_no_bars(cfg))
    low = next(model.parameters()).dtype.itemsize < 4
    try:
        arch = examine(model, pad_token_id=tok.pad_token_id, padding_side=tok.padding_side,
                       block_path=cfg.block_path, checked_on="loaded model",
                       tolerance=TOLERANCE["low" if low else "float32"])
    except ModelError:
        raise
    except Exception as exc:  # the model's own forward, on token ids alone, fails
        raise ModelError(f"{spec.name} does not run on token ids alone ({type(exc).__name__}: {one_line(exc)}), so "
                         f"lmprobe cannot extract from it ({why})") from exc
    return arch, model


def _plan_captures(cfg: ExtractionConfig, spec: ModelSpec, arch: Architecture, layers: list[int], model: Any,
                   dev: str) -> tuple[list[Capture], Any]:
    """The captures of ``cfg.hookpoints`` on ``layers``. Module paths are measured on a weightless skeleton of
    the model (the meta device), else on the loaded model (loaded here if it was not, and returned)."""
    custom = [hp for hp in cfg.hookpoints if hp not in NAMED]
    widths: dict = {}
    if custom:
        sites = {layer: [arch.reading(hp, layer).site for hp in custom] for layer in layers}
        try:
            widths = site_widths(skeleton(spec.config, causal_lm=spec.causal_lm,
                                          trust_remote_code=spec.trust_remote_code), arch.block_path, sites)
        except Exception:  # an architecture that cannot run on meta: measure the real one
            if model is None:
                model, _ = load_model(spec, device=dev, compute_dtype=cfg.compute_dtype, quiet=_no_bars(cfg))
            widths = site_widths(model, arch.block_path, sites)
    return plan_captures(arch, cfg.hookpoints, layers, hidden_size=spec.hidden_size, widths=widths), model


def _check_pretokenized(cfg: ExtractionConfig, p: Prompts, tok: Any, vocab: int | None) -> None:
    """Pretokenized prompts run as given: their ids must fit the model; text-only options do not apply."""
    for name, on in (("--chat-template", cfg.chat_template), ("--drop-special-tokens", cfg.drop_special_tokens)):
        if on:
            raise ExtractionError(f"{p.source} is pretokenized (an input_ids column): {name} needs text; the ids run "
                                  "as they are")
    for i, ids in enumerate(p.input_ids or []):
        check_token_ids(ids, Record(i, p.source, p.where(i).removeprefix(f"{p.source}, "), {}), vocab)
        if not p.texts[i]:
            p.texts[i] = tok.decode(ids)


def _prepare_corpus(cfg: ExtractionConfig, source: Any, spec: ModelSpec, tok: Any, limit: int | None,
                    vocab: int | None, layer_list: list[int], dev: str, ranks: Ranks) -> _Job:
    context_len = cfg.context_len or limit
    if context_len is None:
        raise ExtractionError(f"{spec.name} states no length limit; pass --context-len to choose the window length")
    if limit is not None and context_len > limit:
        raise ExtractionError(f"--context-len {context_len} is longer than {spec.name}'s limit of {limit} tokens; "
                              f"pass --context-len {limit} or less")
    affixes = affixes_of(tok, special_tokens=cfg.special_tokens)
    affixes.content_per_window(context_len)  # room for content, or a clear error now
    dropped = check_first_record(source, cfg.text_column, vocab, label_column=cfg.label_column,
                                 windows_asked=cfg.context_len is not None)
    if dropped:  # said even with --quiet: it is about what the dataset will not hold
        logger.warning(f"note: corpus extraction stores windows of documents; the source's other columns "
                       f"({', '.join(repr(c) for c in dropped)}) are not stored: join them on each row's `document` "
                       "column")
    identity = source.identity()
    if ranks.world > 1:  # each node has its own copy (paths, times): the job records rank 0's
        identity = ranks.all_gather(identity)[0]
    settings = cfg.settings(model_name=spec.name, revision=spec.recorded_revision, layers=layer_list,
                            max_length=context_len, source=identity)
    plan = CorpusPlan(source, affixes, context_len, cfg.max_tokens, vocab)
    return _Job(cfg, None, spec, tok, None, settings, dev, corpus=plan, ranks=ranks)


@dataclass(frozen=True)
class Outcome:
    """What an extraction did: the dataset, opened, and whether this run wrote it."""

    dataset: Dataset
    wrote: bool  # False: the output already held this extraction, and nothing was done


def run(cfg: ExtractionConfig) -> Dataset:
    """Run the extraction ``cfg`` describes and return the dataset, opened.

    Re-running the same extraction after an interruption continues where it stopped; a different
    configuration against a partial output is an error unless ``overwrite`` is set.
    """
    return execute(cfg).dataset


def execute(cfg: ExtractionConfig) -> Outcome:
    """``run``, also saying whether anything was written (the command line's last line depends on it)."""
    output = open_output(cfg.out)  # a bad --out is an error before the tokenizer and the weights load
    ranks = _start_ranks()
    rank, world = ranks.rank, ranks.world
    output = output.for_world(world)
    job = _prepare(cfg, ranks)
    _check_fits(job, output, world)
    done = _finished(job, output)
    if done is not None:
        if not cfg.quiet and rank == 0:
            logger.info(f"{output} already holds this extraction ({rows_text(done, corpus=cfg.corpus)}, "
                        f"{done.storage}, {done.dtype}); nothing to do")
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


def rows_text(ds: Dataset, *, corpus: bool) -> str:
    """What a dataset holds, for the last line: ``48 prompts x 6 layers x 128 dims``."""
    rows = plural(ds.num_prompts, "prompt")
    if corpus:
        rows = f"{plural(ds.num_prompts, 'window')} ({plural(int(ds.column('num_tokens').sum()), 'token')})"
    hps = "" if ds.hookpoints == ["resid_post"] else \
        f" x {plural(len(ds.hookpoints), 'hookpoint')} ({', '.join(ds.hookpoints)})"
    return f"{rows} x {plural(len(ds.layers), 'layer')}{hps} x {ds.dim} dims"


def _ranks() -> tuple[int, int]:
    """(rank, world size) of this process: torchrun's, else (0, 1)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _start_ranks() -> Ranks:
    """One process, or a rank of ``torchrun``: then the process group is joined (gloo, on the CPU, whatever the
    model runs on) with a timeout sized for long extractions (``LMPROBE_DIST_TIMEOUT`` seconds, default 14 days:
    a rank that finishes early waits for the others instead of being killed by the default ten minutes), and a
    second gloo group carries the small exchanges of reading and planning."""
    from datetime import timedelta

    rank, world = _ranks()
    if world == 1:
        return Ranks(0, 1, None)
    import torch.distributed as dist

    if not dist.is_initialized():
        timeout = float(os.environ.get("LMPROBE_DIST_TIMEOUT", 14 * 24 * 3600))
        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")

    def all_gather(value: Any) -> list:
        out: list = [None] * world
        dist.all_gather_object(out, value, group=group)
        return out

    return Ranks(rank, world, all_gather)


def _finished(job: _Job, output: Output) -> Dataset | None:
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


def _extract(job: _Job, output: Output) -> Dataset:
    """Extract into ``output``: the writer writes in its staging folder while its session takes finished files."""
    cfg, settings = job.config, job.settings
    out = output.staging()
    session = output.session(overwrite=cfg.overwrite)
    try:
        writer = DatasetWriter(
            out,
            layers=settings["layers"],
            dim=job.spec.hidden_size,
            model_name=job.spec.name,
            model_revision=settings["revision"],
            storage=cfg.storage,
            dtype=cfg.dtype,
            shard_size=cfg.shard_bytes,
            logits_k=cfg.logits_topk,
            label_type=job.prompts.label_type if job.prompts else None,
            columns=job.prompts.column_types if job.prompts else None,
            perplexity=cfg.perplexity,
            token_ids=settings["token_ids"],
            token_strings=cfg.token_strings,
            token_perplexity=cfg.perplexity,
            provenance=_provenance(cfg),
            metadata={"extraction": {"settings": settings, "architecture": _architecture_record(job)}},
            fingerprint=settings,
            # the budget only says when to stop; a batch size changes no stored value beyond float rounding
            resumable=RESUMABLE_SETTINGS + (("max_tokens",) if job.corpus is not None else ()),
            checksums=cfg.checksums,
            statistics=cfg.statistics,
            corpus=job.corpus is not None,
            truncation=job.cut is not None,  # each prompt's cut tokens, in `truncated_tokens`
            hookpoints=cfg.hookpoints,
            hookpoint_dims=job.hookpoint_dims,
            layout=job.layout,
            overwrite=cfg.overwrite,
            checkpoint_interval=cfg.checkpoint_interval,
            run={"batch_size": cfg.batch_size, "device": job.device, "checkpoint_interval": cfg.checkpoint_interval},
            name=str(output) if output.local else f"{output} (staged in {out})",
            **session.writer_callbacks(),
        )
    except BaseException:
        session.abort()
        raise
    try:
        _announce(job, writer, out, local=output.local)
        if job.corpus is not None:
            _run_corpus(writer, job)
        else:
            _run(writer, job)
    except BaseException:
        writer.abort()
        session.abort()
        raise
    writer.close()
    ds = session.finish()
    if not output.local and not cfg.quiet:
        logger.info(f"uploaded the dataset to {output}")
    return ds


def _extract_parallel(job: _Job, output: Output, rank: int, world: int) -> Dataset:
    """One rank of ``torchrun``: extract this rank's share (prompts or documents i with i % world == rank, read
    and tokenized by this rank only) into its own part of the output, then rank 0 merges the parts into one
    dataset (local moves, server-side copies: no shard passes through one machine), in prompt or source order,
    and every rank returns it."""
    import dataclasses

    import torch
    import torch.distributed as dist

    cfg = job.config
    if job.device.startswith("cuda") and torch.cuda.device_count() > 1:
        job.device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) % torch.cuda.device_count()}"
    part = output.part(rank)
    if job.prompts is not None:
        what = {"prompts_sha256": job.prompts.fingerprint(), "num_prompts": len(job.prompts)}
    else:
        what = {}
    part_job = dataclasses.replace(job, config=dataclasses.replace(cfg, quiet=cfg.quiet or rank != 0),
                                   settings={**job.settings, **what, "part": [rank, world]})
    done = _finished(part_job, part)
    if done is None:
        _extract(part_job, part)
    elif job.corpus is not None and job.corpus.max_tokens is not None:
        # a finished part still takes part in planning the budget, or the other ranks would wait for it
        for _ in stream_windows(job.corpus, job.tokenizer, cfg.text_column, resume=done.info.get("progress"),
                                rank=rank, world=world, all_gather=job.ranks.all_gather):
            pass
    dist.barrier()
    if rank == 0:
        output.merge([output.part(r) for r in range(world)], settings=job.settings,
                     order="documents" if job.corpus is not None else "positions", quiet=cfg.quiet)
    dist.barrier()
    ds = output.finished()
    if ds is None:  # pragma: no cover - rank 0 merged before the barrier
        raise ExtractionError(f"{output} holds no dataset after the merge")
    return ds


def _architecture_record(job: _Job) -> dict[str, Any]:
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


def _build_backend(job: _Job) -> Any:
    cfg = job.config
    model, job.model = job.model, None  # loaded early to locate the hookpoints, or loaded now
    if cfg.backend == "nnsight":
        if model is None and cfg.remote is not True:
            model = load_model(job.spec, device=job.device, compute_dtype=cfg.compute_dtype, quiet=_no_bars(cfg))[0]
        return build_backend(job.spec, model, job.tokenizer, block_path=job.arch.block_path, inputs=job.arch.inputs,
                             remote=cfg.remote)
    if model is None:
        model, _commit = load_model(job.spec, device=job.device, compute_dtype=cfg.compute_dtype, quiet=_no_bars(cfg))
    blocks = get_module(model, job.arch.block_path)
    return TransformersBackend(model, blocks, causal_lm=job.spec.causal_lm, inputs=job.arch.inputs)


def _run(writer: DatasetWriter, job: _Job) -> None:
    cfg = job.config
    bound_allocator_cache()  # one arena: freed batch buffers are reused by every thread
    n = len(job.prompts)
    # longest first (an out-of-memory batch shows at once), ties in input order; deterministic, so a
    # resumed run continues in the same order after the writer's num_prompts
    order = np.lexsort((np.arange(n), -job.lengths))
    done = writer.num_prompts
    if done >= n:
        return
    backend = _build_backend(job)
    tok = job.tokenizer
    if cfg.truncate:
        tok.truncation_side = cfg.truncate
    encoder = Encoder(tok, chat_template=cfg.chat_template, drop_special_tokens=cfg.drop_special_tokens,
                      max_length=job.settings["max_length"], truncate=cfg.truncate)
    bg = BackgroundWorker(lambda item: writer.add_batch(**item), max_pending=1, name="lmprobe-writer")
    bar = Progress(n, initial=done, desc="extract", unit="prompt", quiet=cfg.quiet, tokens=True)
    try:
        _loop(bg, backend, encoder, job, order, done, bar)
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


def _loop(bg: BackgroundWorker, backend: Any, encoder: Encoder, job: _Job, order: np.ndarray, done: int,
          bar: Progress) -> None:
    import torch

    cfg, p = job.config, job.prompts
    out_dtype = torch_dtype(cfg.dtype)
    layers = job.settings["layers"]
    bs = cfg.batch_size
    trim = HeapTrimmer()  # after the model loaded
    with torch.inference_mode():
        for s in range(done, len(order), bs):
            idx = order[s : s + bs]
            texts = [p.texts[i] for i in idx]
            input_ids, attention_mask, keep = encoder.batch(
                texts, ids=[p.input_ids[i] for i in idx] if p.input_ids is not None else None)
            res = backend.run(input_ids, attention_mask, layers=layers, storage=cfg.storage, out_dtype=out_dtype,
                              logits_k=cfg.logits_topk, perplexity=cfg.perplexity,
                              keep=None if encoder.plain else keep, captures=job.captures, statistics=cfg.statistics)
            item = _batch_item(job, texts, res)
            item["positions"] = idx
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
            bar.update(len(idx), tokens=n_tokens)


def _batch_item(job: _Job, texts: list[str], res: Any) -> dict[str, Any]:
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


def _run_corpus(writer: DatasetWriter, job: _Job) -> None:
    """Stream the source's documents as windows, in source order, until it ends or the budget is spent."""
    import torch

    cfg, plan, tok, ranks = job.config, job.corpus, job.tokenizer, job.ranks
    assert plan is not None
    if ranks.world > 1:  # a share of the job's budget, planned with the other ranks (ranks.py)
        stream = stream_windows(plan, tok, cfg.text_column, resume=writer.progress, rank=ranks.rank,
                                world=ranks.world, all_gather=ranks.all_gather)
    else:
        if plan.max_tokens is not None and writer.num_tokens > plan.max_tokens:
            raise ExtractionError(f"the partial output already holds {writer.num_tokens:,} tokens, more than "
                                  f"--max-tokens {plan.max_tokens:,}; pass --max-tokens {writer.num_tokens} or more to "
                                  "finish it, or --overwrite to start over")
        budget = Budget(plan.max_tokens, writer.num_tokens)
        if budget.spent:
            return
        stream = stream_windows(plan, tok, cfg.text_column, resume=writer.progress, budget=budget)
    bound_allocator_cache()
    backend = _build_backend(job)
    out_dtype = torch_dtype(cfg.dtype)
    layers = job.settings["layers"]
    left = tok.padding_side == "left"
    bg = BackgroundWorker(lambda item: writer.add_batch(**item), max_pending=1, name="lmprobe-writer")
    total = plan.max_tokens if plan.max_tokens is None or ranks.world == 1 else plan.max_tokens // ranks.world
    bar = Progress(total, initial=writer.num_tokens, desc="extract", unit="tok", quiet=cfg.quiet)
    trim = HeapTrimmer()
    try:
        with torch.inference_mode():
            for batch in batches(stream, cfg.batch_size):
                input_ids, attention_mask = pad(batch, tok.pad_token_id, left)
                res = backend.run(input_ids, attention_mask, layers=layers, storage=cfg.storage, out_dtype=out_dtype,
                                  logits_k=cfg.logits_topk, perplexity=cfg.perplexity, captures=job.captures,
                                  statistics=cfg.statistics)
                item = _batch_item(job, [w.text for w in batch], res)
                item["document"] = [w.document for w in batch]
                item["window_start"] = [w.start for w in batch]
                item["progress"] = progress_after(batch)
                bg.submit(item)
                bar.update(int(res.num_tokens.sum()), note=f"document {batch[-1].document + 1:,}")
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


def _planned_bytes(job: _Job, writer: DatasetWriter) -> tuple[int | None, str]:
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
        return tokens * per_vector + rows * logits, f"{len(p):,} prompts, {int(lengths.sum()):,} tokens ({what})"
    return rows * (per_vector + logits), f"{len(p):,} prompts ({what})"


def _announce(job: _Job, writer: DatasetWriter, out: Path, *, local: bool) -> None:
    """Say what is about to be written, and stop when the disk cannot hold it (before the model loads)."""
    cfg = job.config
    planned, what = _planned_bytes(job, writer)
    if not cfg.quiet:
        size = "size unknown (no --max-tokens)" if planned is None else f"about {format_size(planned)}"
        resumed = f", resuming after {writer.num_prompts:,} rows" if writer.num_prompts else ""
        logger.info(f"lmprobe: writing {what}: {size}{resumed}")
    if planned is None or not cfg.space_check:
        return
    if not local and cfg.storage == "pooled":  # shards go to the bucket as they close
        planned = min(planned, cfg.shard_bytes * (len(job.settings["layers"]) * len(job.captures) + 1))
    free = shutil.disk_usage(out).free
    if free < planned:
        raise OutOfSpaceError(
            f"{out} has {format_size(free)} free but this extraction will write about {format_size(planned)}; free "
            "some space, choose another --out, or pass --no-space-check to start anyway")


def _no_bars(cfg: ExtractionConfig) -> bool:
    """transformers' own bars ("Loading weights") only on a terminal: in a log file they are escape codes."""
    return cfg.quiet or not on_terminal()
