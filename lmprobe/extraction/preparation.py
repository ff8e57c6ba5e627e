"""Preparing an extraction: everything but the weights is read and checked, so that every input error surfaces
before the model loads.

The config has checked itself; here the prompts (or the corpus source), the model's config and the tokenizer
are read and checked, the architecture is examined on a miniature (examine.py), the hookpoints are planned, and
the result is a :class:`Job`: what the loop (loop.py) and the output (runner.py) need besides the config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..base.display import one_line
from ..base.progress import logger, on_terminal
from ..errors import (
    ExtractionError,
    InvalidArgumentError,
    ModelError,
)
from ..format.spec import (
    DEFAULT_SHARD_SIZE,
    HUB_FOLDER_ENTRIES,
    HUB_REPO_FILES,
    MAX_SHARD_SIZE,
    NESTED_FROM_SHARDS,
)
from .backend_nnsight import check_api_key, require_nnsight
from .config import ExtractionConfig
from .corpus import (
    CorpusPlan,
    check_first_record,
)
from .examine import TOLERANCE, Architecture, examine, plan_captures, site_widths
from .hookpoints import NAMED, Capture
from .miniature import build_miniature, skeleton
from .model import (
    ModelSpec,
    load_model,
    load_tokenizer,
    parse_layers,
    pick_device,
    read_model_spec,
)
from .outputs import Output
from .prompts import Prompts, check_token_ids, read_prompts
from .sources import Record, open_source
from .tokens import Encoder
from .torchrun import Ranks, rank_and_world
from .windows import affixes_of


@dataclass
class Job:
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
    shard_bytes: int = DEFAULT_SHARD_SIZE  # the shard size: --shard-size, or the plan's choice (plan.py)

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


def prepare(cfg: ExtractionConfig, ranks: Ranks | None = None) -> Job:
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
                         all_gather=ranks.all_gather, limit=cfg.max_prompts)
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
        job.shard_bytes = cfg.shard_bytes or DEFAULT_SHARD_SIZE
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
    job = Job(cfg, p, spec, tok, lengths, settings, dev, captures=captures, model=model, cut=cut, arch=arch,
               ranks=ranks, shard_bytes=cfg.shard_bytes or DEFAULT_SHARD_SIZE)
    job.layout = _layout(job)
    return job


def planned_shards(job: Job, *, world: int = 1) -> int | None:
    """How many shards each stored site (layer and hookpoint) will hold, all ranks of a ``world``-process job
    together (None: the source's length is unknown)."""
    cfg = job.config
    widest = max((c.width or job.spec.hidden_size) for c in job.captures) if job.captures else job.spec.hidden_size
    per_shard = max(1, job.shard_bytes // (widest * np.dtype("float16" if cfg.dtype == "bfloat16" else cfg.dtype).itemsize))
    if job.corpus is not None:
        if job.corpus.max_tokens is None:
            return None
        windows = -(-job.corpus.max_tokens // max(1, job.corpus.context_len - 1)) + 1
        rows, last = (job.corpus.max_tokens, windows) if cfg.storage == "full_sequence" else (windows, 0)
    else:
        n = len(job.prompts) * world
        rows, last = (int(job.lengths.sum()) * world, n) if cfg.storage == "full_sequence" else (n, 0)
    return -(-rows // per_shard) + (-(-last // per_shard) if last else 0)


def check_fits(job: Job, output: Output, world: int) -> None:
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


def _layout(job: Job) -> str:
    """``nested`` (a folder per site, 5-digit numbers) for 1,000 shards a site or more, or an unknown number."""
    n = planned_shards(job, world=rank_and_world()[1])
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
    model, _ = load_model(spec, device=dev, compute_dtype=cfg.compute_dtype, quiet=no_bars(cfg))
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
                model, _ = load_model(spec, device=dev, compute_dtype=cfg.compute_dtype, quiet=no_bars(cfg))
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
                    vocab: int | None, layer_list: list[int], dev: str, ranks: Ranks) -> Job:
    context_len = cfg.context_len or limit
    if context_len is None:
        raise ExtractionError(f"{spec.name} states no length limit; pass --context-len to choose the window length")
    if limit is not None and context_len > limit:
        raise ExtractionError(f"--context-len {context_len} is longer than {spec.name}'s limit of {limit} tokens; "
                              f"pass --context-len {limit} or less")
    affixes = affixes_of(tok, special_tokens=cfg.special_tokens)
    affixes.content_per_window(context_len)  # room for content, or a clear error now
    dropped: list[str] = []

    def first_record() -> None:
        dropped.extend(check_first_record(source, cfg.text_column, vocab, label_column=cfg.label_column,
                                          windows_asked=cfg.context_len is not None))

    # one rank reads the first record, the others take its verdict: reading it means reading a parquet file's
    # first row group, which would otherwise cost every rank of a job one row group more than its share
    ranks.agree(first_record if ranks.rank == 0 else lambda: None)
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
    return Job(cfg, None, spec, tok, None, settings, dev, corpus=plan, ranks=ranks)


def no_bars(cfg: ExtractionConfig) -> bool:
    """transformers' own bars ("Loading weights") only on a terminal: in a log file they are escape codes."""
    return cfg.quiet or not on_terminal()
