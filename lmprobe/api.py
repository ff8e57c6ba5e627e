"""The Python API: what ``import lmprobe`` offers, with real signatures.

>>> import lmprobe
>>> ds = lmprobe.extract("lmprobe-tiny", "examples/prompts.jsonl", out="out/tiny")   # doctest: +SKIP
>>> ds = lmprobe.load("out/tiny")                                                     # doctest: +SKIP
>>> lmprobe.push_to_hub("out/tiny", "me/tiny-acts")                                   # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from .extraction.config import ExtractionConfig
from .extraction.examine import Architecture
from .extraction.preparation import examine_model
from .extraction.runner import run
from .format.merge import merge_datasets
from .format.reader import Dataset, open_local
from .format.validate import Report
from .format.validate import validate as validate_format
from .opening import load
from .pages.features import features
from .pages.report import report
from .publish.attachments import validate_attachments
from .publish.pull import pull
from .publish.push import push_to_hub
from .saelens import export_saelens, import_saelens

__all__ = ["export_saelens", "extract", "features", "import_saelens", "load", "merge", "pull", "push_to_hub", "report",
           "validate"]


def extract(
    model: str,
    prompts: Any,
    *,
    out: str | os.PathLike,
    layers: str | int | list[int] | None = "all",
    hookpoints: str | list[str] = "resid_post",
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
    dataset_config: str | None = None,
    split: str = "train",
    context_len: int | None = None,
    max_tokens: int | str | None = None,
    special_tokens: bool = True,
    space_check: bool = True,
    revision: str | None = None,
    trust_remote_code: bool = False,
    backend: Literal["transformers", "nnsight"] = "transformers",
    remote: bool | Literal["local"] = False,
    block_path: str | None = None,
    checkpoint_interval: float = 30.0,
    checksums: bool = True,
    statistics: bool = True,
    drop_special_tokens: bool = False,
    chat_template: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
) -> Dataset:
    """Run ``model`` over ``prompts`` and write an lmprobe dataset to ``out``; return it, opened.

    >>> ds = lmprobe.extract("lmprobe-tiny", "examples/prompts.jsonl", out="out/tiny")  # doctest: +SKIP
    >>> ds.hidden(ds.layers[-1]).shape                                                  # doctest: +SKIP

    ``prompts`` may also be a folder of prompt files or a Hugging Face dataset
    (``hf://datasets/OWNER/NAME``). With ``context_len`` or ``max_tokens`` it is read as a corpus:
    streamed, every document cut into windows, one row each, up to exactly ``max_tokens`` tokens.

    Every option is a field of ``lmprobe.ExtractionConfig`` (its docstrings say what each does).
    Re-running the same call after an interruption continues where it stopped; a different
    configuration against a partial output is an error unless ``overwrite=True``.
    """
    settings = {k: v for k, v in locals().items() if k in ExtractionConfig.field_names()}
    return run(ExtractionConfig(**settings))


def hookpoints(model: str, *, revision: str | None = None, trust_remote_code: bool = False,
               block_path: str | None = None) -> Architecture:
    """Where each named hookpoint is on every block of ``model``, or why it does not exist there, as
    ``extract`` finds and checks it before the weights load (docs/hookpoints.md).

    >>> arch = lmprobe.hookpoints("lmprobe-tiny")               # doctest: +SKIP
    >>> arch.layers_with("attn_out")                            # doctest: +SKIP
    [0, 1, 2, 3, 4, 5]
    >>> print(arch.describe())                                  # doctest: +SKIP
    """
    return examine_model(model, revision=revision, trust_remote_code=trust_remote_code, block_path=block_path)


def validate(path: str | os.PathLike, *, checksums: bool = True) -> Report:
    """Check the dataset folder ``path`` against the format document, and the attachments its index records.

    Returns a report with ``.ok``, ``.errors`` and ``.warnings`` (``report.raise_for_errors()``
    raises ValidationError listing them).

    >>> lmprobe.validate("out/tiny").ok                        # doctest: +SKIP
    True
    """
    rep = validate_format(path, checksums=checksums)
    if rep.info is not None:
        validate_attachments(path, rep.info, rep)
    return rep


def merge(parts: Sequence[str | os.PathLike | Dataset], out: str | os.PathLike, *, overwrite: bool = False) -> Dataset:
    """Combine datasets made by independent jobs (same model and settings, in this order) into ``out``.

    Parts are local folders, Hub repos or object-storage URLs (anything ``lmprobe.load`` opens);
    shards are linked or copied, never rewritten.

    >>> lmprobe.merge(["job-0", "job-1"], "merged").num_prompts   # doctest: +SKIP
    """
    datasets = [p if isinstance(p, Dataset) else load(p) for p in parts]
    merge_datasets(datasets, out, overwrite=overwrite)
    return open_local(Path(out))
