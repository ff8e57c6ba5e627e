"""The Python API: what ``import lmprobe`` offers, with real signatures.

>>> import lmprobe
>>> ds = lmprobe.extract("lmprobe-tiny", "examples/prompts.jsonl", out="out/tiny")   # doctest: +SKIP
>>> ds = lmprobe.load("out/tiny")                                                     # doctest: +SKIP
>>> lmprobe.push_to_hub("out/tiny", "me/tiny-acts")                                   # doctest: +SKIP
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .base.fields import settings_doc, settings_signature
from .errors import HubUnreachableError, InvalidArgumentError
from .extraction.config import ExtractionConfig
from .extraction.examine import Architecture
from .extraction.plan import JobPlan
from .extraction.preparation import examine_model
from .extraction.runner import Outcome, execute
from .extraction.runner import plan as plan_job
from .extraction.torchrun import peer_stopped, rank_and_world
from .format.merge import merge_datasets
from .format.reader import Dataset, open_local
from .format.validate import Report
from .format.validate import validate as validate_format
from .opening import load
from .pages.features import features
from .pages.report import report
from .publish.attachments import validate_attachments
from .publish.check import validate_hub
from .publish.pull import pull
from .publish.push import push_to_hub
from .saelens import export_saelens, import_saelens
from .storage.hub import parse_dataset_ref
from .storage.objectstore import is_object_store_url

__all__ = ["export_saelens", "extract", "features", "hookpoints", "import_saelens", "load", "merge", "plan", "pull",
           "push_to_hub", "report", "run_extraction", "validate"]


def extract(model: str, prompts: Any, *, out: str | os.PathLike, token: str | None = None, **options: Any) -> Dataset:
    """Run ``model`` over ``prompts`` and write an lmprobe dataset to ``out``; return it, opened.

    >>> ds = lmprobe.extract("lmprobe-tiny", "examples/prompts.jsonl", out="out/tiny")  # doctest: +SKIP
    >>> ds.hidden(ds.layers[-1]).shape                                                  # doctest: +SKIP

    ``prompts`` may also be a folder of prompt files or a Hugging Face dataset
    (``hf://datasets/OWNER/NAME``). With ``context_len`` or ``max_tokens`` it is read as a corpus:
    streamed, every document cut into windows, one row each, up to exactly ``max_tokens`` tokens.
    With ``push="OWNER/NAME"`` the finished folder is published to the Hub. ``token``: the Hub
    identity of every Hub call (the model's download, an ``hf://`` source, an ``hf://`` output, the
    push), default HF_TOKEN or the saved login; never stored.

    Every option is a field of ``lmprobe.ExtractionConfig``, listed below from its docstrings.
    Re-running the same call after an interruption continues where it stopped; a different
    configuration against a partial output is an error unless ``overwrite=True``.
    """
    _check_options(options)
    return run_extraction(ExtractionConfig(model=model, prompts=prompts, out=out, **options), token=token).dataset


extract.__signature__ = settings_signature(extract, ExtractionConfig)  # type: ignore[attr-defined]
extract.__doc__ = (extract.__doc__ or "") + settings_doc(ExtractionConfig, skip=("model", "prompts"))


def plan(model: str, prompts: Any, *, out: str | os.PathLike, token: str | None = None, **options: Any) -> JobPlan:
    """What ``extract`` with the same arguments would write and how (``lmprobe extract ... --dry-run``), without
    loading the weights: bytes per layer and site, the shard size, files per folder and per repo, the largest
    file, the index, staging disk per node, how the model is placed, the Hub commits and the tail after the
    last shard, and ``refused`` (None, or why the job cannot work and which setting fixes it). ``token``: as
    ``extract``'s.

    >>> p = lmprobe.plan("lmprobe-tiny", "examples/prompts.jsonl", out="hf://datasets/me/acts",
    ...                  world_size=64, max_tokens=10**9, context_len=128)   # doctest: +SKIP
    >>> print(p.describe())                                                   # doctest: +SKIP
    """
    _check_options(options)
    return plan_job(ExtractionConfig(model=model, prompts=prompts, out=out, **options), token=token)


plan.__signature__ = settings_signature(plan, ExtractionConfig)  # type: ignore[attr-defined]
plan.__doc__ = (plan.__doc__ or "") + settings_doc(ExtractionConfig, skip=("model", "prompts"))


def _check_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - set(ExtractionConfig.field_names()))
    if unknown:
        close = difflib.get_close_matches(unknown[0], ExtractionConfig.field_names(), n=1)
        raise TypeError(f"got an unexpected keyword argument {unknown[0]!r}"
                        + (f"; did you mean {close[0]!r}?" if close else "; the options are ExtractionConfig's fields"))


def run_extraction(config: ExtractionConfig, *, token: str | None = None) -> Outcome:
    """Run the extraction ``config`` describes, then publish it when ``config.push`` names a repo (rank 0 of a
    torchrun job only); return the outcome: the dataset, opened, and whether this run wrote it (``wrote`` is
    False when ``out`` already held this extraction)."""
    try:
        outcome = execute(config, token=token)
    except RuntimeError as exc:  # under torchrun: a collective that found a peer's process gone
        stopped = peer_stopped(exc) if rank_and_world()[1] > 1 else None
        if stopped is None:
            raise
        raise stopped from None  # one line, not gloo's traceback
    except HubUnreachableError as exc:
        ref = parse_dataset_ref(config.out) if isinstance(config.out, str) else None
        if ref is None:
            raise
        # the storage layer's words are a reader's ("read a local copy"); this is a write: say how to write
        raise HubUnreachableError(
            f"cannot reach the Hub at {exc.endpoint} to write {config.out} ({exc.reason}); check the network (or "
            f"HF_ENDPOINT), or write locally (--out DIR, out=DIR) and publish it with `lmprobe push DIR "
            f"{ref.repo_id}` once the Hub answers", endpoint=exc.endpoint, repo_id=exc.repo_id,
            reason=exc.reason) from exc
    if config.push is not None and rank_and_world()[0] == 0:
        push_to_hub(config.out, config.push, private=config.private, token=token, quiet=config.quiet)
    return outcome


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


def validate(path: str | os.PathLike, *, checksums: bool = True, full: bool = False,
             token: str | bool | None = None) -> Report:
    """Check the dataset ``path`` against the format document, and the attachments its index records.

    A local folder is read whole (``checksums=False`` skips the sha256 of each file). A Hub dataset
    (``hf://datasets/OWNER/NAME`` or ``OWNER/NAME``) is checked in place: its metadata, its index and
    every shard's header and size, without downloading the shards; ``full=True`` downloads every file
    and checks its sha256 too. Returns a report with ``.ok``, ``.errors`` and ``.warnings``
    (``report.raise_for_errors()`` raises ValidationError listing them).

    >>> lmprobe.validate("out/tiny").ok                        # doctest: +SKIP
    True
    >>> lmprobe.validate("hf://datasets/me/acts", full=True).ok   # doctest: +SKIP
    True
    """
    ref = parse_dataset_ref(path)
    if ref is not None:
        return validate_hub(ref, full=full, token=token)
    if is_object_store_url(path):
        raise InvalidArgumentError(f"validate reads a local folder or a Hub dataset; copy {path} here first (for "
                                   "instance with `aws s3 sync`), then validate the folder")
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
