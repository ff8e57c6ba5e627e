"""The Python API: what ``import lmprobe`` offers, with real signatures.

>>> import lmprobe
>>> ds = lmprobe.extract("lmprobe-tiny", "examples/prompts.jsonl", out="out/tiny")   # doctest: +SKIP
>>> ds = lmprobe.load("out/tiny")                                                     # doctest: +SKIP
>>> lmprobe.push_to_hub("out/tiny", "me/tiny-acts")                                   # doctest: +SKIP
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base.display import escape_controls
from .base.fields import settings_doc, settings_signature
from .errors import HubUnreachableError, InvalidArgumentError
from .extraction.config import ExtractionConfig
from .extraction.examine import Architecture
from .extraction.plan import JobPlan
from .extraction.preparation import examine_model
from .extraction.runner import Outcome, execute, rows_text
from .extraction.runner import plan as plan_job
from .extraction.torchrun import peer_stopped, rank_and_world
from .format.demo import write_demo
from .format.merge import merge_datasets
from .format.reader import Dataset, open_local
from .format.validate import Report
from .format.validate import validate as validate_format
from .opening import is_remote, load
from .pages import summary
from .pages.features import features
from .pages.report import report
from .publish.attachments import publish_attachment, validate_attachments
from .publish.check import validate_hub
from .publish.dictionary import push_dictionary
from .publish.pull import pull
from .publish.push import push_to_hub
from .sae.loader import is_dictionary_folder, validate_dictionary
from .sae.topk import top_features
from .saelens import export_saelens, import_saelens
from .saev import is_saev_folder, saev_exports, validate_saev
from .storage.cache import announce_budget, cache_budget
from .storage.hub import parse_dataset_ref
from .storage.objectstore import is_object_store_url
from .version import __version__

__all__ = ["ArtefactReport", "ExtractionConfig", "Outcome", "__version__", "artefact_paths", "export_saelens",
           "extract", "features", "hookpoints", "import_saelens", "info", "load", "merge", "open_dataset", "plan",
           "publish_attachment", "pull", "push_dictionary", "push_to_hub", "report", "rows_text", "run_extraction",
           "top_features", "validate", "write_demo"]

# Names the API hands on from the layers below, so that the command line (a thin client) calls only the API:
# ``write_demo`` (format/demo.py: a small synthetic dataset, no model needed), ``rows_text`` (what a dataset
# holds, in words: the last line of ``lmprobe extract``), ``top_features`` (sae/topk.py: a dictionary's top
# features of a probe vector, ``lmprobe sae-topk``), ``publish_attachment`` (publish/attachments.py: a saev export
# or SAE dictionary published beside a dataset on the Hub) and ``push_dictionary`` (publish/dictionary.py: a
# dictionary pushed to a model repo of its own).


def extract(model: str, prompts: Any, *, out: str | os.PathLike, token: str | None = None, **options: Any) -> Dataset:
    """Run ``model`` over ``prompts`` and write an lmprobe dataset to ``out``; return it, opened.

    An alias, in one line, of ``run_extraction(ExtractionConfig(model=model, prompts=prompts, out=out, **options),
    token=token).dataset``: ``run_extraction`` is the one function that runs an extraction.

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
    False when ``out`` already held this extraction).

    The one function that runs an extraction: ``lmprobe.extract`` and ``lmprobe extract`` call it. The runner's
    step below it (``extraction.runner.execute``) is called from here only; this adds the push and says a torchrun
    peer's failure or an unreachable Hub output in one line."""
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


@dataclass
class ArtefactReport(Report):
    """``validate``'s report of a folder that is no dataset but a saev export or an SAE dictionary: ``kind`` says
    which, ``errors`` lists every problem against its document (docs/saev.md, docs/sae-dictionary.md)."""

    kind: str = ""

    def __str__(self) -> str:
        lines = [f"{self.path}: {self.kind} {'OK' if self.ok else 'INVALID'} ({len(self.errors)} problem(s))"]
        return "\n".join(lines + [f"  error: {escape_controls(e, keep_newlines=False)}" for e in self.errors])


def artefact_paths(path: str | os.PathLike) -> list[str]:
    """``path``, or when it is the folder ``export-saev --out`` wrote (``DUMP_TO``), each export it holds
    (``DUMP_TO/<HASH>/``): what ``validate`` and ``info`` look at for it.

    >>> lmprobe.api.artefact_paths("dump")   # doctest: +SKIP
    ['dump/3f2a...']
    """
    return [str(e) for e in (saev_exports(path) if not is_remote(str(path)) else []) or [path]]


def validate(path: str | os.PathLike, *, checksums: bool = True, full: bool = False,
             token: str | bool | None = None) -> Report:
    """Check the dataset ``path`` against the format document, and the attachments its index records; or a saev
    export or an SAE dictionary folder against its own document.

    A local folder is read whole (``checksums=False`` skips the sha256 of each file). A Hub dataset
    (``hf://datasets/OWNER/NAME`` or ``OWNER/NAME``) is checked in place: its metadata, its index and
    every shard's header and size, without downloading the shards; ``full=True`` downloads every file
    and checks its sha256 too. Returns a report with ``.ok``, ``.errors`` and ``.warnings``
    (``report.raise_for_errors()`` raises ValidationError listing them); for a saev export or a dictionary, an
    ``ArtefactReport`` whose ``kind`` says which (``"saev"``, ``"SAE dictionary"``). ``artefact_paths`` turns
    ``export-saev``'s ``--out`` folder into the exports it holds.

    >>> lmprobe.validate("out/tiny").ok                        # doctest: +SKIP
    True
    >>> lmprobe.validate("hf://datasets/me/acts", full=True).ok   # doctest: +SKIP
    True
    """
    if is_saev_folder(path):
        return ArtefactReport(str(path), errors=validate_saev(path, check_sizes=True), kind="saev")
    if is_dictionary_folder(path):
        return ArtefactReport(str(path), errors=validate_dictionary(Path(path).parent, Path(path).name),
                              kind="SAE dictionary")
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


def info(path: str | os.PathLike) -> str:
    """A summary of ``path`` as text (``lmprobe info``): a dataset (local folder, Hub repo or fsspec URL), a saev
    export, an SAE dictionary, or ``export-saev``'s ``--out`` folder (each export it holds, a blank line between).

    >>> print(lmprobe.info("out/tiny"))   # doctest: +SKIP
    """
    texts = []
    for p in artefact_paths(path):
        text = summary.artefact_text(p) if not is_remote(p) else None  # a saev export, a dictionary
        texts.append(text if text is not None else summary.text(load(p), path=p))
    return "\n\n".join(texts)


def open_dataset(path: str, *, cache: int | str | None = None, quiet: bool = False,
                 check: Callable[[Dataset], object] | None = None) -> Dataset:
    """A dataset read whole by a command (``report``, ``features``, the exports): a local folder as ``load`` opens
    it, a remote one (Hub, ``s3://``) through a bounded local cache of ``cache`` bytes (default: the smaller of
    20 GiB and half the free space). ``check(ds)`` (the caller's arguments against the metadata) runs before the
    cache is said on stderr (unless ``quiet``), so that a mistake is one line, alone."""
    if not is_remote(path):
        ds = load(path)
        if check is not None:
            check(ds)
        return ds
    budget = cache_budget(cache, path, announce=False)
    ds = load(path, cache=budget)
    if check is not None:
        check(ds)
    if not quiet:
        announce_budget(path, budget)
    return ds


def merge(parts: Sequence[str | os.PathLike | Dataset], out: str | os.PathLike, *, overwrite: bool = False) -> Dataset:
    """Combine datasets made by independent jobs (same model and settings, in this order) into ``out``.

    Parts are local folders, Hub repos or object-storage URLs (anything ``lmprobe.load`` opens);
    shards are linked or copied, never rewritten.

    >>> lmprobe.merge(["job-0", "job-1"], "merged").num_prompts   # doctest: +SKIP
    """
    datasets = [p if isinstance(p, Dataset) else load(p) for p in parts]
    merge_datasets(datasets, out, overwrite=overwrite)
    return open_local(Path(out))
