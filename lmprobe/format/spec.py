"""Constants of the lmprobe dataset format 2.0 (docs/format.md is the document they implement)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ..base.paths import check_pattern
from ..errors import InvalidArgumentError

FORMAT_VERSION = "2.0"
META_PREFIX = "lmprobe:"
INDEX_PATH = "index/train-00000-of-00001.parquet"
CARD_PATH = "README.md"
STAGING_DIR = ".lmprobe-staging"
#: in a local copy made by ``lmprobe pull``: the Hub repo and revision it came from (not a dataset file: never pushed)
PULL_RECORD = ".lmprobe-pull.json"
#: artefacts published beside a dataset, each under its own folder (``saev/<HASH>/``, ``sae/<name>/``)
ATTACHMENT_KINDS = ("saev", "sae")

DEFAULT_HIDDEN_FILE_PATTERN = "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors"
DEFAULT_HIDDEN_KEY_PATTERN = "hidden.layer_{layer}"
DEFAULT_LOGITS_FILE_PATTERN = "tensors/logits_topk_{shard:03d}.safetensors"
LOGITS_VALUES_KEY = "topk_values"
LOGITS_INDICES_KEY = "topk_indices"
# lmprobe 0.10.3 keyed its logits tensors like this; readers accept both.
LEGACY_LOGITS_KEYS = ("logits_topk.values", "logits_topk.indices")

DEFAULT_SHARD_SIZE = 1024**3
#: the largest shard a writer makes: the Hub takes files under 20 GB (a shard is its tensor bytes plus a header)
MAX_SHARD_SIZE = 16 * 1024**3

#: shard file layouts. ``flat``: every shard in ``tensors/`` with 3-digit numbers (lmprobe 0.10.3's names);
#: ``nested``: a folder per hookpoint and layer, 5-digit shard numbers, so that names sort in shard order and no
#: folder holds more than a layer's shards (the Hub recommends under 10,000 entries a folder)
LAYOUTS = ("flat", "nested")
#: a dataset planned to hold at least this many shards per layer (or of unknown size) is written nested
NESTED_FROM_SHARDS = 1000
NESTED_HIDDEN_FILE_PATTERN = "tensors/hidden/layer{layer:03d}/shard{shard:05d}.safetensors"
NESTED_LOGITS_FILE_PATTERN = "tensors/logits_topk/shard{shard:05d}.safetensors"
#: the Hub's limits (huggingface.co/docs/hub/repositories-recommendations): entries a folder, files a repo
HUB_FOLDER_ENTRIES = 10_000
HUB_REPO_FILES = 100_000

STORAGES = ("pooled", "full_sequence")

#: Named hookpoints, in the order a block computes them (docs/hookpoints.md says where each sits).
HOOKPOINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post")
#: What ``hidden_layers`` holds unless its descriptor's ``hookpoint`` says otherwise.
DEFAULT_HOOKPOINT = "resid_post"
_MODULE_HOOKPOINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*:(input|output)$")


def check_hookpoint(hookpoint: object) -> str:
    """A named hookpoint, or a module path relative to the block with ``:input``/``:output``; else an error."""
    if isinstance(hookpoint, str) and (hookpoint in HOOKPOINTS or _MODULE_HOOKPOINT.match(hookpoint)):
        return hookpoint
    raise InvalidArgumentError(
        f"unknown hookpoint {hookpoint!r}: use one of {', '.join(HOOKPOINTS)}, or a module path inside the block "
        "with :input or :output, e.g. mlp.act_fn:output")


def hookpoint_slug(hookpoint: str) -> str:
    """A file-name-safe form of a hookpoint: ``mlp.act_fn:output`` -> ``mlp_act_fn_output``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", hookpoint).strip("_")


def hookpoint_patterns(hookpoint: str, layout: str = "flat") -> tuple[str, str]:
    """(file_pattern, key_pattern) of a hookpoint other than the one ``hidden_layers`` holds."""
    slug = hookpoint_slug(hookpoint)
    if layout == "nested":
        return f"tensors/{slug}/layer{{layer:03d}}/shard{{shard:05d}}.safetensors", f"{slug}.layer_{{layer}}"
    return f"tensors/{slug}_layer{{layer:03d}}_shard{{shard:03d}}.safetensors", f"{slug}.layer_{{layer}}"


def hookpoint_tensor_name(hookpoint: str) -> str:
    """The ``lmprobe:tensors`` entry of a hookpoint other than the one ``hidden_layers`` holds."""
    return f"hidden_{hookpoint_slug(hookpoint)}"


@dataclass(frozen=True)
class DType:
    name: str  # the name written in metadata
    st: str  # safetensors' dtype tag
    itemsize: int
    np_storage: np.dtype  # how the raw bytes are held in numpy (bfloat16 has no numpy dtype)


DTYPES: dict[str, DType] = {
    "float32": DType("float32", "F32", 4, np.dtype("<f4")),
    "float16": DType("float16", "F16", 2, np.dtype("<f2")),
    "bfloat16": DType("bfloat16", "BF16", 2, np.dtype("<u2")),
    "float64": DType("float64", "F64", 8, np.dtype("<f8")),
    "int32": DType("int32", "I32", 4, np.dtype("<i4")),
    "int64": DType("int64", "I64", 8, np.dtype("<i8")),
}
HIDDEN_DTYPES = ("float32", "float16", "bfloat16")
ST_TO_DTYPE = {d.st: d for d in DTYPES.values()}


def dtype_info(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


# Index columns in the order the writer emits them. User columns follow, in the order given.
CORE_COLUMNS: dict[str, pa.DataType] = {
    "text": pa.string(),
    "label": pa.int32(),  # or pa.string(); see writer
    "num_tokens": pa.int32(),
    "shard_index": pa.int32(),
    "row_offset": pa.int32(),
}
FULL_SEQUENCE_COLUMNS: dict[str, pa.DataType] = {
    "token_offset": pa.int64(),
    "token_shard_ids": pa.list_(pa.int64()),
    "token_shard_offsets": pa.list_(pa.int64()),
}
LOGITS_COLUMNS: dict[str, pa.DataType] = {
    "shard_index_logits": pa.int32(),
    "row_offset_logits": pa.int32(),
}
PERPLEXITY_COLUMNS: dict[str, pa.DataType] = {
    "perplexity_mean": pa.float64(),
    "perplexity_min": pa.float64(),
    "perplexity_max": pa.float64(),
}
#: rows cut from documents (corpus extraction with context windows): where each row came from
CORPUS_COLUMNS: dict[str, pa.DataType] = {
    "document": pa.int64(),
    "window_start": pa.int64(),
}
#: recorded extraction settings that change no stored value beyond float rounding: outputs made under other
#: values of these are the same work (a partial output resumes under them; parts made with them merge); each
#: run's own values are kept in `lmprobe:runs`
RUN_SETTINGS = ("batch_size",)
#: prompts cut to --max-length (``--truncate left|right``): how many of each prompt's tokens the model did not see
TRUNCATION_COLUMNS: dict[str, pa.DataType] = {
    "truncated_tokens": pa.int32(),
}
TOKEN_COLUMNS: dict[str, pa.DataType] = {
    "token_ids": pa.list_(pa.int64()),
    "token_perplexity": pa.list_(pa.float64()),
    "token_strings": pa.list_(pa.string()),
}
RESERVED_COLUMNS = frozenset(
    [*CORE_COLUMNS, *FULL_SEQUENCE_COLUMNS, *LOGITS_COLUMNS, *PERPLEXITY_COLUMNS, *TOKEN_COLUMNS, *CORPUS_COLUMNS,
     *TRUNCATION_COLUMNS]
)
#: Index columns with one entry per token: read lazily, by row group, never all at once.
PER_TOKEN_COLUMNS = frozenset(["token_shard_ids", "token_shard_offsets", *TOKEN_COLUMNS])


@dataclass(frozen=True)
class DatasetSpec:
    """What a dataset stores, fixed when its writer is created (the writer's constructor arguments, checked)."""

    layers: tuple[int, ...]
    """Stored layers, distinct and non-negative."""
    dim: int
    """Hidden size."""
    model_name: str
    """The model id (or local path) recorded as ``model.name``."""
    model_revision: str | None = None
    """The commit of the weights, when known."""
    storage: str = "pooled"
    """``pooled`` (last token of each prompt) or ``full_sequence`` (every token)."""
    dtype: str = "float32"
    """Stored dtype of the hidden states."""
    shard_size: int = DEFAULT_SHARD_SIZE
    """Byte budget of one shard."""
    logits_k: int | None = None
    """Top-k logits per prompt, or None."""
    label_type: str | None = None
    """``int``, ``string`` or None (no labels)."""
    columns: Mapping[str, str] = field(default_factory=dict)
    """User columns: name -> type name (see values.COLUMN_TYPES)."""
    perplexity: bool = False
    token_ids: bool = False
    token_strings: bool = False
    token_perplexity: bool = False
    statistics: bool = False
    """Keep running per-layer statistics of every stored vector."""
    corpus: bool = False
    """Rows are windows cut from documents: the index has ``document`` and ``window_start`` columns."""
    truncation: bool = False
    """Prompts may have been cut to a length: the index has a ``truncated_tokens`` column (0: not cut)."""
    hookpoints: tuple[str, ...] = (DEFAULT_HOOKPOINT,)
    """Where in each block the stored vectors were read; the first (resid_post when present) is ``hidden_layers``."""
    hookpoint_dims: tuple[int, ...] = ()
    """The width of each hookpoint's vectors, in ``hookpoints`` order (empty: ``dim`` for all)."""
    file_pattern: str = DEFAULT_HIDDEN_FILE_PATTERN
    key_pattern: str = DEFAULT_HIDDEN_KEY_PATTERN
    logits_file_pattern: str = DEFAULT_LOGITS_FILE_PATTERN
    layout: str = "flat"
    """``flat`` (today's names, every shard in ``tensors/``) or ``nested`` (a folder per hookpoint and layer,
    5-digit shard numbers): the default patterns follow it (docs/format.md, "Shard file layout")."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {list(LAYOUTS)}, got {self.layout!r}")
        if self.layout == "nested":  # the default names of a nested dataset (explicit patterns stay as given)
            if self.file_pattern == DEFAULT_HIDDEN_FILE_PATTERN:
                object.__setattr__(self, "file_pattern", NESTED_HIDDEN_FILE_PATTERN)
            if self.logits_file_pattern == DEFAULT_LOGITS_FILE_PATTERN:
                object.__setattr__(self, "logits_file_pattern", NESTED_LOGITS_FILE_PATTERN)
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
        k = self.logits_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0):
            raise InvalidArgumentError(f"logits_k must be a positive integer or None, got {k!r}")
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
        return self.dim_of(self.primary_hookpoint) * DTYPES[self.dtype].itemsize

    @property
    def rows_per_shard(self) -> int:
        """Rows per shard: every hookpoint shares the shard structure, so the widest one decides."""
        widest = max(self.dim_of(hp) for hp in self.hookpoints) * DTYPES[self.dtype].itemsize
        return max(1, self.shard_size // widest)

    @property
    def logits_rows_per_shard(self) -> int:
        return max(1, self.shard_size // (8 * (self.logits_k or 1)))

    def fingerprint(self) -> dict[str, Any]:
        """Everything that decides the bytes written: a partial output resumes only under the same fingerprint."""
        return {
            "format_version": FORMAT_VERSION,
            "layers": list(self.layers),
            "dim": self.dim,
            "storage": self.storage,
            "dtype": self.dtype,
            "shard_size": self.shard_size,
            "logits_k": self.logits_k,
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
