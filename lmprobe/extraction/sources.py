"""Where prompts and documents come from, read as streams of records.

- a file: ``.jsonl``/``.ndjson``, ``.csv``, ``.tsv``, ``.parquet`` or ``.txt`` (one record a line);
- a folder: every such file in it (and below), in sorted path order, read one after the other;
- a Hugging Face dataset (``hf://datasets/OWNER/NAME`` or ``OWNER/NAME``), read with the
  ``datasets`` library in streaming mode (``config``, ``split``);
- records in memory (a list of strings or dicts, a pandas DataFrame).

Nothing is read whole: files go line by line (parquet, CSV: batch by batch), Hub datasets as a
stream. Every record comes with where it came from (file and line, or the record's number), so
an error can name it. ``records(start)`` continues at the ``start``-th record without parsing
the ones before it, which is how a resumed extraction skips what it has stored.

Many processes share a source by dealing its records: record ``i`` belongs to rank
``i % world`` (:func:`owner`). ``records(start, rank=r, world=n)`` yields rank ``r``'s records
only, each with its index in the whole source, and does not parse the others': a line-based
file still finds every line boundary, but decodes and parses only the rank's lines; a parquet
file turns only the rank's rows into Python values and skips row groups (and whole files,
counted from the footer) that hold none of them; a CSV file's parser finds every row, but only
the rank's rows become records; a Hugging Face stream drops the other ranks' examples as Arrow
rows, before they are decoded.

A source of many files deals whole pieces instead (:meth:`Source.pieces`): a piece is a file, or one
row group of a parquet file, and piece ``p`` belongs to rank ``p % world``, so that a rank opens and
reads only its own files (about ``1/world`` of the bytes). The documents keep their numbers in the
whole source: a parquet piece's first record is known from the footers (each rank reads its share
of them and the ranks exchange the row counts), another file's from the record counts the ranks
exchange (:mod:`.dealing`). Every file is opened through :meth:`Source.open`, the one place its
bytes are read.

>>> src = MemorySource(["a", "b", "c", "d", "e"], text_column="text")
>>> [(r.index, r.values["text"]) for r in src.records(1, rank=1, world=2)]
[(1, 'b'), (3, 'd')]
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..base.display import one_line
from ..base.safeio import loads
from ..errors import PromptError
from ..format.values import is_null
from ..storage.hub import REPO_ID_RE
from ..storage.urls import hub_path, is_hub_url
from .pieces import Piece, build_pieces, read_footer, row_group_bytes

SUFFIXES = (".jsonl", ".ndjson", ".csv", ".tsv", ".parquet", ".txt", ".text")
#: A column of integer lists: the record is pretokenized, these are its token ids.
PRETOKENIZED_COLUMN = "input_ids"


def owner(index: int, world: int) -> int:
    """The rank that reads record ``index`` when ``world`` processes share a source: records are dealt
    round-robin, so every rank's share is spread over the whole source.

    >>> [owner(i, 3) for i in range(7)]
    [0, 1, 2, 0, 1, 2, 0]
    """
    return index % world


def first_owned(start: int, rank: int, world: int) -> int:
    """The first record index at or after ``start`` that rank ``rank`` of ``world`` reads.

    >>> first_owned(5, 1, 4), first_owned(5, 2, 4)
    (5, 6)
    """
    return start + (rank - start) % world


def check_share(rank: int, world: int) -> None:
    """``rank`` of ``world`` names a share: 0 <= rank < world (a caller's bug otherwise)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive integer, got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an integer in 0..{world - 1}, got {rank!r}")


@dataclass
class Record:
    index: int  # 0-based position in the source
    file: str  # the file (or source) it came from
    at: str  # where in it: "line 12", "row 3", "record 7"
    values: dict[str, Any]

    @property
    def where(self) -> str:
        """For messages: "data/a.jsonl, line 12"."""
        return f"{self.file}, {self.at}"


class Source(ABC):
    """A stream of records with a description (for messages) and an identity (for resuming)."""

    description: str = "prompts"
    text_column: str = "text"  # a line of a .jsonl file that is a bare string is this column's text

    def dealt_files(self) -> list[Any] | None:
        """The files that many ranks deal by piece (two or more, of kinds read piece by piece), in source order;
        None: a source without files, or of one file, whose records are dealt one by one (:func:`owner`)."""
        return None

    def file_sizes(self) -> list[int]:
        """The byte sizes of :meth:`dealt_files`."""
        raise NotImplementedError(f"{type(self).__name__} has no files")

    def file_name(self, k: int) -> str:
        """File ``k`` of :meth:`dealt_files`, for messages."""
        return str(self._dealt()[k])

    def open(self, f: Any) -> BinaryIO:
        """One of the source's files, opened for reading: every byte of a source of files is read through it."""
        raise NotImplementedError(f"{type(self).__name__} has no files")

    def _dealt(self) -> list[Any]:
        files = self.dealt_files()
        if files is None:
            raise ValueError(f"{self.description} is not dealt by piece")
        return files

    def _footers(self) -> dict[int, Any]:
        return self.__dict__.setdefault("_footer_cache", {})

    def file_layout(self, k: int) -> list[list[int]] | None:
        """File ``k``'s row groups as ``[rows, bytes]`` (a parquet file: read from its footer, which is kept for
        reading its row groups), or None: a file read whole, its records counted by reading it."""
        f = self._dealt()[k]
        if _suffix(f) != ".parquet":
            return None
        with self.open(f) as fh:
            meta = read_footer(fh, self.file_name(k))
        self._footers()[k] = meta
        return [[meta.row_group(g).num_rows, row_group_bytes(meta.row_group(g))] for g in range(meta.num_row_groups)]

    def pieces(self) -> list[Piece] | None:
        """The pieces many ranks deal (piece ``p`` is rank ``p % world``'s), in source order, every parquet
        footer read here (a rank of many reads only its share of them: :func:`.dealing.share_pieces`); None:
        the records are dealt one by one."""
        files = self.dealt_files()
        if files is None:
            return None
        cached = self.__dict__.get("_all_pieces")
        if cached is None:
            cached = self.__dict__["_all_pieces"] = build_pieces([self.file_layout(k) for k in range(len(files))],
                                                                 self.file_sizes())
        return cached

    def piece_records(self, piece: Piece, first: int, *, skip: int = 0, opener: Opener | None = None
                      ) -> Generator[Record, None, int]:
        """The records of ``piece`` from its ``skip``-th on (the ones before are not parsed), numbered in the
        whole source from ``first`` (the piece's first record); returns how many records the piece holds.
        ``opener``: how to open the piece's file (default :meth:`open`)."""
        f = self._dealt()[piece.file]
        return read_piece(opener or self.open, f, self.file_name(piece.file), self.text_column,
                          piece, first, skip=skip, footer=self._footers().get(piece.file))

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What makes this source this source, for the resume fingerprint (sizes, mtimes, revisions)."""

    @abstractmethod
    def records(self, start: int = 0, *, rank: int = 0, world: int = 1) -> Iterator[Record]:
        """The records from the ``start``-th on, in source order; with ``world`` > 1 only those of rank
        ``rank`` (``index % world == rank``), each with its index in the whole source."""

    def head(self, n: int) -> list[Record]:
        out = []
        for r in self.records():
            out.append(r)
            if len(out) >= n:
                break
        return out


class MemorySource(Source):
    """Records held by the caller: a list of strings or dicts, or a pandas DataFrame."""

    def __init__(self, items: Any, *, text_column: str, description: str = "prompts"):
        try:
            import pandas as pd
        except ImportError:  # pragma: no cover - pandas is a dependency
            pd = None
        if pd is not None and isinstance(items, pd.DataFrame):
            rows = items.to_dict(orient="records")
            description = "DataFrame"
        else:
            rows = list(items)
        self.rows: list[dict] = []
        for i, x in enumerate(rows):
            if isinstance(x, str):
                self.rows.append({text_column: x})
            elif isinstance(x, dict):
                self.rows.append(x)
            else:
                raise PromptError(f"prompt {i}: expected a string (or a dict with {text_column!r}), got {x!r}")
        self.description = description

    def identity(self) -> dict[str, Any]:
        h = hashlib.sha256(json.dumps(self.rows, sort_keys=True, default=str).encode())
        return {"kind": "memory", "sha256": h.hexdigest()}

    def records(self, start: int = 0, *, rank: int = 0, world: int = 1) -> Iterator[Record]:
        check_share(rank, world)
        for i in range(first_owned(start, rank, world), len(self.rows), world):
            yield Record(i, self.description, f"prompt {i}", self.rows[i])


class FilesSource(Source):
    """One file, or every prompt file of a folder, read one after the other."""

    def __init__(self, path: Path, *, text_column: str):
        self.path = path
        self.text_column = text_column
        if path.is_dir():
            self.files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                                and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not self.files:
                raise PromptError(f"{path} is a folder with no prompt files in it (.jsonl, .ndjson, .csv, .tsv, "
                                  ".parquet or .txt)")
        else:
            if path.suffix.lower() not in SUFFIXES:
                raise PromptError(f"{path}: unknown prompt file type {path.suffix!r}; use .jsonl, .csv, .tsv, "
                                  ".parquet or .txt")
            self.files = [path]
        self.description = str(path)

    def identity(self) -> dict[str, Any]:
        files = []
        for f in self.files:
            st = f.stat()
            files.append([f.relative_to(self.path).as_posix() if self.path.is_dir() else f.name, st.st_size,
                          st.st_mtime_ns])
        return {"kind": "files", "path": str(self.path.resolve()), "files": files}

    def _name(self, f: Path) -> str:
        return str(f) if not self.path.is_dir() else str(self.path / f.relative_to(self.path))

    def open(self, f: Any) -> BinaryIO:
        """One of the source's files, opened for reading: every byte of the source is read through it."""
        return open(f, "rb")

    def records(self, start: int = 0, *, rank: int = 0, world: int = 1) -> Iterator[Record]:
        check_share(rank, world)
        offset = 0  # index of the file's first record in the whole source
        for f in self.files:
            first = first_owned(max(start, offset), rank, world) - offset  # the file's first record to read
            offset += yield from _indexed(_reader(f)(self.open, f, self._name(f), self.text_column, first=first,
                                                     step=world), offset, self._name(f))

    def dealt_files(self) -> list[Any] | None:
        return self.files if len(self.files) >= 2 else None

    def file_sizes(self) -> list[int]:
        return [f.stat().st_size for f in self.files]

    def file_name(self, k: int) -> str:
        return self._name(self.files[k])


#: A reader of one file: yields (record number in the file, where, values) for the records ``first``,
#: ``first + step``, ... only, and returns how many records the file holds.
FileRecords = Generator[tuple[int, str, dict], None, int]
#: Opens one of a source's files for reading (a local path, or a file on the Hub).
Opener = Callable[[Any], BinaryIO]
#: Records to ask a reader for when only its count of records is wanted.
NONE_WANTED = 2**62


def _suffix(f: Any) -> str:
    return os.path.splitext(str(f))[1].lower()


def _reader(f: Any) -> Callable[..., FileRecords]:
    return {".parquet": _parquet_records, ".csv": _csv_records, ".tsv": _csv_records}.get(_suffix(f), _line_records)


def read_piece(opener: Opener, f: Any, name: str, text_column: str, piece: Piece, first: int, *,
               skip: int = 0, footer: Any = None) -> Generator[Record, None, int]:
    """The records of one piece of file ``f`` from its ``skip``-th on, numbered from ``first`` in the whole
    source; returns the piece's count of records. ``skip`` past the end: nothing parsed, only counted (a
    parquet piece: not even read). ``footer``: the file's parsed footer, when this process has it."""
    if piece.row_group is None:
        return (yield from _indexed(_reader(f)(opener, f, name, text_column, first=skip, step=1), first, name))
    if skip >= piece.rows:
        return piece.rows
    import pyarrow.parquet as pq

    with opener(f) as fh:
        pos = 0
        pf = pq.ParquetFile(fh, metadata=footer if footer is not None else read_footer(fh, name))
        for batch in pf.iter_batches(batch_size=1024, row_groups=[piece.row_group]):
            if skip < pos + batch.num_rows:
                for k, rec in enumerate(batch.slice(max(0, skip - pos)).to_pylist(), start=max(skip, pos)):
                    yield Record(first + k, name, f"row {piece.first_row + k}", rec)
            pos += batch.num_rows
    return piece.rows


def _indexed(rows: FileRecords, offset: int, name: str) -> Generator[Record, None, int]:
    """A file reader's records numbered in the whole source (the file's first record is ``offset``)."""
    while True:
        try:
            k, at, values = next(rows)
        except StopIteration as stop:
            return stop.value
        yield Record(offset + k, name, at, values)


def _line_records(opener: Opener, path: Any, name: str, text_column: str, *, first: int, step: int) -> FileRecords:
    """Records of a .jsonl or .txt file, one a non-blank line (blank lines are skipped, not counted).

    Every line is found, but only the records asked for are decoded and parsed."""
    jsonl = _suffix(path) in (".jsonl", ".ndjson")
    n, want = 0, first
    with opener(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.isspace():
                continue
            n += 1
            if n - 1 != want:  # another rank's record, or one before where a resumed run starts
                continue
            want += step
            yield n - 1, f"line {lineno}", _line_values(raw, name, lineno, text_column, jsonl)
    return n


def _line_values(raw: bytes, name: str, lineno: int, text_column: str, jsonl: bool) -> dict:
    """One line's record: the text of a .txt line, the object of a .jsonl line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"{name}, line {lineno}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                          f"{exc.start + 1}); save the file as UTF-8") from None
    if not jsonl:
        return {text_column: line.rstrip("\r\n")}
    at = f"line {lineno}"
    obj = loads(line, what=f"{name}, {at}", error=PromptError)
    if isinstance(obj, str):
        obj = {text_column: obj}
    if not isinstance(obj, dict):
        raise PromptError(f"{name}, {at}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _parquet_records(opener: Opener, path: Any, name: str, text_column: str, *, first: int, step: int
                     ) -> FileRecords:
    """Rows of a parquet file: row groups that hold no row asked for are not read (the footer counts them),
    and only the rows asked for become Python values."""
    with opener(path) as fh:
        return (yield from _parquet_rows(fh, first=first, step=step))


def _parquet_rows(fh: BinaryIO, *, first: int, step: int) -> FileRecords:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(fh)
    meta = pf.metadata
    row, want = 0, first  # the row group's first row; the next row asked for
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if want >= row + n:
            row += n
            continue
        pos = row
        for batch in pf.iter_batches(batch_size=1024, row_groups=[g]):  # a row group may be large: read in pieces
            if want < pos + batch.num_rows:
                rows = _materialise(batch, want - pos, step)
                for k, rec in enumerate(rows):
                    yield want + k * step, f"row {want + k * step}", rec
                want += len(rows) * step
            pos += batch.num_rows
        row += n
    return meta.num_rows


def _materialise(batch: Any, first: int, step: int) -> list[dict]:
    """Rows ``first``, ``first + step``, ... of an Arrow record batch as Python dicts (the others stay Arrow)."""
    import pyarrow as pa

    if step == 1:
        return batch.slice(first).to_pylist()
    return batch.take(pa.array(range(first, batch.num_rows, step), type=pa.int64())).to_pylist()


def _csv_records(opener: Opener, path: Any, name: str, text_column: str, *, first: int, step: int) -> FileRecords:
    """Rows of a CSV/TSV file: pandas' parser finds every row (quoted fields may span lines), and only the rows
    asked for become records."""
    with opener(path) as fh:
        return (yield from _csv_rows_of(fh, _suffix(path), name, text_column, first=first, step=step))


def _csv_rows_of(fh: BinaryIO, suffix: str, name: str, text_column: str, *, first: int, step: int) -> FileRecords:
    import pandas as pd

    row, want = 0, first
    # the text column is text even when it looks like a number ("007")
    chunks = pd.read_csv(fh, sep="\t" if suffix == ".tsv" else ",", keep_default_na=True,
                         dtype_backend="numpy_nullable", dtype={text_column: str}, encoding="utf-8", chunksize=4096)
    try:
        for df in chunks:
            if want < row + len(df):
                ks = range(want - row, len(df), step)
                for k, r in zip(ks, _csv_rows(df, ks), strict=True):
                    yield row + k, f"line {row + k + 2}", r
                want = row + ks[-1] + step
            row += len(df)
    except UnicodeDecodeError as exc:
        raise PromptError(f"{name}: not valid UTF-8 ({exc.reason}); save the file as UTF-8") from None
    return row


def _csv_rows(df: Any, rows: range) -> list[dict]:
    """Rows ``rows`` of a parsed CSV chunk as records of Python values (missing cells are None)."""
    part = df if len(rows) == len(df) else df.iloc[rows.start : rows.stop : rows.step]
    return [{k: (None if is_null(v) else (v.item() if hasattr(v, "item") else v)) for k, v in r.items()}
            for r in part.to_dict(orient="records")]


class HubDatasetSource(Source):
    """A Hugging Face dataset, streamed with the ``datasets`` library (nothing downloaded whole)."""

    def __init__(self, repo: str, *, config: str | None, split: str, token: Any = None, text_column: str = "text"):
        self.repo, self.config, self.split, self.token = repo, config, split, token
        self.text_column = text_column  # a .jsonl line that is a bare string is this column's text
        self.description = f"hf://datasets/{repo}" + (f" ({config})" if config else "") + f" [{split}]"
        self._revision: str | None = None
        self._files: list[str] | None = None  # the split's data files, when it is dealt by piece

    def dealt_files(self) -> list[Any] | None:
        """A split of many parquet files (the Hub's own form of a dataset), or of many .jsonl files, is dealt by
        piece and read with lmprobe's own readers through ``HfFileSystem``; any other split is streamed with
        ``datasets`` and dealt by record."""
        if self._files is None:
            self._files = self._data_files()
        return self._files if len(self._files) >= 2 else None

    def file_sizes(self) -> list[int]:
        """Sizes from one listing of each folder (not a request a file)."""
        fs = self._fs()
        sizes: dict[str, int] = {}
        for folder in sorted({f.rsplit("/", 1)[0] for f in self._dealt()}):
            for entry in fs.ls(folder, detail=True):
                sizes[entry["name"].rsplit("/", 1)[-1]] = int(entry.get("size") or 0)
        return [sizes.get(f.rsplit("/", 1)[-1], 0) for f in self._dealt()]

    def file_name(self, k: int) -> str:
        f = self._dealt()[k]
        return f"hf://{f.split('@', 1)[0]}/{f.split('/', 3)[-1]}" if "@" in f else f"hf://{f}"  # without the revision

    def _data_files(self) -> list[str]:
        """The split's data files, in the order ``datasets`` streams them, when they are all parquet files or all
        .jsonl files (read as ``datasets`` reads them: one record a line)."""
        try:
            import datasets
        except ImportError:  # pragma: no cover - a dependency of the dev extras
            raise PromptError("reading a Hugging Face dataset needs `datasets`: pip install datasets") from None
        # an error is raised, not taken for "not dealt by piece": every rank must decide the same way (a rank
        # that failed to look would deal records while the others deal pieces)
        try:
            builder = datasets.load_dataset_builder(self.repo, self.config, token=self.token)
        except (FileNotFoundError, ValueError) as exc:
            raise PromptError(f"cannot open {self.description}: {str(exc).splitlines()[0]}") from None
        files = list((builder.config.data_files or {}).get(self.split, []))
        kinds = {"parquet": (".parquet",), "json": (".jsonl", ".ndjson")}.get(builder.name, ())
        if not files or not all(_suffix(f) in kinds for f in files):
            return []
        return [hub_path(f) for f in files]

    def _fs(self) -> Any:
        from huggingface_hub import HfFileSystem

        return HfFileSystem(token=self.token)

    def open(self, f: Any) -> BinaryIO:
        """One of the split's data files on the Hub, opened for reading (byte ranges, as pyarrow asks)."""
        return self._fs().open(f, "rb")

    def _stream(self):
        try:
            import datasets
        except ImportError:  # pragma: no cover - a dependency of the dev extras
            raise PromptError("reading a Hugging Face dataset needs `datasets`: pip install datasets") from None
        try:
            return datasets.load_dataset(self.repo, self.config, split=self.split, streaming=True, token=self.token)
        except (FileNotFoundError, ValueError) as exc:
            raise PromptError(f"cannot open {self.description}: {str(exc).splitlines()[0]}") from None

    def identity(self) -> dict[str, Any]:
        if self._revision is None:
            from huggingface_hub import HfApi

            try:
                self._revision = HfApi(token=self.token).dataset_info(self.repo).sha
            except Exception:  # noqa: BLE001 - offline: the name is the identity
                self._revision = "unknown"
        return {"kind": "hub", "repo": self.repo, "config": self.config, "split": self.split,
                "revision": self._revision}

    def records(self, start: int = 0, *, rank: int = 0, world: int = 1) -> Iterator[Record]:
        check_share(rank, world)
        stream = self._stream()
        if start:
            stream = stream.skip(start)
        i = first_owned(start, rank, world)
        if world > 1:
            stream = _every(stream, i - start, world)
        rows = iter(stream)
        while True:
            try:
                values = next(rows)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - raised inside the `datasets` stream, reading its files
                text = one_line(exc)[:200]
                raise PromptError(f"{self.description}: record {i} cannot be read ({type(exc).__name__}: {text}); a "
                                  "later data file's columns may differ in type from the first one's") from None
            yield Record(i, self.description, f"record {i}", dict(values))
            i += world


def _every(stream: Any, offset: int, step: int) -> Any:
    """Examples ``offset``, ``offset + step``, ... of a streaming dataset. ``datasets`` drops the others as
    Arrow rows, before they are decoded into Python values (``split_dataset_by_node`` with the "examples"
    strategy); a version whose ``split_dataset_by_node`` cannot be told that strategy (it would deal whole
    files instead, which breaks the round-robin numbering) has them decoded and dropped here."""
    from datasets.distributed import split_dataset_by_node

    if "strategy" in inspect.signature(split_dataset_by_node).parameters:
        return split_dataset_by_node(stream, rank=offset, world_size=step, strategy="examples")
    return itertools.islice(stream, offset, None, step)


def open_source(spec: Any, *, text_column: str = "text", config: str | None = None, split: str = "train",
                token: Any = None) -> Source:
    """The source ``spec`` names: a file or folder path, a Hub dataset, or records in memory."""
    if isinstance(spec, Source):
        return spec
    if isinstance(spec, (str, os.PathLike)) and not (isinstance(spec, str) and "\n" in spec):
        s = os.fspath(spec)
        path = Path(s)
        if path.exists():
            if not path.is_dir() and not path.is_file():
                raise PromptError(f"{path} is not a file or a folder")
            return FilesSource(path, text_column=text_column)
        if is_hub_url(s):
            rest = hub_path(s)
            if not rest.startswith("datasets/"):
                raise PromptError(f"{s}: a Hub source is a dataset repo, written hf://datasets/OWNER/NAME")
            repo = rest[len("datasets/"):].strip("/")
            if not REPO_ID_RE.match(repo):
                raise PromptError(f"{s}: {repo!r} is not a repo id (OWNER/NAME)")
            return HubDatasetSource(repo, config=config, split=split, token=token, text_column=text_column)
        if REPO_ID_RE.match(s) and path.suffix.lower() not in SUFFIXES:
            return HubDatasetSource(s, config=config, split=split, token=token, text_column=text_column)
        raise PromptError(f"prompt file {path} does not exist (nor is {s!r} a Hub dataset id, OWNER/NAME)")
    if isinstance(spec, Sequence) and not isinstance(spec, (str, bytes)) or _is_frame(spec):
        return MemorySource(spec, text_column=text_column)
    raise PromptError(f"cannot read prompts from {type(spec).__name__}; pass a file, a folder, a Hub dataset, a list "
                      "or a DataFrame")


def _is_frame(x: Any) -> bool:
    return type(x).__name__ == "DataFrame" and hasattr(x, "to_dict")
