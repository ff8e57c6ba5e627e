"""Reopening an output folder for a writer: a fresh start, a replaced dataset, or a partial one resumed.

A folder with a checkpoint (``.lmprobe-staging/state.json``, staging.py) is resumed only when the
checkpoint was written with the same settings (``check_settings``: the fingerprint, less the caller's
settings it names resumable) and every value in it is sound (``read_checkpoint``): counts are counts,
staged files have plain names inside the staging folder, every slot is one this writer writes. A
damaged or foreign checkpoint is a ResumeMismatchError that says what to do, never followed blindly.
The writer then continues from the ``Checkpoint`` (``DatasetWriter._restore``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import FormatError, LmprobeError, OutputExistsError, ResumeMismatchError
from .spec import INDEX_PATH, RUN_SETTINGS
from .staging import (
    Staging,
    check_fresh_output,
    check_staging_name,
    describe_mismatch,
    previous_dataset_files,
    remove_files_inside,
)

#: (series, slot, shard) -> the final name of a closed shard, relative to the output folder
ShardFile = Callable[[str, str, int], str]


#: recorded settings that change no stored value beyond float rounding: an output made under other values of
#: these is the same extraction, and a partial one resumes (a smaller batch after an out-of-memory error)
RESUMABLE_SETTINGS = RUN_SETTINGS


def same_extraction(recorded: dict[str, Any], settings: dict[str, Any]) -> bool:
    """Whether recorded extraction settings describe the same work as ``settings`` (RESUMABLE_SETTINGS aside)."""
    def work(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k not in RESUMABLE_SETTINGS}

    return work(recorded) == work(settings)


def settings_fingerprint(settings: dict[str, Any]) -> str:
    """64 hex digits naming the work ``settings`` describe: equal for two settings ``same_extraction`` calls the same
    (what a Hub output's job marker records, so that a re-run of a killed job knows its marker)."""
    work = {k: v for k, v in settings.items() if k not in RESUMABLE_SETTINGS}
    return hashlib.sha256(json.dumps(work, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Replay:
    """A point a writer's open shards can be recomputed from: its rows, stored tokens and the caller's position in
    its source (``progress``) before the batch that opened the earliest of them (``state.json``'s ``replay``)."""

    prompts: int
    tokens: int
    progress: dict[str, int] | None

    def to_json(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "tokens": self.tokens, "progress": self.progress}


def check_replay(v: Any, num_prompts: int, num_tokens: int) -> Replay:
    """A checkpoint's ``replay``, read back: counts no larger than the checkpoint's own, a progress of counts."""
    if not isinstance(v, Mapping) or set(v) != {"prompts", "tokens", "progress"}:
        raise ValueError(f"replay must hold prompts, tokens and progress, got {str(v)[:80]}")
    prompts, tokens = count(v["prompts"]), count(v["tokens"])
    if prompts > num_prompts or tokens > num_tokens:
        raise ValueError(f"replay is past the checkpoint ({prompts} rows, {tokens} tokens)")
    return Replay(prompts, tokens, None if v["progress"] is None else check_progress(v["progress"]))


@dataclass(frozen=True)
class Checkpoint:
    """A partial output's last checkpoint, checked: where its writer stood when it was taken."""

    num_prompts: int
    num_tokens: int  # stored tokens (sum of num_tokens)
    progress: dict[str, int] | None  # the caller's position in its source
    runs: list[dict[str, Any]]  # each run's settings and first row (``lmprobe:runs``)
    index_parts: int  # index part files written
    phase: str  # "writing" or "finalizing" (closing had begun)
    created_at: str | None  # the dataset's creation time, kept across runs
    streams: dict[str, dict]  # each shard series' ``ShardSeries.state()``, by series name
    statistics_file: str | None  # the staged running statistics, named per checkpoint
    replay: Replay | None = None  # where the open shards' rows can be recomputed from (None: not recorded)

    @property
    def statistics_number(self) -> int:
        """The checkpoint number in the statistics file's name (``statistics-00000003.safetensors``: 3)."""
        assert self.statistics_file is not None
        return int(self.statistics_file.split("-")[1].split(".")[0])

    def staged_names(self) -> set[str]:
        """The staging files the checkpoint names: closed shards and the statistics (open shards: their series')."""
        names = {f["staging"] for st in self.streams.values() for d in st["closed"] for f in d["files"].values()}
        return names | ({self.statistics_file} if self.statistics_file else set())


def open_output(staging: Staging, *, resume: bool, overwrite: bool, shard_file: ShardFile) -> dict[str, Any] | None:
    """Make ``staging``'s output folder ready for a writer: the raw state of the checkpoint to resume from, or None.

    A complete dataset there is replaced only with ``overwrite``; a partial one is resumed (``resume``) or
    replaced (``overwrite``), else refused; anything else must be a new or empty folder. Replacing deletes what an
    earlier lmprobe run wrote, and nothing else.
    """
    out = staging.out_dir
    if (out / INDEX_PATH).exists():
        if not overwrite:
            raise OutputExistsError(
                f"{out} already holds a complete lmprobe dataset; pass overwrite=True "
                "(--overwrite) to replace it, or choose another output folder"
            )
        _remove_previous(staging, shard_file)
    elif staging.has_checkpoint():
        if overwrite:
            _remove_previous(staging, shard_file)
        elif not resume:
            raise OutputExistsError(
                f"{out} holds a partial dataset from an interrupted run; resume it, or pass "
                "overwrite=True (--overwrite) to start over"
            )
        else:
            return staging.read_state()
    else:
        check_fresh_output(out)
    staging.reset()
    return None


def _remove_previous(staging: Staging, shard_file: ShardFile) -> None:
    """Delete what an earlier lmprobe run wrote in the output folder (and nothing else)."""
    out = staging.out_dir
    victims: list[Path] = []
    if (out / INDEX_PATH).exists():
        victims += previous_dataset_files(out)
    if staging.has_checkpoint():
        try:
            victims += [out / f for f in published_names(staging.read_state(), shard_file)]
        except (ResumeMismatchError, FormatError, KeyError, TypeError, ValueError):
            pass  # a damaged checkpoint: the staging folder goes, published names are unknown
    remove_files_inside(out, victims)
    staging.remove()


def published_names(st: dict, shard_file: ShardFile) -> list[str]:
    """Final names of the shards a checkpoint had already moved into place (last-token and logits)."""
    names = []
    for name in ("last", "logits"):
        for shard, d in enumerate(st["streams"].get(name, {}).get("closed", [])):
            names += [shard_file(name, slot, shard) for slot in d["files"]]
    return names


def check_settings(st: dict, fingerprint: dict, resumable: Collection[str], name: str) -> None:
    """A checkpoint's fingerprint against this run's, the caller's ``resumable`` settings aside: else a
    ResumeMismatchError naming every setting that differs (``name``: the output, for the message)."""
    old = st.get("fingerprint")
    old, new = comparable(old if isinstance(old, dict) else {}, resumable), comparable(fingerprint, resumable)
    if old != new:
        details = describe_mismatch(old, new)
        raise ResumeMismatchError(
            f"{name} holds a partial dataset written with other settings ({details}); re-run with the "
            "original settings to resume, or pass --overwrite (overwrite=True in Python) to start over"
        )


def comparable(fingerprint: dict, resumable: Collection[str]) -> dict:
    """A fingerprint without the caller's settings that a resumed run may change (``resumable``)."""
    caller = fingerprint.get("caller")
    if not resumable or not isinstance(caller, dict):
        return fingerprint
    return {**fingerprint, "caller": {k: v for k, v in caller.items() if k not in resumable}}


@contextmanager
def refusing_damage(state_path: Path) -> Iterator[None]:
    """Reading a checkpoint back: a value of the wrong type, or missing, is a ResumeMismatchError naming the file."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        if isinstance(exc, LmprobeError):
            raise
        raise ResumeMismatchError(
            f"{state_path} is damaged ({type(exc).__name__}: {exc}); pass overwrite=True "
            "(--overwrite) to start over") from None


def read_checkpoint(st: dict, slots: Mapping[str, Iterable[str]]) -> Checkpoint:
    """A checkpoint's state, every value checked (``slots``: the slots of each shard series the writer has).

    Raises KeyError, TypeError or ValueError on damage (``refusing_damage`` turns them into one message).
    """
    num_prompts = count(st["num_prompts"])
    num_tokens = count(st.get("num_tokens", 0))
    progress = check_progress(st["progress"]) if st.get("progress") is not None else None
    runs = check_runs(st.get("runs", []))
    index_parts = count(st["index_parts"])
    if st["phase"] not in ("writing", "finalizing"):
        raise ValueError(f"unknown phase {st['phase']!r}")
    created_at = str(st["created_at"]) if "created_at" in st else None
    streams = {}
    for series, known in slots.items():
        sst = streams[series] = st["streams"][series]
        for key in ("shard", "rows", "prompts"):
            count(sst[key])
        for d in sst["closed"]:
            for slot, f in d["files"].items():
                if slot not in known:
                    raise ValueError(f"unknown slot {slot!r} in the {series} series")
                check_staging_name(f["staging"], "a staged shard")
    stats_file = st.get("statistics_file")
    if stats_file is not None:
        check_staging_name(stats_file, "a statistics file")
    replay = check_replay(st["replay"], num_prompts, num_tokens) if st.get("replay") is not None else None
    return Checkpoint(num_prompts, num_tokens, progress, runs, index_parts, st["phase"], created_at, streams,
                      stats_file, replay)


def check_progress(progress: Any) -> dict[str, int]:
    """A caller's position in its source: names to counts."""
    if not isinstance(progress, Mapping) or not all(isinstance(k, str) for k in progress):
        raise ValueError(f"progress must map names to counts, got {progress!r}")
    return {k: count(v) for k, v in progress.items()}


def check_runs(runs: Any) -> list[dict[str, Any]]:
    """A checkpoint's run records: a list of objects, each with the first row its run wrote."""
    if not isinstance(runs, list) or not all(isinstance(r, dict) and isinstance(r.get("first_row"), int)
                                             for r in runs):
        raise ValueError(f"runs must be a list of records with a first_row, got {str(runs)[:80]}")
    return runs


#: the largest count a checkpoint may hold (JSON's exact integers; any real count is far below)
MAX_COUNT = 2**53


def count(v: Any) -> int:
    """A non-negative int read back from a checkpoint, at most ``MAX_COUNT``, else ValueError."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > MAX_COUNT:
        raise ValueError(f"expected a count, got {v!r}")
    return v
