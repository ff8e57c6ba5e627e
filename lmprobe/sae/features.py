"""The SAE feature cache: a dictionary run over every stored token, the top-N tokens of every feature.

The cache (docs/features.md) is for any tool to read without lmprobe (``lmprobe.pages.features`` draws the browser
over it):

- ``features.safetensors``: ``top_values`` (features x N float32, descending), ``top_prompt`` and
  ``top_token`` (features x N int64: the prompt's index row and the token's position in it; -1
  where the feature fired fewer than N times, with value 0), ``frequency`` (features float64: the
  fraction of stored tokens on which the feature fires) and ``max_value`` (features float32);
- ``manifest.json``: the dataset, dictionary, layer, hookpoint, activation rule, N, token count and
  what the values are.

Values are the SAE's feature activations: the dictionary's scores ``W x + b`` under the layer's
recorded activation rule (lmprobe.sae.activation: relu, top-k, JumpReLU, ...), as
``lmprobe.sae.encode`` and ``lmprobe sae-topk`` give them; a feature *fires* on a token when its
activation is above zero, so a top-k SAE fires k features per token. Tokens are read prompt after prompt in batches sized by
``memory``; the running top-N is merged batch by batch, so memory does not grow with the dataset.
A checkpoint every ``checkpoint_tokens`` tokens lets an interrupted run resume where it stopped.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..base.allocator import check_memory
from ..base.atomic import atomic_output, atomic_write
from ..base.display import escape_controls
from ..base.progress import Progress
from ..base.safeio import read_json
from ..base.units import parse_size
from ..errors import InvalidArgumentError, LmprobeError
from ..format.reader import Dataset
from ..tensors import load_file, save_file
from .activation import activate, describe
from .loader import SAEConfig, dense_encoder, load_dictionary

logger = logging.getLogger(__name__)

__all__ = ["CacheJob", "Encoder", "FeatureCache", "build_cache", "plan_cache"]

CACHE_FILE = "features.safetensors"
MANIFEST_FILE = "manifest.json"
_PARTIAL = ".features-partial.safetensors"
_PARTIAL_STATE = ".features-partial.json"
#: the activation histogram's bin edges: 4 bins a decade from 1e-4 to 1e4 (scores outside go to the end bins)
HIST_EDGES = 10.0 ** np.linspace(-4, 4, 33)




class FeatureCache:
    """The running top-N of every feature over the tokens seen so far (pure arithmetic, no I/O)."""

    def __init__(self, n_features: int, top: int):
        self.top = top
        self.values = np.full((n_features, top), -np.inf, dtype=np.float32)
        self.prompt = np.full((n_features, top), -1, dtype=np.int64)
        self.token = np.full((n_features, top), -1, dtype=np.int64)
        self.fired = np.zeros(n_features, dtype=np.int64)
        self.max_value = np.full(n_features, -np.inf, dtype=np.float32)
        self.hist = np.zeros((n_features, len(HIST_EDGES) - 1), dtype=np.int64)
        self.tokens_seen = 0

    def add(self, scores: np.ndarray, prompt: np.ndarray, token: np.ndarray) -> None:
        """Merge a batch: ``scores`` (tokens, features) activations, each token's prompt row and position."""
        n = len(scores)
        if n == 0:
            return
        self.tokens_seen += n
        fires = scores > 0
        self.fired += fires.sum(axis=0)
        self.max_value = np.maximum(self.max_value, scores.max(axis=0))
        self._add_histogram(scores, fires)
        k = min(self.top, n)
        cand = np.argpartition(-scores, k - 1, axis=0)[:k] if k < n else np.broadcast_to(
            np.arange(n)[:, None], scores.shape)  # (k, features): rows of each feature's best tokens
        vals = np.take_along_axis(scores, cand, axis=0).T  # (features, k)
        vals = np.where(vals > 0, vals, -np.inf).astype(np.float32)  # only firing tokens are kept
        all_v = np.concatenate([self.values, vals], axis=1)
        all_p = np.concatenate([self.prompt, prompt[cand].T], axis=1)
        all_t = np.concatenate([self.token, token[cand].T], axis=1)
        # value descending, then earlier prompt and token first: the same result however batches fall
        order = np.lexsort((all_t, all_p, -all_v), axis=1)[:, : self.top]
        self.values = np.take_along_axis(all_v, order, axis=1)
        self.prompt = np.take_along_axis(all_p, order, axis=1)
        self.token = np.take_along_axis(all_t, order, axis=1)
        empty = ~np.isfinite(self.values)
        self.prompt[empty] = -1
        self.token[empty] = -1

    def _add_histogram(self, scores: np.ndarray, fires: np.ndarray) -> None:
        """Count each firing activation in its feature's log-spaced bin (HIST_EDGES).

        Rows go in slices of ~4M scores: the index arrays of the firing ones stay small beside the batch.
        """
        n_bins = self.hist.shape[1]
        step = max(1, (1 << 22) // max(1, scores.shape[1]))
        for a in range(0, len(scores), step):
            tok, feat = np.nonzero(fires[a : a + step])
            b = np.clip(np.searchsorted(HIST_EDGES, scores[a + tok, feat], side="right") - 1, 0, n_bins - 1)
            self.hist += np.bincount(feat * n_bins + b, minlength=self.hist.size).reshape(self.hist.shape)

    def tensors(self) -> dict[str, np.ndarray]:
        values = np.where(np.isfinite(self.values), self.values, 0).astype(np.float32)
        freq = self.fired / max(self.tokens_seen, 1)
        return {"top_values": values, "top_prompt": self.prompt.copy(), "top_token": self.token.copy(),
                "frequency": freq.astype(np.float64),
                "max_value": np.where(np.isfinite(self.max_value), self.max_value, 0).astype(np.float32),
                "histogram": self.hist.copy(), "histogram_edges": HIST_EDGES.copy()}

    def state(self) -> dict[str, np.ndarray]:
        return {"values": self.values, "prompt": self.prompt, "token": self.token, "fired": self.fired,
                "max_value": self.max_value, "hist": self.hist, "tokens_seen": np.array([self.tokens_seen], dtype=np.int64)}

    def restore(self, t: dict[str, np.ndarray], tokens_seen: int) -> None:
        """Take a checkpoint's state (untrusted: every array's dtype and shape is checked, and its token count
        must be ``tokens_seen``, the tokens of the prompts before the checkpoint); ValueError if it is not."""
        for name in ("values", "prompt", "token", "fired", "max_value", "hist"):
            want = getattr(self, name)
            if name not in t or t[name].shape != want.shape or t[name].dtype != want.dtype:
                raise ValueError(f"{name!r} is missing or not {want.dtype} {want.shape}")
        seen = t.get("tokens_seen")
        if seen is None or seen.shape != (1,) or seen.dtype != np.int64 or int(seen[0]) != tokens_seen:
            raise ValueError(f"it counts {None if seen is None else seen.tolist()} tokens, not {tokens_seen}")
        if (t["fired"] < 0).any() or (t["fired"] > tokens_seen).any() or (t["hist"] < 0).any():
            raise ValueError("its counts are out of range")
        for name in ("values", "prompt", "token", "fired", "max_value", "hist"):
            setattr(self, name, t[name].copy())
        self.tokens_seen = tokens_seen


@dataclass
class CacheJob:
    """A feature-cache run, checked before anything is read: the dataset, the layer's encoder and the settings the
    cache records (a finished cache with other settings is another run's)."""

    ds: Dataset
    layer: int
    hookpoint: str | None
    enc: Encoder
    settings: dict
    budget: int


def plan_cache(ds: Dataset, sae_root: str | os.PathLike, dictionary: str, layer: int, *, top: int = 20,
               hookpoint: str | None = None, memory: int | str = "512MiB") -> CacheJob:
    """Check the run (a full_sequence dataset, ``top``, the layer, the dictionary's width, memory) before any
    token is read."""
    if ds.storage != "full_sequence":
        raise InvalidArgumentError("lmprobe features needs every token: this dataset is pooled (extract with "
                                   "--storage full_sequence)")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgumentError(f"top must be a positive integer, got {top!r}")
    layer = ds.check_layer(layer, hookpoint)
    budget = parse_size(memory)
    dct = load_dictionary(SAEConfig(root_path=sae_root, dictionary_name=dictionary, device="cpu", cache_layers=1))
    weights = dct.get_layer(layer)
    W = dense_encoder(weights)  # (features, dim) float32
    # the running top-N of every feature (values, prompts, positions; twice while a batch merges) and its histogram
    check_memory(W.shape[0] * (top * 20 * 2 + (len(HIST_EDGES) - 1) * 8 + 12),
                 f"--top {top} over {W.shape[0]} features", fix="lower --top (top=)")
    if W.shape[1] != ds.hidden_desc(hookpoint).dim:
        raise InvalidArgumentError(f"dictionary {dictionary!r} layer {layer} reads {W.shape[1]}-dim vectors; the "
                                   f"dataset stores {ds.hidden_desc(hookpoint).dim}")
    b = np.zeros(W.shape[0], np.float32) if weights.bias is None else np.asarray(weights.bias, dtype=np.float32)
    enc = Encoder(W, b, weights.activation, weights.threshold)
    settings = {"dataset": ds.source, "dataset_identity": ds.identity, "num_prompts": ds.num_prompts,
                "dictionary": dictionary,
                "sae_root": os.fspath(sae_root), "layer": layer, "hookpoint": hookpoint or ds.hookpoints[0], "top": top,
                "features": int(W.shape[0]), "activation": weights.activation}
    return CacheJob(ds, layer, hookpoint, enc, settings, budget)


def build_cache(job: CacheJob, out: Path, *, checkpoint_tokens: int = 1 << 20, overwrite: bool = False,
                quiet: bool = False) -> dict[str, np.ndarray]:
    """The cache's tensors in ``out`` (a finished one of this run, else computed, resuming from a checkpoint); the
    caller holds ``out``'s lock."""
    ds, layer, hookpoint, enc, settings, budget = job.ds, job.layer, job.hookpoint, job.enc, job.settings, job.budget
    weights_activation = settings["activation"]
    lengths = ds.token_lengths()
    t = _finished_cache(out, settings, lengths) if not overwrite else None
    if t is None:
        cache = _compute(ds, enc, settings, out, layer, hookpoint, budget, checkpoint_tokens, overwrite, quiet,
                         lengths)
        manifest = {**settings, "tokens": cache.tokens_seen, "file": CACHE_FILE,
                    "score": f"the feature's activation: W x + b of the dictionary's layer under its activation "
                             f"rule, {describe(weights_activation)}; fires when > 0",
                    "top_token": "position of the token in its prompt (0-based)",
                    "top_prompt": "row of the dataset's index"}
        with atomic_output(out / CACHE_FILE) as tmp:
            save_file(cache.tensors(), tmp, metadata={"format": "np"})
        atomic_write(out / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")  # last: the cache is complete
        for name in (_PARTIAL, _PARTIAL_STATE):
            (out / name).unlink(missing_ok=True)
        t = load_file(out / CACHE_FILE)
    return t


class Encoder:
    """The layer's activations of a batch of vectors: ``W x + b`` under its rule."""

    def __init__(self, W: np.ndarray, b: np.ndarray, rule: dict, threshold: np.ndarray | None):
        self.W, self.b, self.rule, self.threshold = W, b, rule, threshold

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """(tokens, features) activations of ``x`` (tokens, dim)."""
        return activate(self.rule, x @ self.W.T + self.b, self.threshold)


def _finished_cache(out: Path, settings: dict, lengths: np.ndarray) -> dict[str, np.ndarray] | None:
    """The complete cache in ``out`` if it is this run's and whole (None: compute it); an error if it is
    another run's. Cache and manifest are untrusted: a damaged one is said and computed again."""
    if not (out / MANIFEST_FILE).exists():
        return None
    try:
        done = read_json(out / MANIFEST_FILE, what="feature manifest")
    except LmprobeError as exc:
        return _again(f"{out / MANIFEST_FILE} is damaged ({exc})")
    if not isinstance(done, dict) or "features" not in done:
        return _again(f"{out / MANIFEST_FILE} is not a feature manifest")
    if {k: done.get(k) for k in settings} != settings:
        raise InvalidArgumentError(f"{out} holds a feature cache made with other settings; pass --overwrite "
                                   "(overwrite=True) or choose another --out")
    if done.get("tokens") != int(lengths.sum()):
        return _again(f"{out / MANIFEST_FILE} counts {done.get('tokens')!r:.20} tokens, the dataset holds "
                      f"{int(lengths.sum())}")
    try:
        t = load_file(out / CACHE_FILE)
    except Exception as exc:  # noqa: BLE001 - unreadable for any reason: computed again
        return _again(f"{out / CACHE_FILE} cannot be read ({type(exc).__name__})")
    problem = _cache_problem(t, settings["features"], settings["top"], lengths)
    return _again(f"{out / CACHE_FILE} is damaged: {problem}") if problem else t


def _again(why: str) -> None:
    logger.warning("lmprobe features: %s; computing it again", escape_controls(why, keep_newlines=False))
    return None


def _cache_problem(t: dict, n_features: int, top: int, lengths: np.ndarray) -> str | None:
    """What is wrong with a loaded feature cache (its tensors, dtypes, shapes and index ranges), or None."""
    want = {"top_values": ("float32", (n_features, top)), "top_prompt": ("int64", (n_features, top)),
            "top_token": ("int64", (n_features, top)), "frequency": ("float64", (n_features,)),
            "max_value": ("float32", (n_features,)), "histogram": ("int64", (n_features, len(HIST_EDGES) - 1)),
            "histogram_edges": ("float64", (len(HIST_EDGES),))}
    for name, (dtype, shape) in want.items():
        a = t.get(name)
        if a is None or str(a.dtype) != dtype or a.shape != shape:
            return f"{name!r} is missing or not {dtype} {list(shape)}"
    prompt, token = t["top_prompt"], t["top_token"]
    if (prompt < -1).any() or (prompt >= len(lengths)).any():
        return "top_prompt names a prompt outside the dataset"
    hit = prompt >= 0
    if (token[~hit] != -1).any() or (token[hit] < 0).any() or (token[hit] >= lengths[prompt[hit]]).any():
        return "top_token names a position outside its prompt"
    if not np.array_equal(t["histogram_edges"], HIST_EDGES) or not ((t["frequency"] >= 0) & (t["frequency"] <= 1)).all():
        return "its histogram edges or frequencies are out of range"
    return None


def _resume(cache: FeatureCache, out: Path, settings: dict, lengths: np.ndarray) -> int:
    """The first prompt still to read after a checkpoint in ``out`` (its state restored into ``cache``), or 0:
    a state of another run, or a damaged one, is said and the run starts over."""
    try:
        st = read_json(out / _PARTIAL_STATE, what="partial feature state")
    except LmprobeError as exc:
        return _over(f"{out / _PARTIAL_STATE} is damaged ({exc})")
    if not isinstance(st, dict):
        return _over(f"{out / _PARTIAL_STATE} is not a checkpoint state")
    if st.get("settings") != settings:
        return 0  # another run's checkpoint (other settings, another dataset): not this run's to resume
    start = st.get("next_prompt")
    if isinstance(start, bool) or not isinstance(start, int) or not 0 < start < len(lengths):
        return _over(f"{out / _PARTIAL_STATE}: next_prompt {start!r:.20} is not a prompt of the dataset")
    try:
        cache.restore(load_file(out / _PARTIAL), int(lengths[:start].sum()))
    except Exception as exc:  # noqa: BLE001 - unreadable or inconsistent: start over
        return _over(f"{out / _PARTIAL} does not match its state ({type(exc).__name__}: {exc})")
    return start


def _over(why: str) -> int:
    logger.warning("lmprobe features: %s; starting over", escape_controls(why, keep_newlines=False))
    return 0


def _compute(ds: Dataset, enc: Encoder, settings: dict, out: Path, layer: int, hookpoint: str | None, budget: int,
             checkpoint_tokens: int, overwrite: bool, quiet: bool, lengths: np.ndarray) -> FeatureCache:
    W = enc.W
    n_features = W.shape[0]
    cache = FeatureCache(n_features, settings["top"])
    start = 0
    state_path = out / _PARTIAL_STATE
    if state_path.exists() and not overwrite:
        start = _resume(cache, out, settings, lengths)
    # a batch's scores (tokens x features float32) and its vectors fit the budget
    per_token = 4 * (n_features + W.shape[1]) * 5  # scores, activations, a top-k rule's int64 selection
    batch_tokens = max(1, budget // per_token)
    bar = Progress(int(lengths.sum()), initial=int(lengths[:start].sum()), desc="features", unit="tok", quiet=quiet)
    since = 0
    p = start
    try:
        while p < ds.num_prompts:
            q, n = p, 0
            while q < ds.num_prompts and (n == 0 or n + lengths[q] <= batch_tokens):
                n += int(lengths[q])
                q += 1
            ids, offs, lens = ds.shards.token_addresses(np.arange(p, q))
            prompt = np.repeat(np.arange(p, q), lens)
            token = np.arange(len(ids)) - np.repeat(np.cumsum(lens) - lens, lens)
            for a in range(0, len(ids), batch_tokens):  # a prompt longer than the batch goes in pieces
                x = np.asarray(ds.shards.read_hidden_rows(layer, ids[a : a + batch_tokens], offs[a : a + batch_tokens],
                                                   hookpoint=hookpoint), dtype=np.float32)
                cache.add(enc(x), prompt[a : a + batch_tokens], token[a : a + batch_tokens])
            bar.update(len(ids))
            since += len(ids)
            p = q
            if since >= checkpoint_tokens and p < ds.num_prompts:
                with atomic_output(out / _PARTIAL) as tmp:
                    save_file(cache.state(), tmp)
                atomic_write(state_path, json.dumps({"settings": settings, "next_prompt": p}))
                since = 0
    finally:
        bar.close()
    return cache


