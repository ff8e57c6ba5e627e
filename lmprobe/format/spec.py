"""Constants of the lmprobe dataset format (docs/format.md is the document they implement; dtypes: dtypes.py)."""

from __future__ import annotations

import re

import pyarrow as pa

from ..errors import InvalidArgumentError

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
