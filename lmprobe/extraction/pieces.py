"""The pieces a source of many files is dealt to ranks by (a whole file, or one row group of a parquet file), and
the parquet footers that count them: pure arithmetic and one small read at the end of a file.

>>> [(p.number, p.file, p.row_group, p.rows) for p in build_pieces([[[3, 10], [2, 9]], None], [30, 7])]
[(0, 0, 0, 3), (1, 0, 1, 2), (2, 1, None, None)]
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..base.display import one_line
from ..errors import PromptError


@dataclass(frozen=True)
class Piece:
    """A unit a source of many files deals to ranks: a whole file, or one row group of a parquet file."""

    number: int  # its place in the source's pieces, which are in source order
    file: int  # the file it is in (an index into the source's files)
    row_group: int | None  # the parquet row group, or None: the whole file
    first_row: int  # the piece's first row in its file (0 for a whole file)
    rows: int | None  # records it holds when known without reading it (a parquet footer), else None
    nbytes: int  # its bytes in the file (a row group: its compressed size), for plans and benchmarks


def row_group_bytes(rg: Any) -> int:
    """A parquet row group's compressed bytes in its file."""
    return sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))


def build_pieces(layouts: Sequence[list[list[int]] | None], sizes: Sequence[int]) -> list[Piece]:
    """The pieces of a source of many files, in source order, from each file's layout (a parquet file's row
    groups as ``[rows, bytes]``; None: a file read whole, its records not yet counted) and size.

    >>> [(p.number, p.file, p.row_group, p.first_row, p.rows) for p in build_pieces([[[3, 10], [2, 9]], None], [30, 7])]
    [(0, 0, 0, 0, 3), (1, 0, 1, 3, 2), (2, 1, None, 0, None)]
    """
    out: list[Piece] = []
    for k, (layout, size) in enumerate(zip(layouts, sizes, strict=True)):
        if layout is None:
            out.append(Piece(len(out), k, None, 0, None, size))
            continue
        row = 0
        for g, (rows, nbytes) in enumerate(layout):
            out.append(Piece(len(out), k, g, row, rows, nbytes))
            row += rows
    return out


#: Bytes read at the end of a parquet file in one go, hoping the footer fits (a footer of one text column and a few
#: row groups takes 1-10 KiB); a larger footer costs a second read of exactly its size. pyarrow reads 64 KiB.
FOOTER_GUESS = 16 * 1024


def read_footer(fh: BinaryIO, name: str) -> Any:
    """A parquet file's footer (pyarrow's ``FileMetaData``), reading only its tail: every rank reads every file's
    footer, so it costs a few KiB a file rather than pyarrow's 64 KiB. Its length is checked against the file's
    size before anything is allocated (a footer is untrusted input)."""
    import pyarrow.parquet as pq

    size = fh.seek(0, os.SEEK_END)
    n = min(size, FOOTER_GUESS)
    fh.seek(size - n)
    tail = fh.read(n)
    length = int.from_bytes(tail[-8:-4], "little") if len(tail) >= 12 else -1
    if tail[-4:] != b"PAR1" or not 0 < length <= size - 12:
        raise PromptError(f"{name}: not a parquet file (no parquet footer at its end); remove it from the corpus or "
                          "rewrite it")
    if length + 8 > n:
        fh.seek(size - length - 8)
        tail = fh.read(length + 8)
    try:
        return pq.ParquetFile(io.BytesIO(b"PAR1" + tail[-(length + 8):])).metadata
    except (OSError, ValueError) as exc:
        raise PromptError(f"{name}: its parquet footer cannot be read ({one_line(exc)[:200]}); remove it from the "
                          "corpus or rewrite it") from None
