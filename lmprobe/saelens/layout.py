"""SAELens' activation cache, both ways (docs/saelens.md).

SAELens' ``CacheActivationsRunner`` saves a Hugging Face ``datasets`` dataset to disk:

    DIR/state.json  dataset_info.json  data-00000-of-0000N.arrow ...  [cache-<fingerprint>.arrow]

Each row is one context window: a column named after the TransformerLens hook (e.g.
``blocks.6.hook_resid_post``), an ``Array2D`` of shape (context_size, d_in), and ``token_ids``, a
list of context_size int32. The data files are Arrow IPC streams listed, in order, by state.json's
``_data_files``; ``cache-*.arrow`` is the index mapping of ``dataset.shuffle(seed)``, which the
runner computes after saving and which state.json does not reference, so ``datasets.load_from_disk``
(and SAELens' ``ActivationsStore``) read the rows in ``_data_files`` order. Pushed to the Hub with
``push_to_hub``, the same dataset is Parquet files under ``data/``.

``export_saelens`` writes that layout from a full_sequence lmprobe dataset, one row per stored
prompt (window), with pyarrow only; ``import_saelens`` reads it (a folder, or a Hub dataset repo)
into an lmprobe dataset through the public ``DatasetWriter``. Both stream: a batch of rows at a time.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..base.display import escape_controls
from ..base.paths import resolve_inside
from ..base.safeio import check_regular
from ..errors import SaelensError, UnsafePathError

#: the SAELens release the layout was checked against (with the datasets release it installs)
SAELENS_CHECKED = "sae-lens 6.54.12 (datasets 5.2.0)"
#: lmprobe hookpoint -> TransformerLens hook of block {layer} (docs/hookpoints.md)
TL_HOOKS = {
    "resid_pre": "blocks.{layer}.hook_resid_pre",
    "attn_out": "blocks.{layer}.hook_attn_out",
    "resid_mid": "blocks.{layer}.hook_resid_mid",
    "mlp_in": "blocks.{layer}.ln2.hook_normalized",
    "mlp_out": "blocks.{layer}.hook_mlp_out",
    "resid_post": "blocks.{layer}.hook_resid_post",
    "self_attn.o_proj:input": "blocks.{layer}.attn.hook_z",
}
TL_NAME = re.compile(r"blocks\.(\d{1,6})\.(.+)")
ARRAY2D = "datasets.features.features.Array2DExtensionType"
#: datasets' default max_shard_size for save_to_disk
SHARD_BYTES = 500 * 2**20
BATCH_BYTES = 64 * 2**20


def tl_hook_name(hookpoint: str, layer: int) -> str:
    """The TransformerLens (and SAELens) name of an lmprobe hookpoint of block ``layer``.

    >>> tl_hook_name("resid_post", 6)
    'blocks.6.hook_resid_post'
    """
    if hookpoint not in TL_HOOKS:
        raise SaelensError(f"hookpoint {hookpoint!r} has no TransformerLens hook name; SAELens caches can hold "
                           f"{sorted(TL_HOOKS)}")
    return TL_HOOKS[hookpoint].format(layer=int(layer))


def parse_tl_hook(name: str) -> tuple[int, str]:
    """(layer, lmprobe hookpoint) of a TransformerLens hook name such as ``blocks.6.hook_resid_post``."""
    m = TL_NAME.fullmatch(name)
    if m:
        for hp, pattern in TL_HOOKS.items():
            if pattern.format(layer=m.group(1)) == name:
                return int(m.group(1)), hp
    raise SaelensError(f"activation column {escape_controls(name)!r} is not a TransformerLens hook lmprobe maps "
                       f"(blocks.<L>.{{{', '.join(p.split('.', 2)[2] for p in TL_HOOKS.values())}}})")


def inside(root: Path, name: str) -> Path:
    """The regular file ``name`` under the cache folder ``root`` (a link out of it, or a missing file: SaelensError)."""
    try:
        return check_regular(resolve_inside(root, name, "cache file"), "cache file")
    except UnsafePathError as exc:
        raise SaelensError(str(exc)) from None
    except FileNotFoundError:
        raise SaelensError(f"{root}: {name} is missing") from None
