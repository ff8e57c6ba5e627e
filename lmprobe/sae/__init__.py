"""SAE dictionaries: sparse CSR encoders per layer, a lazy loader and top-k projection.

Public names follow the SAE dictionary document: SAEConfig, SAELayerWeights, SAEDictionary,
load_dictionary, project_topk. numpy is optional for loading and projecting. ``encode`` and
``encode_topk`` apply each layer's recorded activation rule (``lmprobe.sae.activation``).
"""

from .loader import (
    SAEConfig,
    SAEDictionary,
    SAELayerWeights,
    dense_encoder,
    detect_device,
    encode,
    encode_topk,
    is_dictionary_folder,
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
    "encode",
    "encode_topk",
    "export_sae",
    "is_dictionary_folder",
    "load_dictionary",
    "project_topk",
    "project_topk_batch",
    "validate_dictionary",
]


def __getattr__(name: str):
    # export needs numpy; the loader and projection work without it, so it loads on first use
    if name == "export_sae":
        from .export import export_sae

        return export_sae
    raise AttributeError(f"module 'lmprobe.sae' has no attribute {name!r}")
