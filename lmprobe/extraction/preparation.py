"""Preparing an extraction: everything but the weights is read and checked, so that every input error surfaces
before the model loads.

The config has checked itself; here the prompts (or the corpus source), the model's config and the tokenizer
are read and checked, the architecture is examined on a miniature (examine.py), the hookpoints are planned, and
the result is a :class:`Job`: what the loop (loop.py) and the output (runner.py) need besides the config."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..base.display import one_line
from ..base.progress import on_terminal
from ..base.units import parse_size
from ..errors import (
    ExtractionError,
    InvalidArgumentError,
    ModelError,
)
from ..format.dtypes import COMPUTE_DTYPES, DTYPES
from ..format.index import encoding_options
from ..format.spec import DEFAULT_SHARD_SIZE
from ..format.values import torch_dtype
from ..storage.budget import DEFAULT_COMMITS_PER_HOUR, commits_per_hour
from ..storage.urls import is_hub_url
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
    declared_layers,
    load_model,
    load_tokenizer,
    parse_layers,
    pick_device,
    read_model_spec,
)
from .placement import Placement, placement_of
from .plan import Cluster, JobPlan, Shape, make_plan
from .prompts import Prompts, check_token_ids, read_prompts
from .sources import Record, open_source
from .tokens import Encoder
from .torchrun import Ranks
from .windows import Affixes, affixes_of, windows

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """An extraction whose inputs have been read and checked: what the runner needs besides the config."""

    config: ExtractionConfig
    prompts: Prompts | None  # prompt mode: every prompt, read and checked
    spec: ModelSpec
    tokenizer: Any
    lengths: np.ndarray | None  # prompt mode: model input length of every prompt (after truncation)
    settings: dict[str, Any]  # recorded in the dataset and compared on resume
    placement: Placement  # where the weights go: one device, or spread by accelerate (placement.py)
    corpus: CorpusPlan | None = None  # corpus mode: the source and its windows
    captures: list[Capture] = field(default_factory=list)  # what to read in each block
    model: Any = None  # the loaded model, when examining the model needed it before the writer opened
    cut: np.ndarray | None = None  # prompt mode with --truncate: tokens cut from each prompt (0: none)
    arch: Architecture | None = None  # the model's blocks, hookpoints and inputs (examine.py)
    layout: str = "flat"  # the shard file layout: nested for 1,000 shards a layer or more (format/spec.py)
    ranks: Ranks = field(default_factory=lambda: Ranks(0, 1, None))  # this process's place in a torchrun job
    shard_bytes: int = DEFAULT_SHARD_SIZE  # the shard size: --shard-size, or the plan's choice (plan.py)
    plan: JobPlan | None = None  # the job's plan (plan.py): files, staging, commits, placement

    @property
    def device(self) -> str:
        """The device of a model on one device; with ``--device-map``, the process's device before it loads."""
        return self.placement.device

    @property
    def hookpoint_dims(self) -> tuple[int, ...]:
        """Widths in the config's hookpoint order, or () when every hookpoint is as wide as the model."""
        width = {c.hookpoint: c.width or self.spec.hidden_size for c in self.captures}
        dims = tuple(width[hp] for hp in self.config.hookpoints)
        return () if all(d == self.spec.hidden_size for d in dims) else dims

    @property
    def vector_bytes(self) -> int:
        """Bytes of one stored token or prompt: every hookpoint of every layer."""
        kind = DTYPES[self.config.dtype]
        return len(self.settings["layers"]) * sum(kind.row_bytes(c.width or self.spec.hidden_size) for c in self.captures)


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


def check_layers_early(cfg: ExtractionConfig) -> None:
    """``--layers`` against the layers the model's config.json declares, read without torch or transformers (the
    same attributes ``read_model_spec`` reads), before the prompts, the tokenizer and the weights: a wrong layer is
    said in a second. A config this cannot read is checked by ``read_model_spec`` as before."""
    n = declared_layers(cfg.model, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    if n is not None:
        parse_layers(cfg.layers, n)


def prepare(cfg: ExtractionConfig, ranks: Ranks | None = None, *, token: str | bool | None = None) -> Job:
    """Read and check everything but the weights. ``token``: the Hub identity of every download of the model's
    files and of every read of an ``hf://`` prompt or corpus source (None: HF_TOKEN or the saved login); held by
    the source and the model spec in memory only, never recorded in the settings."""
    if cfg.backend == "nnsight":
        require_nnsight()
        if cfg.remote is True:
            check_api_key()
    ranks = ranks or Ranks(0, 1, None)
    check_layers_early(cfg)
    if cfg.corpus:
        p = None
        source = open_source(cfg.prompts, text_column=cfg.text_column, config=cfg.dataset_config, split=cfg.split,
                             token=token)
    elif isinstance(cfg.prompts, Prompts):
        p = cfg.prompts
    else:  # a rank reads and checks its own share only (prompt i goes to rank i % world)
        p = read_prompts(cfg.prompts, text_column=cfg.text_column, label_column=cfg.label_column,
                         dataset_config=cfg.dataset_config, split=cfg.split, rank=ranks.rank, world=ranks.world,
                         all_gather=ranks.all_gather, limit=cfg.max_prompts, token=token)
    spec = read_model_spec(cfg.model, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code, token=token)
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
    # where the weights will go, settled before they load (a bad --max-memory, accelerate missing: errors now)
    dev = placement_of(pick_device(cfg.device), device_map=cfg.device_map, max_memory=cfg.max_memory,
                       world=ranks.world)
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
        follow_plan(job)
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
                            num_prompts=n_prompts, layers=layer_list, max_length=limit, weights=job_weights(spec, ranks))
    job = Job(cfg, p, spec, tok, lengths, settings, dev, captures=captures, model=model, cut=cut, arch=arch,
               ranks=ranks)
    follow_plan(job)
    return job


def job_weights(spec: ModelSpec, ranks: Ranks) -> str | None:
    """A local model's weights fingerprint, as the job records it: rank 0's (each node has its own copy, with its
    own modification times), so that the parts of a job agree."""
    if spec.weights is None or ranks.world == 1:
        return spec.weights
    return ranks.all_gather(spec.weights)[0]


def job_shape(job: Job) -> Shape:
    """What the job stores, whole-job totals: every rank's share together (one small exchange under torchrun, so
    that every rank plans the same shard size and layout)."""
    cfg = job.config
    kind = DTYPES[cfg.dtype]  # bytes per row: the dtype's own (int8: a byte a value and a float32 scale)
    widths = [c.width or job.spec.hidden_size for c in job.captures] or [job.spec.hidden_size]
    site_row_bytes = tuple(kind.row_bytes(w) for _ in job.settings["layers"] for w in widths)
    common = {"storage": cfg.storage, "site_row_bytes": site_row_bytes, "logits_topk": cfg.logits_topk,
              "token_ids": bool(job.settings.get("token_ids")), "perplexity": cfg.perplexity,
              "hookpoints": len(widths), "model_bytes": model_bytes(job), "batch_rows": cfg.batch_size}
    if job.corpus is not None:
        if job.corpus.max_tokens is None:
            return Shape(rows=0, tokens=0, known=False, **common)
        tokens = job.corpus.max_tokens
        lengths, sample = _rank0(job, lambda: _corpus_sample(job))
        return Shape(rows=corpus_rows(tokens, lengths, job.corpus.context_len), tokens=tokens, exact=False,
                     row_tokens=lengths, **sample, **common)
    assert job.prompts is not None and job.lengths is not None
    mine = [len(job.prompts), int(job.lengths.sum())]
    rows, tokens = mine if job.ranks.world == 1 else [sum(x) for x in zip(*job.ranks.all_gather(mine), strict=True)]
    lengths, sample = _rank0(job, lambda: _prompts_sample(job))
    return Shape(rows=rows, tokens=tokens, row_tokens=lengths, **sample, **common)


def _rank0(job: Job, sample: Callable[[], tuple[tuple[int, ...], dict[str, float]]]) \
        -> tuple[tuple[int, ...], dict[str, float]]:
    """Rank 0's sample on every rank (one exchange): the ranks hold different prompts, and nodes their own copies of
    a corpus, but every rank must plan the same files, shard size and layout."""
    if job.ranks.world == 1:
        return sample()
    lengths, sizes = job.ranks.all_gather(sample() if job.ranks.rank == 0 else None)[0]
    return tuple(int(n) for n in lengths), {k: float(v) for k, v in sizes.items()}


def _corpus_sample(job: Job) -> tuple[tuple[int, ...], dict[str, float]]:
    """The stored tokens of the windows of the corpus' first documents, and its index columns' bytes a token."""
    assert job.corpus is not None
    texts = [r.values.get(job.config.text_column) for r in job.corpus.source.head(TEXT_SAMPLE_RECORDS)]
    texts = [t for t in texts if isinstance(t, str)]
    ids = job.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
    return window_lengths(ids, job.corpus.affixes, job.corpus.context_len), _sample_bytes(texts, ids)


def _prompts_sample(job: Job) -> tuple[tuple[int, ...], dict[str, float]]:
    """This rank's first prompts: their stored tokens, and the index columns' bytes a token."""
    assert job.prompts is not None and job.lengths is not None
    texts = list(job.prompts.texts[:TEXT_SAMPLE_PROMPTS])
    ids = job.prompts.input_ids[:TEXT_SAMPLE_PROMPTS] if job.prompts.input_ids is not None else \
        job.tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    return tuple(int(n) for n in job.lengths[:SAMPLE_ROWS]), _sample_bytes(texts, ids)


def window_lengths(ids: list[list[int]], affixes: Affixes, context_len: int) -> tuple[int, ...]:
    """The stored tokens of each window the sample's documents (their content ``ids``) make, in order: a document's
    windows hold ``context_len`` tokens but its last.

    >>> window_lengths([[7] * 5, [7] * 2], Affixes(prefix=(1,)), 4)
    (4, 3, 3)
    """
    per = affixes.content_per_window(context_len)
    return tuple(b - a + len(affixes) for i in ids for a, b in windows(len(i), per))[:SAMPLE_ROWS]


def corpus_rows(tokens: int, lengths: tuple[int, ...], context_len: int) -> int:
    """The rows (windows) a budget of ``tokens`` stored tokens makes, at the sample's tokens a window (documents
    shorter than a window make a row each); without a sample, full windows.

    >>> corpus_rows(1000, (4, 3, 3), 4), corpus_rows(1000, (), 4)
    (300, 250)
    """
    full = -(-tokens // context_len)
    if not lengths:
        return full
    return max(full, round(tokens * len(lengths) / sum(lengths)))


def _sample_bytes(texts: list[str], ids: list[list[int]]) -> dict[str, float]:
    """The index's text and token_ids columns, as parquet stores them, per token of a sample (the plan's defaults
    without one)."""
    tokens = sum(len(i) for i in ids)
    if not texts or tokens < 1:
        return {}

    def size(column: pa.Array) -> int:  # written as the index writes its columns (format/index.py)
        table = pa.table({"token_ids": column} if pa.types.is_list(column.type) else {"text": column})
        buf = io.BytesIO()
        pq.write_table(table, buf, **encoding_options(table.schema))
        return len(buf.getvalue())

    return {"text_bytes_per_token": max(0, size(pa.array(texts, pa.string())) - size(pa.array([""] * len(texts))))
            / tokens,
            "id_bytes_per_token": max(0, size(pa.array(ids, INDEX_TOKEN_IDS))
                                      - size(pa.array([[]] * len(ids), INDEX_TOKEN_IDS))) / tokens}


def model_bytes(job: Job) -> int:
    """The weights' bytes in the dtype the model runs in, counted on a weightless skeleton (0 when it cannot be
    built)."""
    import torch

    try:
        meta = skeleton(job.spec.config, causal_lm=job.spec.causal_lm, trust_remote_code=job.spec.trust_remote_code)
    except Exception:  # an architecture that cannot be built on meta: placement is planned without its size
        return 0
    n = sum(t.numel() for t in meta.parameters())
    name = job.config.compute_dtype
    if name == "auto":  # float32 on a CPU; the checkpoint's own dtype on a GPU
        stored = getattr(job.spec.config, "dtype", None) or getattr(job.spec.config, "torch_dtype", None)
        cfg = job.config
        on_gpu = not job.device.startswith("cpu") or any(v is not None for v in (cfg.world_size, cfg.gpus_per_node,
                                                                                 cfg.gpu_memory))
        dtype = stored if on_gpu and isinstance(stored, torch.dtype) else torch.float32
        if on_gpu and isinstance(stored, str) and stored in COMPUTE_DTYPES:
            dtype = torch_dtype(stored)
    else:
        dtype = torch_dtype(name)
    return n * dtype.itemsize


def cluster_of(cfg: ExtractionConfig, device: str, world: int) -> Cluster | None:
    """The GPUs the job runs on: the plan options (a cluster that is not here), else torchrun's world and this
    machine's GPUs; None on a CPU."""
    asked = cfg.world_size is not None or cfg.gpus_per_node is not None or cfg.gpu_memory is not None
    if cfg.device == "cpu" or not asked and not device.startswith("cuda"):
        return None  # processes on CPUs (--device cpu --world-size N: N of them, on one machine)
    count, memory = 0, 0
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count()
        memory = torch.cuda.get_device_properties(0).total_memory if count else 0
    per_node = cfg.gpus_per_node or count or DEFAULT_GPUS_PER_NODE
    gpus = cfg.world_size
    if gpus is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gpus = world * (max(1, count // local) if cfg.device_map and count else 1)
    memory = parse_size(cfg.gpu_memory) if cfg.gpu_memory is not None else memory or DEFAULT_GPU_MEMORY
    return Cluster(gpus=gpus, gpus_per_node=per_node, gpu_memory=memory)


def plan_job(job: Job) -> JobPlan:
    """The job's plan (plan.py) for this job's output and cluster."""
    cfg = job.config
    out = os.fspath(cfg.out)
    return make_plan(job_shape(job), destination=out, cluster=cluster_of(cfg, job.device, job.ranks.world),
                     shard_bytes=cfg.shard_bytes, commits_per_hour=commits_per_hour() if is_hub_url(out)
                     else DEFAULT_COMMITS_PER_HOUR, world=cfg.world_size or job.ranks.world)


def follow_plan(job: Job) -> None:
    """Take the plan's shard size and layout (every rank plans the same from the same totals)."""
    plan = job.plan = plan_job(job)
    job.shard_bytes, job.layout = plan.shard_bytes, plan.layout


def check_plan(job: Job) -> None:
    """A plan that cannot work is an error before the weights load, with its numbers and the setting that fixes it."""
    plan = job.plan
    if plan is None:
        return
    if plan.refused:
        raise InvalidArgumentError(f"--out {job.config.out}: {plan.refused}")
    if plan.gpus_per_rank > 1 and job.config.device_map is None:
        raise InvalidArgumentError(f"the model does not fit one GPU: {plan.placement}")


#: the index's token_ids column type (format/index.py)
INDEX_TOKEN_IDS = pa.list_(pa.int64())

#: records of a corpus (prompts of a prompt file) whose text measures the index's text column for the plan
TEXT_SAMPLE_RECORDS = 64
#: the rows whose lengths tell the plan how sequence shards pack (plan.Shape.row_tokens)
SAMPLE_ROWS = 4096
TEXT_SAMPLE_PROMPTS = 2000

#: the plan's cluster when nothing says otherwise: a node of eight 80 GB GPUs
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_GPU_MEMORY = 80 * 10**9

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
    arch, loaded = _examine_model(cfg, spec, load_tokenizer(spec), Placement(pick_device(device)))
    del loaded
    return arch


def _examine_model(cfg: ExtractionConfig, spec: ModelSpec, tok: Any, dev: Placement) -> tuple[Architecture, Any]:
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
    model, _ = load_model(spec, placement=dev, compute_dtype=cfg.compute_dtype, quiet=no_bars(cfg))
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
                   dev: Placement) -> tuple[list[Capture], Any]:
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
                model, _ = load_model(spec, placement=dev, compute_dtype=cfg.compute_dtype, quiet=no_bars(cfg))
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
                    vocab: int | None, layer_list: list[int], dev: Placement, ranks: Ranks) -> Job:
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
        logger.warning("note: corpus extraction stores windows of documents; the source's other columns "
                       "(%s) are not stored: join them on each row's `document` column",
                       ', '.join(repr(c) for c in dropped))
    identity = source.identity()
    if ranks.world > 1:  # each node has its own copy (paths, times): the job records rank 0's
        identity = ranks.all_gather(identity)[0]
    settings = cfg.settings(model_name=spec.name, revision=spec.recorded_revision, layers=layer_list,
                            max_length=context_len, source=identity, weights=job_weights(spec, ranks))
    plan = CorpusPlan(source, affixes, context_len, cfg.max_tokens, vocab)
    return Job(cfg, None, spec, tok, None, settings, dev, corpus=plan, ranks=ranks)


def no_bars(cfg: ExtractionConfig) -> bool:
    """transformers' own bars ("Loading weights") only on a terminal: in a log file they are escape codes."""
    return cfg.quiet or not on_terminal()
