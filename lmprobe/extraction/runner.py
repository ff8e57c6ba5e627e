"""``lmprobe.extract``: prompts + model -> an lmprobe dataset, resumable, with the writer on a thread."""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import LmprobeError, OutputExistsError
from ..format.spec import HIDDEN_DTYPES, INDEX_PATH, STORAGES
from ..units import parse_size
from .model import (
    ModelError,
    find_blocks,
    load_model,
    load_tokenizer,
    parse_layers,
    pick_device,
    read_model_spec,
)
from .prompts import Prompts, read_prompts


class ExtractionError(LmprobeError, ValueError):
    """An extraction setting is invalid; raised before the model loads."""


class _BackgroundWriter:
    """Runs ``writer.add_batch`` on a thread so the next forward pass overlaps the disk writes."""

    def __init__(self, writer: Any, maxsize: int = 1):
        self.writer = writer
        self.q: queue.Queue = queue.Queue(maxsize=maxsize)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._drain, name="lmprobe-writer", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is None:
                try:
                    self.writer.add_batch(**item)
                except BaseException as exc:  # handed to the main thread
                    self.error = exc
            del item  # do not hold this batch while waiting for the next one

    def put(self, item: dict) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(item)

    def stop(self) -> None:
        """Let the thread finish what it holds and end, without raising its error."""
        self.q.put(None)
        self.thread.join()

    def finish(self) -> None:
        self.stop()
        if self.error is not None:
            raise self.error


def _default_max_length(tok: Any, config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(text, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    m = getattr(tok, "model_max_length", None)
    return m if isinstance(m, int) and 0 < m < 10**7 else None


def _where(prompts: Prompts, i: int) -> str:
    return f"prompt {i}" if prompts.source in ("prompts", "DataFrame", "<memory>") else f"{prompts.source} prompt {i}"


def _check_settings(storage, dtype, compute_dtype, batch_size, logits_topk, truncate, max_length, backend) -> None:
    if storage not in STORAGES:
        raise ExtractionError(f"storage must be one of {list(STORAGES)}, got {storage!r}")
    if dtype not in HIDDEN_DTYPES:
        raise ExtractionError(f"dtype must be one of {list(HIDDEN_DTYPES)}, got {dtype!r}")
    if compute_dtype not in ("auto", *HIDDEN_DTYPES):
        raise ExtractionError(f"compute_dtype must be auto or one of {list(HIDDEN_DTYPES)}, got {compute_dtype!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ExtractionError(f"batch_size must be a positive integer, got {batch_size!r}")
    if logits_topk is not None and (not isinstance(logits_topk, int) or logits_topk < 1):
        raise ExtractionError(f"logits_topk must be a positive integer, got {logits_topk!r}")
    if truncate not in (None, "left", "right"):
        raise ExtractionError(f"truncate must be 'left', 'right' or None, got {truncate!r}")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ExtractionError(f"max_length must be a positive integer, got {max_length!r}")
    if backend not in ("transformers", "nnsight"):
        raise ExtractionError(f"unknown backend {backend!r}; use 'transformers' or 'nnsight'")


def extract(
    model: str,
    prompts: Any,
    *,
    out: str | os.PathLike,
    layers: str | int | list[int] | None = "all",
    storage: Literal["pooled", "full_sequence"] = "pooled",
    logits_topk: int | None = None,
    perplexity: bool = False,
    token_strings: bool = False,
    token_ids: bool = False,
    dtype: Literal["float32", "float16", "bfloat16"] = "float32",
    batch_size: int = 8,
    max_length: int | None = None,
    truncate: Literal["left", "right"] | None = None,
    shard_size: int | str = "1GiB",
    device: str = "auto",
    compute_dtype: str = "auto",
    text_column: str = "text",
    label_column: str | None = "label",
    revision: str | None = None,
    trust_remote_code: bool = False,
    quiet: bool = False,
    overwrite: bool = False,
    backend: Literal["transformers", "nnsight"] = "transformers",
    remote: bool | Literal["local"] = False,
    block_path: str | None = None,
    checkpoint_interval: float = 30.0,
    checksums: bool = True,
    statistics: bool = True,
    drop_special_tokens: bool = False,
    chat_template: bool = False,
):
    """Run ``model`` over ``prompts`` and write an lmprobe dataset to ``out``; return it loaded.

    >>> ds = lmprobe.extract("lmprobe-tiny", "examples/prompts.jsonl", out="out/tiny")  # doctest: +SKIP
    >>> ds.hidden(ds.layers[-1]).shape                                                  # doctest: +SKIP

    Re-running the same call after an interruption continues where it stopped; a different
    configuration against a partial output is an error unless ``overwrite=True``.
    """

    # ---- settings, prompts, config and tokenizer: every input error surfaces before the weights load
    _check_settings(storage, dtype, compute_dtype, batch_size, logits_topk, truncate, max_length, backend)
    if remote not in (False, True, "local"):
        raise ExtractionError(f"remote must be False, True or 'local', got {remote!r}")
    if remote and backend != "nnsight":
        raise ExtractionError("remote execution needs backend='nnsight' (--backend nnsight --remote)")
    if backend == "nnsight":
        from .backend_nnsight import check_api_key, require_nnsight

        require_nnsight()
        if remote is True:
            check_api_key()
    shard_bytes = parse_size(shard_size)
    p = prompts if isinstance(prompts, Prompts) else read_prompts(prompts, text_column=text_column,
                                                                   label_column=label_column)
    spec = read_model_spec(model, revision=revision, trust_remote_code=trust_remote_code)
    layer_list = parse_layers(layers, spec.num_layers)
    if (logits_topk or perplexity) and not spec.causal_lm:
        asked = "--logits-topk" if logits_topk else "--perplexity"
        kind = ", ".join(spec.config.architectures or [spec.config.model_type])
        raise ModelError(
            f"{spec.name} has no language-model head ({kind}); it gives hidden states only, so {asked} "
            "cannot be computed"
        )
    text_cfg = spec.config.get_text_config() if hasattr(spec.config, "get_text_config") else spec.config
    vocab = getattr(text_cfg, "vocab_size", None)
    if logits_topk and isinstance(vocab, int) and logits_topk > vocab:
        raise ExtractionError(f"logits_topk={logits_topk} is larger than the vocabulary ({vocab})")
    dev = pick_device(device)

    tok = load_tokenizer(spec)
    limit = max_length or _default_max_length(tok, spec.config)
    from .tokens import Encoder

    encoder = Encoder(tok, chat_template=chat_template, drop_special_tokens=drop_special_tokens, max_length=limit,
                      truncate=truncate)
    lengths, stored = encoder.lengths(p.texts)
    if lengths.min(initial=1) < 1 or stored.min(initial=1) < 1:
        i = int(np.argmin(np.minimum(lengths, stored)))
        raise ExtractionError(f"{_where(p, i)} leaves no token to store: {p.texts[i]!r}")
    if limit is not None and lengths.max(initial=0) > limit:
        too_long = np.flatnonzero(lengths > limit)
        if truncate is None:
            i = int(too_long[0])
            raise ExtractionError(
                f"{_where(p, i)} has {lengths[i]} tokens, more than --max-length {limit} "
                f"({len(too_long)} prompt(s) are too long); pass --truncate left (keep the end) or "
                "--truncate right (keep the start), or a larger --max-length"
            )
        lengths = np.minimum(lengths, limit)

    revision_hash = None if spec.local else (getattr(spec.config, "_commit_hash", None) or revision)
    settings = {
        "model": spec.name,
        "revision": revision_hash,
        "prompts_sha256": p.fingerprint(),
        "num_prompts": len(p),
        "layers": layer_list,
        "storage": storage,
        "dtype": dtype,
        "compute_dtype": compute_dtype,
        "logits_topk": logits_topk,
        "perplexity": perplexity,
        "token_ids": token_ids or token_strings,
        "token_strings": token_strings,
        "batch_size": batch_size,
        "max_length": limit,
        "truncate": truncate,
        "backend": backend,
        "remote": remote,
        "statistics": statistics,
        "drop_special_tokens": drop_special_tokens,
        "chat_template": chat_template,
        "processing_order": "length_descending",
    }
    from ..remote import is_remote_url

    if is_remote_url(out):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ExtractionError("multi-process extraction writes to a local folder; push or copy it afterwards")
        return _extract_remote(str(out), p, spec, tok, lengths, settings, overwrite=overwrite, quiet=quiet, dev=dev,
                               block_path=block_path, shard_bytes=shard_bytes, checksums=checksums,
                               statistics=statistics, checkpoint_interval=checkpoint_interval)
    out = Path(out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        return _extract_distributed(out, p, spec, tok, lengths, settings, overwrite=overwrite, quiet=quiet, dev=dev,
                                    block_path=block_path, writer_kwargs=dict(
                                        shard_bytes=shard_bytes, checksums=checksums, statistics=statistics,
                                        checkpoint_interval=checkpoint_interval))
    return _extract_to(out, p, spec, tok, lengths, settings, overwrite=overwrite, quiet=quiet, dev=dev,
                       block_path=block_path, shard_bytes=shard_bytes, checksums=checksums, statistics=statistics,
                       checkpoint_interval=checkpoint_interval)


def _extract_remote(url: str, p: Prompts, spec: Any, tok: Any, lengths: np.ndarray, settings: dict, **kw: Any):
    """Extract into a local staging folder while a background thread uploads finished shards to ``url``."""
    from ..errors import DatasetNotFoundError
    from ..remote import UploadSink, cache_dir, load_remote

    if not kw["overwrite"]:
        try:
            ds = load_remote(url)
        except DatasetNotFoundError:
            ds = None
        if ds is not None:
            if (ds.info.get("extraction") or {}).get("settings") == settings:
                if not kw["quiet"]:
                    print(f"{url} already holds this extraction; nothing to do", file=sys.stderr)
                return ds
            raise OutputExistsError(f"{url} already holds a dataset made with other settings; pass --overwrite")
    local = cache_dir(url, "outputs")
    sink = UploadSink(url, local)
    sink.submit_existing()  # shards an interrupted run finished but may not have uploaded
    try:
        _extract_to(local, p, spec, tok, lengths, settings, on_file_complete=sink.submit, **kw)
    except BaseException:
        sink.abort()
        raise
    sink.finish()
    if not kw["quiet"]:
        print(f"uploaded the dataset to {url}", file=sys.stderr)
    return load_remote(url)


def _extract_to(out: Path, p: Prompts, spec: Any, tok: Any, lengths: np.ndarray, settings: dict, *, overwrite: bool,
                quiet: bool, dev: str, block_path: str | None, shard_bytes: int, checksums: bool, statistics: bool,
                checkpoint_interval: float, on_file_complete: Any = None):
    from ..format.reader import load
    from ..format.writer import DatasetWriter

    layer_list, storage, dtype = settings["layers"], settings["storage"], settings["dtype"]
    logits_topk, perplexity = settings["logits_topk"], settings["perplexity"]
    if (out / INDEX_PATH).exists() and not overwrite:
        ds = load(out)
        if (ds.info.get("extraction") or {}).get("settings") == settings:
            if not quiet:
                print(f"{out} already holds this extraction; nothing to do", file=sys.stderr)
            return ds
        raise OutputExistsError(
            f"{out} already holds a dataset made with other settings; pass --overwrite to replace it, "
            "or choose another --out"
        )

    writer = DatasetWriter(
        out,
        layers=layer_list,
        dim=spec.hidden_size,
        model_name=spec.name,
        model_revision=settings["revision"],
        storage=storage,
        dtype=dtype,
        shard_size=shard_bytes,
        logits_k=logits_topk,
        label_type=p.label_type,
        columns=p.column_types,
        perplexity=perplexity,
        token_ids=settings["token_ids"],
        token_strings=settings["token_strings"],
        token_perplexity=perplexity,
        provenance=_provenance(settings["backend"], settings["remote"]),
        extra_info={"extraction": {"settings": settings}},
        fingerprint=settings,
        checksums=checksums,
        statistics=statistics,
        overwrite=overwrite,
        checkpoint_interval=checkpoint_interval,
        on_file_complete=on_file_complete,
    )
    try:
        _run(writer, p, spec, tok, lengths, settings, dev=dev, quiet=quiet, block_path=block_path)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return load(out)


def _extract_distributed(out: Path, p: Prompts, spec: Any, tok: Any, lengths: np.ndarray, settings: dict, *,
                         overwrite: bool, quiet: bool, dev: str, block_path: str | None, writer_kwargs: dict):
    """One rank of ``torchrun``: extract a contiguous slice of the prompts into its own part, then rank 0
    merges the parts into ``out`` (files moved, not copied) and every rank returns the merged dataset."""
    import shutil

    import torch
    import torch.distributed as dist

    from ..format.merge import merge_datasets
    from ..format.reader import load

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.startswith("cuda") else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if dev.startswith("cuda") and torch.cuda.device_count() > 1:
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) % torch.cuda.device_count()}"
    done = (out / INDEX_PATH).exists() and not overwrite
    if done and (load(out).info.get("extraction") or {}).get("settings") != settings:
        raise OutputExistsError(f"{out} already holds a dataset made with other settings; pass --overwrite")
    if not done:
        n = len(p)
        lo, hi = rank * n // world, (rank + 1) * n // world
        part = Prompts(p.texts[lo:hi], p.labels[lo:hi] if p.labels is not None else None, p.label_type,
                       {c: v[lo:hi] for c, v in p.columns.items()}, p.column_types, p.source)
        part_settings = {**settings, "prompts_sha256": part.fingerprint(), "num_prompts": len(part),
                         "part": [rank, world]}
        parts_dir = out / ".lmprobe-parts"
        _extract_to(parts_dir / f"part-{rank:05d}", part, spec, tok, lengths[lo:hi], part_settings,
                    overwrite=overwrite, quiet=quiet or rank != 0, dev=dev, block_path=block_path,
                    shard_bytes=writer_kwargs["shard_bytes"], checksums=writer_kwargs["checksums"],
                    statistics=writer_kwargs["statistics"], checkpoint_interval=writer_kwargs["checkpoint_interval"])
        dist.barrier()
        if rank == 0:
            parts = [parts_dir / f"part-{r:05d}" for r in range(world)]
            merge_datasets(parts, out, overwrite=overwrite, move=True, settings=settings)
            shutil.rmtree(parts_dir)
    dist.barrier()
    return load(out)


def _provenance(backend: str, remote: bool | str) -> dict:
    if backend != "nnsight":
        return {"extraction_backend": "local"}
    from .backend_nnsight import nnsight_version

    return {"extraction_backend": "nnsight", "nnsight_version": nnsight_version(), "nnsight_remote": remote}


def _run(writer: Any, p: Prompts, spec: Any, tok: Any, lengths: np.ndarray, settings: dict, *, dev: str,
         quiet: bool, block_path: str | None) -> None:
    import torch

    from .._alloc import bound_allocator_cache
    from .backend_hf import TransformersBackend

    bound_allocator_cache()  # batch buffers go back to the system when freed: memory stays bounded
    n = len(p)
    # longest first (an out-of-memory batch shows at once), ties in input order; deterministic, so a
    # resumed run continues in the same order after the writer's num_prompts
    order = np.lexsort((np.arange(n), -lengths))
    done = writer.num_prompts
    if done >= n:
        return
    if settings["backend"] == "nnsight":
        from .backend_nnsight import build_backend

        remote = settings["remote"]
        model = None if remote is True else load_model(spec, device=dev, compute_dtype=settings["compute_dtype"],
                                                           quiet=quiet)[0]
        backend = build_backend(spec, model, tok, block_path=block_path, remote=remote)
    else:
        model, _commit = load_model(spec, device=dev, compute_dtype=settings["compute_dtype"], quiet=quiet)
        blocks = find_blocks(model, spec.num_layers, block_path)
        backend = TransformersBackend(model, blocks, causal_lm=spec.causal_lm)
    out_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[settings["dtype"]]
    if settings["truncate"]:
        tok.truncation_side = settings["truncate"]
    from .tokens import Encoder

    encoder = Encoder(tok, chat_template=settings.get("chat_template", False),
                      drop_special_tokens=settings.get("drop_special_tokens", False),
                      max_length=settings["max_length"], truncate=settings["truncate"])
    bg = _BackgroundWriter(writer)
    bar = _progress(n, done, quiet)
    try:
        _loop(bg, backend, tok, encoder, p, order, done, settings, out_dtype, bar)
    except KeyboardInterrupt:
        bg.stop()
        writer.checkpoint()  # keep every finished batch: the next run resumes after it
        raise
    except BaseException:
        bg.stop()
        if bg.error is None:
            writer.checkpoint()  # the forward pass failed (a remote error, OOM): keep the finished batches
        raise
    finally:
        if bar is not None:
            bar.close()
    bg.finish()


def _loop(bg: _BackgroundWriter, backend: Any, tok: Any, encoder: Any, p: Prompts, order: np.ndarray, done: int,
          settings: dict, out_dtype: Any, bar: Any) -> None:
    import torch

    bs = settings["batch_size"]
    t0, tokens = time.monotonic(), 0
    with torch.inference_mode():
        for s in range(done, len(order), bs):
            idx = order[s : s + bs]
            texts = [p.texts[i] for i in idx]
            input_ids, attention_mask, keep = encoder.batch(texts)
            res = backend.run(input_ids, attention_mask, layers=settings["layers"],
                              storage=settings["storage"], out_dtype=out_dtype,
                              logits_k=settings["logits_topk"], perplexity=settings["perplexity"],
                              keep=None if encoder.plain else keep)
            item: dict[str, Any] = {"texts": texts, "hidden": res.hidden, "num_tokens": res.num_tokens,
                                    "positions": idx}
            if p.label_type is not None:
                item["labels"] = [p.labels[i] for i in idx]
            if p.columns:
                item["columns"] = {c: [v[i] for i in idx] for c, v in p.columns.items()}
            if settings["logits_topk"]:
                item["logits_values"], item["logits_indices"] = res.logits_values, res.logits_indices
            if settings["perplexity"]:
                item["perplexity_mean"] = res.perplexity["mean"]
                item["perplexity_min"] = res.perplexity["min"]
                item["perplexity_max"] = res.perplexity["max"]
                item["token_perplexity"] = res.perplexity["token"]
            if settings["token_ids"]:
                item["token_ids"] = res.token_ids
            if settings["token_strings"]:
                item["token_strings"] = [tok.batch_decode([[t] for t in ids]) for ids in res.token_ids]
            bg.put(item)
            n_tokens = int(res.num_tokens.sum())
            del item, res  # the writer owns the batch now; free it while the next one computes
            tokens += n_tokens
            if bar is not None:
                bar.set_postfix_str(f"{tokens / max(time.monotonic() - t0, 1e-9):,.0f} tok/s", refresh=False)
                bar.update(len(idx))


def _progress(total: int, initial: int, quiet: bool):
    """A tqdm bar (prompts/s, ETA; tokens/s in the postfix), or None when quiet or not on a terminal."""
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="prompt", desc="extract", dynamic_ncols=True, smoothing=0.1)
