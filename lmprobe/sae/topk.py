"""The top features of one probe vector: a dictionary layer loaded, a vector taken (a dataset's row or a random one),
and its features ranked; ``lmprobe sae-topk`` prints it (the dictionary document's smoke test)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from ..base.layers import stored_layer
from ..errors import DictionaryError, InvalidArgumentError, LayerNotFoundError
from .activation import describe
from .loader import SAEConfig, encode_topk, load_dictionary, project_topk


@dataclass(frozen=True)
class TopFeatures:
    """What :func:`top_features` found, and how long loading and ranking took."""

    dictionary: str
    layer: int  # the dictionary's layer (a negative one resolved)
    features: list[tuple[int, float]]  # (feature index, score), best first
    vector: str  # where the probe vector came from
    scores: bool  # raw scores W x + b (True) or activations under the layer's rule
    summary: str  # the layer: features, dims, weights, rule, device
    load_seconds: float
    rank_seconds: float

    def lines(self) -> list[str]:
        """What ``lmprobe sae-topk`` prints."""
        ranked = "raw scores W x + b" if self.scores else "activations; features that do not fire are left out"
        return [f"dictionary {self.dictionary!r} layer {self.layer}: {self.summary} (loaded in "
                f"{self.load_seconds * 1000:.0f} ms)",
                f"top {len(self.features)} features for {self.vector} by {ranked} ({self.rank_seconds * 1000:.1f} ms):",
                *(f"  feat_{idx}\t{score:.6f}" for idx, score in self.features)]


def top_features(root: str, dictionary: str, layer: int, *, k: int = 10, dataset: str | None = None, prompt: int = 0,
                 seed: int = 0, device: str = "auto", scores: bool = False) -> TopFeatures:
    """Load ``layer`` of ``dictionary`` under ``root`` (a folder or ``hf://OWNER/NAME``; -1: its last layer) and rank
    its features for a probe vector: row ``prompt`` of ``dataset`` (a path or repo), else a random vector drawn
    with ``seed``. Features are ranked by their activations under the layer's recorded rule, or by the raw scores
    W x + b with ``scores=True``."""
    t0 = time.perf_counter()
    dct = load_dictionary(SAEConfig(root_path=root, dictionary_name=dictionary, device=device))
    if layer < 0:  # -1: the dictionary's last layer, the one layer grammar of lmprobe
        try:
            layer = stored_layer(layer, dct.layers)
        except LayerNotFoundError as exc:
            raise DictionaryError(f"dictionary {dictionary!r}: {exc}") from None
    weights = dct.get_layer(layer)
    t_load = time.perf_counter() - t0
    if dataset:
        from ..opening import load  # datasets need numpy and pyarrow; the dictionary alone does not

        ds = load(dataset)
        if not 0 <= prompt < ds.num_prompts:
            raise InvalidArgumentError(f"prompt {prompt} is not in {dataset}: --prompt takes an index row, "
                                       f"0..{ds.num_prompts - 1}")
        vec = ds.hidden(ds.check_layer(layer), rows=[prompt])[0]
        what = f"prompt {prompt} of {dataset}: {ds.texts[prompt][:60]!r}"
    else:
        rng = random.Random(seed)
        vec = [rng.gauss(0.0, 1.0) for _ in range(weights.hidden_dim)]
        what = f"a random probe vector (seed {seed})"
    t1 = time.perf_counter()
    top = project_topk(weights, vec, k=k) if scores else encode_topk(weights, vec, k=k)
    summary = (f"{weights.feature_count} features x {weights.hidden_dim} dims, {weights.nnz} weights, activation "
               f"{describe(weights.activation)}, device {dct.device}")
    return TopFeatures(dictionary, layer, list(top), what, scores, summary, t_load, time.perf_counter() - t1)
