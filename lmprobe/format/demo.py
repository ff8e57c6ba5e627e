"""A synthetic dataset for trying the format without a model (``lmprobe demo --out DIR``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .datasetspec import DatasetSpec
from .writer import DatasetWriter

_WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "big", "small", "red", "tree"]


def write_demo(out: str | os.PathLike, *, n_prompts: int = 64, dim: int = 16, layers=(0, 1, 2),
               overwrite: bool = False, seed: int = 0) -> Path:
    """Write ``n_prompts`` random prompts whose label is linearly readable from the later layers."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=dim)
    spec = DatasetSpec(layers=list(layers), dim=dim, model_name="lmprobe/synthetic-demo", storage="full_sequence",
                       label_type="int", logits_topk=5, columns={"source": "string"}, shard_size="2KB")
    with DatasetWriter(out, spec, overwrite=overwrite) as w:
        for start in range(0, n_prompts, 16):
            b = min(16, n_prompts - start)
            n_tok = rng.integers(1, 9, size=b)
            labels = rng.integers(0, 2, size=b)
            texts = [" ".join(rng.choice(_WORDS, size=int(t))) for t in n_tok]
            hidden = {}
            for depth, layer in enumerate(layers):
                acts = rng.normal(size=(int(n_tok.sum()), dim)).astype(np.float32)
                ends = np.cumsum(n_tok) - 1
                acts[ends] += np.outer(2 * labels - 1, direction) * depth
                hidden[layer] = acts
            logits = rng.normal(size=(b, 5)).astype(np.float32)
            w.add_batch(texts=texts, labels=labels.tolist(), num_tokens=n_tok, hidden=hidden,
                        logits_values=-np.sort(-logits, axis=1), logits_indices=rng.integers(0, 100, size=(b, 5)),
                        columns={"source": ["demo"] * b})
    return Path(out)
