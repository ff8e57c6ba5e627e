"""Constants of the lmprobe dataset format 2.0 (docs/format.md is the document they implement)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

FORMAT_VERSION = "2.0"
META_PREFIX = "lmprobe:"
INDEX_PATH = "index/train-00000-of-00001.parquet"
CARD_PATH = "README.md"
STAGING_DIR = ".lmprobe-staging"

DEFAULT_HIDDEN_FILE_PATTERN = "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors"
DEFAULT_HIDDEN_KEY_PATTERN = "hidden.layer_{layer}"
DEFAULT_LOGITS_FILE_PATTERN = "tensors/logits_topk_{shard:03d}.safetensors"
LOGITS_VALUES_KEY = "topk_values"
LOGITS_INDICES_KEY = "topk_indices"
# lmprobe 0.10.3 keyed its logits tensors like this; readers accept both.
LEGACY_LOGITS_KEYS = ("logits_topk.values", "logits_topk.indices")

DEFAULT_SHARD_SIZE = 1024**3

STORAGES = ("pooled", "full_sequence")


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
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


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
TOKEN_COLUMNS: dict[str, pa.DataType] = {
    "token_ids": pa.list_(pa.int64()),
    "token_perplexity": pa.list_(pa.float64()),
    "token_strings": pa.list_(pa.string()),
}
RESERVED_COLUMNS = frozenset(
    [*CORE_COLUMNS, *FULL_SEQUENCE_COLUMNS, *LOGITS_COLUMNS, *PERPLEXITY_COLUMNS, *TOKEN_COLUMNS]
)
