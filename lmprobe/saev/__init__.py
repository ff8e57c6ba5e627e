"""Export to the saev sharded activation protocol 2.0 (and saev's 2.1), and read it back (docs/saev.md).

    <dump_to>/<HASH>/metadata.json  shards.json  acts000000.bin ...  [labels.bin]  [tokens.bin]

An example is a window of ``context_len`` (T) consecutive tokens. The prompts of a full_sequence
lmprobe dataset are concatenated in index order (optionally without each prompt's first token),
cut into windows of T tokens, and the final partial window is dropped. Each shard holds
(n_ex, L, T, D) float32, C order, little-endian. HASH is the sha256 of the canonical JSON of
metadata.json, so identical configurations share a folder and different ones never collide.

``saev_compat`` writes what saev's own loaders read instead: "2.0" for saev e43e7dd (the protocol
document's keys plus ``pixel_agg: null``), "2.1" for saev 3d73f1f (renamed keys, ``n_examples`` in
shards.json, ``data`` a string, and HASH the first 8 hex digits of sha256 over the metadata's JSON
in field order). Both hash the metadata the way that saev commit does, so saev's
``Metadata.hash`` equals the folder name. lmprobe reads all three layouts.
"""

from ..errors import SaevError
from .export import export_saev, source_index_hash
from .protocol import (
    COMPAT,
    DEFAULT_PATCHES_PER_SHARD,
    PROTOCOL,
    canonical_metadata,
    compat_mode,
    ex_per_shard,
    metadata_hash,
    read_saev_metadata,
    recorded_source_hash,
    shard_sizes,
)
from .reader import SaevDataset, is_saev_folder, saev_exports, validate_saev

__all__ = ["COMPAT", "DEFAULT_PATCHES_PER_SHARD", "PROTOCOL", "SaevDataset", "SaevError", "canonical_metadata",
           "compat_mode", "ex_per_shard", "export_saev", "is_saev_folder", "metadata_hash", "read_saev_metadata",
           "recorded_source_hash", "saev_exports", "shard_sizes", "source_index_hash", "validate_saev"]
