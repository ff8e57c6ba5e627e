"""Artefacts beside a dataset, for tests: a random SAE dictionary exported and loaded back, and a SAELens
activation cache folder read with pyarrow alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from lmprobe.sae.export import export_sae
from lmprobe.sae.loader import SAEConfig, dense_encoder, load_dictionary


def random_dictionary(ds, root: Path, layer: int, features: int = 48, seed: int = 0):
    """Export a random dictionary "d" for ``layer`` under ``root``; return its dense (W, b) as the loader reads it."""
    rng = np.random.default_rng(seed)
    W = rng.normal(size=(features, ds.dim)).astype(np.float32) / np.sqrt(ds.dim)
    b = rng.normal(size=features).astype(np.float32) * 0.5 - 1.0
    export_sae(layer=layer, root=root, dictionary="d", W_enc=W, b_enc=b, orientation="out_in")
    weights = load_dictionary(SAEConfig(root_path=root, dictionary_name="d", device="cpu")).get_layer(layer)
    return dense_encoder(weights), np.asarray(weights.bias, dtype=np.float32)


def read_cache(folder: Path) -> tuple[dict, list[pa.RecordBatch]]:
    """A SAELens cache folder (the datasets library's layout): its state.json and every record batch, in order."""
    state = json.loads((folder / "state.json").read_text())
    batches = []
    for f in state["_data_files"]:
        with pa.memory_map(str(folder / f["filename"])) as src:
            batches.extend(pa.ipc.open_stream(src))
    return state, batches
