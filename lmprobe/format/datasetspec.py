"""``DatasetSpec``: what a dataset will hold, fixed before its writer writes a byte, checked when it is made.

A ``DatasetWriter`` takes one (``DatasetWriter(out, spec)``), or builds one from the same names given as
keywords (``DatasetWriter(out, layers=[0], dim=8, model_name="m")``): each setting is written once, here,
with its type, default and meaning. The writer's own session options (resume, overwrite, checkpoints,
callbacks) are not part of it: they say how this run writes, not what the dataset holds.

>>> spec = DatasetSpec(layers=[0, 3], dim=16, model_name="demo", shard_size="2KB")
>>> spec.layers, spec.shard_size
((0, 3), 2000)
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ..base.paths import check_pattern
from ..base.units import parse_size
from ..errors import InvalidArgumentError
from .dtypes import DTYPES, HIDDEN_DTYPES
from .spec import (
    DEFAULT_HIDDEN_FILE_PATTERN,
    DEFAULT_HIDDEN_KEY_PATTERN,
    DEFAULT_HOOKPOINT,
    DEFAULT_LOGITS_FILE_PATTERN,
    DEFAULT_SHARD_SIZE,
    LAYOUTS,
    MAX_SHARD_SIZE,
    NESTED_HIDDEN_FILE_PATTERN,
    NESTED_LOGITS_FILE_PATTERN,
    RESERVED_COLUMNS,
    STORAGES,
    check_hookpoint,
    hookpoint_patterns,
    hookpoint_slug,
)
from .values import column_type_name

RENAMED_KEYWORDS = {"logits_k": "logits_topk"}
"""Old keyword -> its name now: still taken by ``DatasetSpec`` and ``DatasetWriter``, with a DeprecationWarning."""


def renamed_keywords(kwargs: dict[str, Any], *, stacklevel: int) -> dict[str, Any]:
    """``kwargs`` with the old names of ``RENAMED_KEYWORDS`` replaced by the new ones, warning for each.

    ``stacklevel`` counts from the caller of this function, as ``warnings.warn``'s does (2: the caller's caller)."""
    for old, new in RENAMED_KEYWORDS.items():
        if old in kwargs:
            if new in kwargs:
                raise TypeError(f"{old} is the old name of {new}: pass {new} only")
            warnings.warn(f"the keyword {old} is deprecated; pass {new}", DeprecationWarning, stacklevel=stacklevel + 1)
            kwargs = {(new if k == old else k): v for k, v in kwargs.items()}
    return kwargs


def _taking_renamed_keywords(cls: type) -> type:
    """The dataclass's generated ``__init__`` wrapped to take the old names of ``RENAMED_KEYWORDS`` (its signature, for
    ``help`` and ``inspect``, stays the generated one)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **renamed_keywords(kwargs, stacklevel=2))

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_taking_renamed_keywords
@dataclass(frozen=True)
class DatasetSpec:
    """What a dataset stores and records, checked when it is made (the old ``DatasetWriter`` keywords).

    Values are normalised as they come in (layers to a tuple of ints, ``shard_size`` to bytes, column
    types to their names), so two specs of the same dataset compare equal however they were spelled.
    """

    layers: Sequence[int]
    """Stored layers, distinct and non-negative (kept as a tuple of ints)."""
    dim: int
    """Hidden size: the width of the stored vectors (of every hookpoint unless ``hookpoint_dims`` says)."""
    model_name: str
    """The model id (or local path) recorded as ``model.name``."""
    model_revision: str | None = None
    """The commit of the weights, when known (``model.revision``)."""
    storage: str = "pooled"
    """``pooled`` (the last token of each prompt) or ``full_sequence`` (every token)."""
    dtype: str = "float32"
    """Stored dtype of the hidden states: ``float32``, ``float16``, ``bfloat16`` or ``int8`` (per-row absmax scales;
    format 3.0, docs/format.md)."""
    shard_size: int | str = DEFAULT_SHARD_SIZE
    """Byte budget of one shard: an int or a size such as ``"512MB"`` (kept in bytes), at most 16 GiB."""
    logits_topk: int | None = None
    """Top-k logits stored per prompt, or None for none (``logits_k=``, its old name, still works and warns)."""
    label_type: str | None = None
    """``int``, ``string`` or None (no labels)."""
    columns: Mapping[str, str | pa.DataType] | None = field(default_factory=dict)
    """User columns of the index: name -> type (a name of values.COLUMN_TYPES or a pyarrow type; kept as names)."""
    perplexity: bool = False
    """The index has per-prompt perplexity columns (``perplexity_mean``, ``_min``, ``_max``)."""
    token_ids: bool = False
    """The index has each prompt's token ids (``token_ids``)."""
    token_strings: bool = False
    """The index has each prompt's decoded tokens (``token_strings``)."""
    token_perplexity: bool = False
    """The index has each token's perplexity (``token_perplexity``)."""
    prompt_ordering: str = "input"
    """What the index's row order is, recorded as ``prompt_ordering``."""
    provenance: Mapping[str, Any] | None = None
    """Recorded in ``provenance`` over the writer's own (lmprobe's version, the creation time, ...)."""
    metadata: Mapping[str, Any] | None = None
    """Further ``lmprobe:`` keys to record (an extraction's settings, for instance)."""
    file_pattern: str = DEFAULT_HIDDEN_FILE_PATTERN
    """Where hidden-state shards go, over ``{layer}`` and ``{shard}`` (the ``layout``'s default unless given)."""
    key_pattern: str = DEFAULT_HIDDEN_KEY_PATTERN
    """The tensor name of a layer inside its shard, over ``{layer}``."""
    logits_file_pattern: str = DEFAULT_LOGITS_FILE_PATTERN
    """Where top-k logits shards go, over ``{shard}``."""
    layout: str = "flat"
    """``flat`` (today's names, every shard in ``tensors/``) or ``nested`` (a folder per hookpoint and layer,
    5-digit shard numbers): the default patterns follow it (docs/format.md, "Shard file layout")."""
    checksums: bool = True
    """Record each shard's SHA-256 in the metadata."""
    statistics: bool = False
    """Keep running per-layer statistics of every stored vector."""
    corpus: bool = False
    """Rows are windows cut from documents: the index has ``document`` and ``window_start`` columns."""
    truncation: bool = False
    """Prompts may have been cut to a length: the index has a ``truncated_tokens`` column (0: not cut)."""
    hookpoints: Sequence[str] = (DEFAULT_HOOKPOINT,)
    """Where in each block the stored vectors were read; the first (resid_post when present) is ``hidden_layers``."""
    hookpoint_dims: Sequence[int] = ()
    """The width of each hookpoint's vectors, in ``hookpoints`` order (empty: ``dim`` for all)."""

    def __post_init__(self) -> None:
        self._normalise()
        self._check()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: values are normalised once, here

    def _normalise(self) -> None:
        try:
            self._set("layers", tuple(int(x) for x in self.layers))
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"layers must be distinct non-negative integers, got {self.layers!r}") from None
        self._set("shard_size", parse_size(self.shard_size))
        self._set("logits_topk", int(self.logits_topk) if self.logits_topk else self.logits_topk)
        self._set("columns", {n: column_type_name(t) for n, t in (self.columns or {}).items()})
        for flag in ("perplexity", "token_ids", "token_strings", "token_perplexity", "checksums", "statistics",
                     "corpus", "truncation"):
            self._set(flag, bool(getattr(self, flag)))
        self._set("provenance", dict(self.provenance or {}))
        self._set("metadata", dict(self.metadata or {}))
        hps = self.hookpoints
        self._set("hookpoints", tuple(hps) if not isinstance(hps, str) else (hps,))
        self._set("hookpoint_dims", tuple(int(d) for d in self.hookpoint_dims))
        if self.layout == "nested":  # the default names of a nested dataset (explicit patterns stay as given)
            if self.file_pattern == DEFAULT_HIDDEN_FILE_PATTERN:
                self._set("file_pattern", NESTED_HIDDEN_FILE_PATTERN)
            if self.logits_file_pattern == DEFAULT_LOGITS_FILE_PATTERN:
                self._set("logits_file_pattern", NESTED_LOGITS_FILE_PATTERN)

    def _check(self) -> None:
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {list(LAYOUTS)}, got {self.layout!r}")
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, (int, np.integer)) \
                or not 0 < self.shard_size <= MAX_SHARD_SIZE:
            raise InvalidArgumentError(f"shard_size must be 1 byte to 16 GiB (the Hub takes files under 20 GB), got "
                                       f"{self.shard_size!r}")
        layers = self.layers
        if not layers or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0 for x in layers) \
                or len(set(layers)) != len(layers):
            raise InvalidArgumentError(f"layers must be distinct non-negative integers, got {list(layers)}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer)) or self.dim <= 0:
            raise InvalidArgumentError(f"dim must be a positive integer, got {self.dim!r}")
        if self.storage not in STORAGES:
            raise InvalidArgumentError(f"storage must be one of {STORAGES}, got {self.storage!r}")
        if self.dtype not in HIDDEN_DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {HIDDEN_DTYPES}, got {self.dtype!r}")
        k = self.logits_topk
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0):
            raise InvalidArgumentError(f"logits_topk must be a positive integer or None, got {k!r}")
        if self.label_type not in (None, "int", "string"):
            raise InvalidArgumentError(f"label_type must be 'int', 'string' or None, got {self.label_type!r}")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise InvalidArgumentError("model_name must be a non-empty string")
        check_pattern(self.file_pattern, ("layer", "shard"), "file_pattern")
        check_pattern(self.key_pattern, ("layer",), "key_pattern")
        check_pattern(self.logits_file_pattern, ("shard",), "logits_file_pattern")
        for f in ("layer", "shard"):
            if "{" + f not in self.file_pattern:
                raise InvalidArgumentError(
                    f"file_pattern {self.file_pattern!r} must use {{{f}}} so that every shard has its own file")
        if "{shard" not in self.logits_file_pattern:
            raise InvalidArgumentError(f"logits_file_pattern {self.logits_file_pattern!r} must use {{shard}}")
        hps = self.hookpoints
        if not hps or len(set(hps)) != len(hps):
            raise InvalidArgumentError(f"hookpoints must be distinct and at least one, got {list(hps)}")
        for hp in hps:
            check_hookpoint(hp)
        if self.hookpoint_dims and (len(self.hookpoint_dims) != len(hps)
                                    or any(not isinstance(d, int) or d < 1 for d in self.hookpoint_dims)):
            raise InvalidArgumentError(f"hookpoint_dims must give one positive width per hookpoint, got "
                                       f"{list(self.hookpoint_dims)} for {list(hps)}")
        slugs = [hookpoint_slug(hp) for hp in hps]
        if len(set(slugs)) != len(slugs) or "hidden" in slugs:
            raise InvalidArgumentError(f"hookpoints {list(hps)} would share file names; name each module once")
        for name in self.columns:
            if name in RESERVED_COLUMNS:
                raise InvalidArgumentError(f"user column {name!r} collides with a column of the format; rename it")

    @property
    def primary_hookpoint(self) -> str:
        """The hookpoint ``hidden_layers`` holds: resid_post when stored, else the first one."""
        return DEFAULT_HOOKPOINT if DEFAULT_HOOKPOINT in self.hookpoints else self.hookpoints[0]

    def slot(self, hookpoint: str, layer: int) -> str:
        """The writer's name for one (hookpoint, layer) series: the layer number for ``hidden_layers``."""
        return str(layer) if hookpoint == self.primary_hookpoint else f"{hookpoint_slug(hookpoint)}.{layer}"

    @property
    def sites(self) -> dict[str, tuple[str, int]]:
        """Every stored (hookpoint, layer), by slot: ``hidden_layers``' layers first."""
        hps = [self.primary_hookpoint] + [hp for hp in self.hookpoints if hp != self.primary_hookpoint]
        return {self.slot(hp, layer): (hp, layer) for hp in hps for layer in self.layers}

    def patterns(self, hookpoint: str) -> tuple[str, str]:
        """(file_pattern, key_pattern) of a stored hookpoint."""
        if hookpoint == self.primary_hookpoint:
            return self.file_pattern, self.key_pattern
        return hookpoint_patterns(hookpoint, self.layout)

    @property
    def full_sequence(self) -> bool:
        return self.storage == "full_sequence"

    def dim_of(self, hookpoint: str) -> int:
        """The width of a stored hookpoint's vectors."""
        if not self.hookpoint_dims:
            return self.dim
        return self.hookpoint_dims[self.hookpoints.index(hookpoint)]

    @property
    def row_bytes(self) -> int:
        return DTYPES[self.dtype].row_bytes(self.dim_of(self.primary_hookpoint))

    @property
    def rows_per_shard(self) -> int:
        """Rows per shard: every hookpoint shares the shard structure, so the widest one decides."""
        widest = DTYPES[self.dtype].row_bytes(max(self.dim_of(hp) for hp in self.hookpoints))
        return max(1, self.shard_size // widest)

    @property
    def logits_rows_per_shard(self) -> int:
        return max(1, self.shard_size // (8 * (self.logits_topk or 1)))

    @property
    def logits_k(self) -> int | None:
        """Deprecated: the old name of ``logits_topk``."""
        warnings.warn("DatasetSpec.logits_k is deprecated; read logits_topk", DeprecationWarning, stacklevel=2)
        return self.logits_topk

    def fingerprint(self) -> dict[str, Any]:
        """Everything that decides the bytes written: a partial output resumes only under the same fingerprint."""
        return {
            "format_version": DTYPES[self.dtype].format_version,
            "layers": list(self.layers),
            "dim": self.dim,
            "storage": self.storage,
            "dtype": self.dtype,
            "shard_size": self.shard_size,
            "logits_k": self.logits_topk,  # the key partial outputs were written with: kept, so that they resume
            "label_type": self.label_type,
            "columns": dict(self.columns),
            "file_pattern": self.file_pattern,
            "key_pattern": self.key_pattern,
            "logits_file_pattern": self.logits_file_pattern,
            "model": {"name": self.model_name, "revision": self.model_revision},
            "perplexity": self.perplexity,
            "token_ids": self.token_ids,
            "token_strings": self.token_strings,
            "token_perplexity": self.token_perplexity,
            "statistics": self.statistics,
            # added later: present only when set, so that partial outputs of earlier versions still resume
            **({"corpus": True} if self.corpus else {}),
            **({"truncation": True} if self.truncation else {}),
            **({"hookpoints": list(self.hookpoints)} if self.hookpoints != (DEFAULT_HOOKPOINT,) else {}),
            **({"hookpoint_dims": list(self.hookpoint_dims)} if self.hookpoint_dims else {}),
            **({"layout": self.layout} if self.layout != "flat" else {}),
        }
