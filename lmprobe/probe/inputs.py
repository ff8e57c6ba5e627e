"""What a probe is trained on: pooled features of one or several layers, labels or targets, groups, contrast
pairs and a held-out set, resolved from a dataset and checked before any activation is read.

Poolings (``pooling=``): ``last_token`` (what every dataset stores), ``first``, ``mean``, ``max``,
``min``, a token position (an int, negative from the end), or ``tokens`` (every token its own row,
the prompt's label repeated, folds by prompt). All but ``last_token`` need a full_sequence dataset.
Token rows are read in chunks of about 64 MiB, so memory is the pooled (N, dim) result.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ProbeError
from ..format.reader import Dataset
from ..format.spec import RESERVED_COLUMNS
from ..opening import load
from .methods import Pairs

Pooling = str | int  # "last_token", "first", "mean", "max", "min", "tokens" or a token position
POOLINGS = ("last_token", "first", "mean", "max", "min", "tokens")
LayerArg = int | Sequence[int]


def as_dataset(ds: Any) -> Dataset:
    return ds if isinstance(ds, Dataset) else load(ds)


def check_pooling(pooling: Pooling, ds: Dataset) -> None:
    if isinstance(pooling, (int, np.integer)) and not isinstance(pooling, bool):
        token_level = True
    elif pooling in POOLINGS:
        token_level = pooling != "last_token"
    else:
        raise ProbeError(f"pooling must be one of {', '.join(POOLINGS)} or a token position (int), got {pooling!r}")
    if token_level and ds.storage != "full_sequence":
        raise ProbeError(f"{pooling!r} pooling needs every token: this dataset is pooled (extract with --storage "
                         "full_sequence, or use pooling='last_token')")


def pooled(ds: Any, layer: int, *, pooling: Pooling = "last_token", rows: Any = None, hookpoint: str | None = None,
           chunk_bytes: int = 64 * 2**20) -> np.ndarray:
    """(N, dim) float32 features of ``layer`` for ``rows`` (default every prompt), pooled over each prompt's tokens.

    ``pooling="tokens"`` returns every token of those prompts, (sum of their lengths, dim)."""
    ds = as_dataset(ds)
    check_pooling(pooling, ds)
    r = ds.row_indices(rows)
    if pooling == "last_token":
        return np.asarray(ds.hidden(layer, rows=r, hookpoint=hookpoint), dtype=np.float32)
    layer = ds.check_layer(layer, hookpoint)
    lengths = ds.token_lengths()[r]
    if not isinstance(pooling, str):  # one position per prompt: read just those rows
        pos = int(pooling)
        short = int(np.sum((lengths <= pos) if pos >= 0 else (lengths < -pos)))
        if short:
            raise ProbeError(f"token position {pos} is past the end of {short} prompt(s) (the shortest has "
                             f"{int(lengths.min())} tokens): pick a position within every prompt")
        ids, offs, n = ds.shards.token_addresses(r)
        starts = np.concatenate([[0], np.cumsum(n)[:-1]])
        pick = starts + (pos if pos >= 0 else n + pos)
        return np.asarray(ds.shards.read_hidden_rows(layer, ids[pick], offs[pick], hookpoint=hookpoint), np.float32)
    if pooling == "first":
        return pooled(ds, layer, pooling=0, rows=r, hookpoint=hookpoint)
    dim = ds.hidden_desc(hookpoint).dim
    total = int(lengths.sum()) if pooling == "tokens" else len(r)
    out = np.empty((total, dim), dtype=np.float32)
    reduce = {"mean": np.add.reduceat, "max": np.maximum.reduceat, "min": np.minimum.reduceat}.get(pooling)
    per_chunk = max(1, chunk_bytes // (dim * 4))  # token rows per read
    cum = np.concatenate([[0], np.cumsum(lengths)])
    i = 0
    while i < len(r):  # prompts in chunks of about chunk_bytes of token rows
        j = max(int(np.searchsorted(cum, cum[i] + per_chunk, side="right")) - 1, i + 1)
        ids, offs, n = ds.shards.token_addresses(r[i:j])
        rows_td = np.asarray(ds.shards.read_hidden_rows(layer, ids, offs, hookpoint=hookpoint), dtype=np.float32)
        if reduce is None:  # tokens
            out[cum[i]:cum[j]] = rows_td
        else:
            part = reduce(rows_td, np.concatenate([[0], np.cumsum(n)[:-1]]), axis=0)
            out[i:j] = part / n[:, None] if pooling == "mean" else part
        i = j
    return out


def _column(ds: Dataset, name: str, what: str) -> np.ndarray:
    names = ds.prompt_table.column_names
    if name == "text":
        return np.asarray(ds.texts, dtype=object)
    if name not in names:
        own = [c for c in names if c not in RESERVED_COLUMNS]
        raise ProbeError(f"{what}={name!r}: the dataset has no such column; its own columns are {own}")
    col = ds.prompt_table.column(name)
    if col.null_count:
        raise ProbeError(f"{col.null_count} row(s) have no {name!r} ({what}); every prompt needs one")
    return np.asarray(col.to_pylist())


def has_labels(ds: Dataset, label_column: str) -> bool:
    names = ds.prompt_table.column_names
    if label_column not in names:
        return False
    col = ds.prompt_table.column(label_column)
    return not (label_column == "label" and col.null_count == len(col))  # an unlabeled extraction's label


@dataclass
class ProbeData:
    """The rows a probe sees: features come from ``parts`` (dataset, its prompt rows), concatenated in order."""

    parts: list[tuple[Dataset, np.ndarray]]
    y: np.ndarray
    task: str = "classification"
    pooling: Pooling = "last_token"
    hookpoint: str | None = None
    groups: np.ndarray | None = None
    pairs: Pairs | None = None
    texts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=object))
    test: np.ndarray | None = None  # a boolean mask of held-out rows
    token_counts: np.ndarray | None = None  # pooling == "tokens": tokens of each prompt

    @property
    def n(self) -> int:
        return len(self.y)

    @property
    def classes(self) -> list:
        return [] if self.task == "regression" else np.unique(self.y).tolist()

    def layers_list(self, layers: LayerArg) -> list[int]:
        ds = self.parts[0][0]
        layers = [layers] if isinstance(layers, (int, np.integer)) else list(layers)
        return [ds.check_layer(int(layer), self.hookpoint) for layer in layers]

    def features(self, layers: LayerArg) -> tuple[np.ndarray, list[int]]:
        """(N, sum of dims) float32 features of one layer or several concatenated, and the width of each block."""
        blocks = []
        for layer in self.layers_list(layers):
            blocks.append(np.concatenate([pooled(ds, layer, pooling=self.pooling, rows=rows, hookpoint=self.hookpoint)
                                          for ds, rows in self.parts]))
        widths = [b.shape[1] for b in blocks]
        return (blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)), widths


def probe_data(ds: Any, *, label_column: str = "label", task: str = "classification", pooling: Pooling = "last_token",
               hookpoint: str | None = None, groups: Any = None, pairs: Any = None, test: Any = None,
               rows: Any = None) -> ProbeData:
    """Resolve the inputs of a probe; every check runs here, before activations are read."""
    if task not in ("classification", "regression"):
        raise ProbeError(f"task must be 'classification' or 'regression', got {task!r}")
    if isinstance(pairs, (tuple, list)) and len(pairs) == 2 and not isinstance(pairs[0], (int, np.integer)):
        side_a, side_b = pairs
        if _is_dataset_like(side_a):  # two datasets: the positive and the negative side
            dsa, dsb = as_dataset(side_a), as_dataset(side_b)
            parts = [(dsa, dsa.row_indices(None)), (dsb, dsb.row_indices(None))]
        else:  # two row sets of one dataset
            base = as_dataset(ds)
            parts = [(base, base.row_indices(side_a)), (base, base.row_indices(side_b))]
        na, nb = len(parts[0][1]), len(parts[1][1])
        if na != nb:
            raise ProbeError(f"contrast pairs need as many positive as negative rows: got {na} and {nb}")
        pair = Pairs(np.arange(na), np.arange(na, 2 * na))
    else:
        base = as_dataset(ds)
        parts, pair = [(base, base.row_indices(rows))], None
    for d, _ in parts:
        check_pooling(pooling, d)
        if hookpoint is not None and hookpoint not in d.hookpoints:
            raise ProbeError(f"hookpoint {hookpoint!r} is not stored in {d.source}; it stores {d.hookpoints}")
    y = _targets(parts, label_column, task, two_sides=pair is not None)
    texts = np.concatenate([np.asarray(d.texts, dtype=object)[r] for d, r in parts])
    group_ids = None
    if isinstance(pairs, str):  # a column pairing rows
        col = np.concatenate([_column(d, pairs, "pairs")[r] for d, r in parts])
        uniq, inverse, counts = np.unique(col, return_inverse=True, return_counts=True)
        if (counts != 2).any():
            bad = uniq[counts != 2][:3].tolist()
            raise ProbeError(f"pairs={pairs!r}: every value must pair exactly two rows; {int((counts != 2).sum())} "
                             f"do not (e.g. {bad})")
        order = np.argsort(inverse, kind="stable")  # the two rows of each pair, in row order
        pair = Pairs(order[0::2], order[1::2])
        group_ids = inverse
    elif pair is not None:
        group_ids = np.concatenate([np.arange(len(pair.a)), np.arange(len(pair.a))])
    elif pairs is not None:
        raise ProbeError("pairs= takes a column name, or two datasets / row sets (positive, negative)")
    if groups is not None:
        g = (np.concatenate([_column(d, groups, "groups")[r] for d, r in parts]) if isinstance(groups, str)
             else np.asarray(groups))
        if len(g) != len(y):
            raise ProbeError(f"groups has {len(g)} entries for {len(y)} rows")
        if group_ids is not None:  # pairs stay together too: rows linked by either partition share a fold
            g = _connected(np.unique(g, return_inverse=True)[1], group_ids)
        group_ids = g
    mask = _test_mask(parts, test) if test is not None and not _is_dataset_like(test) else None
    data = ProbeData(parts, y, task, pooling, hookpoint, group_ids, pair, texts, mask)
    if pooling == "tokens":
        data = _expand_tokens(data)
    return data


def _connected(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rows linked by sharing a value of ``a`` or of ``b`` land in one group (union-find over both labelings)."""
    parent = np.arange(len(a))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for labels in (a, b):
        first: dict = {}
        for i, v in enumerate(labels.tolist()):
            if v in first:
                parent[find(i)] = find(first[v])
            else:
                first[v] = i
    return np.array([find(i) for i in range(len(a))])


def _is_dataset_like(x: Any) -> bool:
    return isinstance(x, (Dataset, str, os.PathLike))


def _targets(parts: list, label_column: str, task: str, *, two_sides: bool) -> np.ndarray:
    if two_sides and not all(has_labels(d, label_column) for d, _ in parts):  # the side is the label
        return np.concatenate([np.ones(len(parts[0][1]), np.int64), np.zeros(len(parts[1][1]), np.int64)])
    out = []
    for d, r in parts:
        if not has_labels(d, label_column):
            names = d.prompt_table.column_names
            own = [c for c in names if c not in RESERVED_COLUMNS]
            close = [c for c in own if c.lower() == label_column.lower()]
            raise ProbeError(f"the dataset has no {label_column!r} column; "
                             + (f"its own columns are {own}: pass --label-column NAME (label_column= in Python)"
                                if own else "it stores no other column to probe (extract with a label column)")
                             + (f"; did you mean --label-column {close[0]}?" if close else ""))
        col = d.prompt_table.column(label_column)
        if col.null_count:
            raise ProbeError(f"{col.null_count} row(s) have no {label_column!r}; probing needs a label for every prompt")
        out.append(np.asarray(col.to_pylist())[r])
    y = np.concatenate(out)
    if task == "regression":
        if y.dtype.kind not in "iuf":
            raise ProbeError(f"task='regression' needs a numeric {label_column!r}; it holds {y.dtype} values")
        return y.astype(np.float64)
    if len(np.unique(y)) < 2:
        raise ProbeError(f"{label_column!r} has a single class; a probe needs at least two")
    return y


def _test_mask(parts: list, test: Any) -> np.ndarray:
    """Held-out rows: ``(column, value)`` or ``{column: value}``, else rows of the (first) dataset."""
    ds, rows = parts[0]
    if isinstance(test, dict) and len(test) == 1:
        test = next(iter(test.items()))
    if isinstance(test, tuple) and len(test) == 2 and isinstance(test[0], str):
        column, value = test
        vals = np.concatenate([_column(d, column, "test")[r] for d, r in parts])
        mask = vals == value
        if not mask.any():
            raise ProbeError(f"test=({column!r}, {value!r}) selects no row; {column!r} holds e.g. "
                             f"{np.unique(vals)[:5].tolist()}")
    else:
        if len(parts) != 1:
            raise ProbeError("test= rows need one dataset; with two pair datasets pass (column, value) or a dataset")
        chosen = ds.row_indices(test)
        mask = np.isin(rows, chosen)
    if mask.all():
        raise ProbeError("test= holds out every row: nothing is left to train on")
    return mask


def _expand_tokens(data: ProbeData) -> ProbeData:
    if data.pairs is not None:
        raise ProbeError("pooling='tokens' makes every token a row; contrast pairs need one row per prompt")
    counts = np.concatenate([d.token_lengths()[r] for d, r in data.parts])
    prompt = np.repeat(np.arange(len(counts)), counts)
    groups = prompt if data.groups is None else data.groups[prompt]  # a prompt's tokens never straddle folds
    return ProbeData(data.parts, data.y[prompt], data.task, data.pooling, data.hookpoint, groups, None,
                     data.texts[prompt], None if data.test is None else data.test[prompt], counts)
