"""SAE dictionaries: sparse CSR encoders per layer, a lazy loader and top-k projection.

Public names follow the SAE dictionary document: SAEConfig, SAELayerWeights, SAEDictionary,
load_dictionary, project_topk. numpy is optional for loading and projecting.
"""

from .loader import (
    SAEConfig,
    SAEDictionary,
    SAELayerWeights,
    dense_encoder,
    detect_device,
    load_dictionary,
    project_topk,
    project_topk_batch,
    validate_dictionary,
)

__all__ = [
    "SAEConfig",
    "SAEDictionary",
    "SAELayerWeights",
    "dense_encoder",
    "detect_device",
    "export_sae",
    "load_dictionary",
    "project_topk",
    "project_topk_batch",
    "push_dictionary",
    "validate_dictionary",
]


def export_sae(*args, **kwargs):
    """See ``lmprobe.sae.export.export_sae`` (needs numpy)."""
    from .export import export_sae as _export

    return _export(*args, **kwargs)


def push_dictionary(root, name, repo_id, **kwargs):
    """Publish dictionary ``root/name`` to the Hub model repo ``repo_id`` under ``name/``; meta.json last."""
    from .publish import push_dictionary as _push

    return _push(root, name, repo_id, **kwargs)
