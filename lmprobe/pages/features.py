"""``lmprobe features``: an SAE dictionary run over every stored token, a feature cache, and a feature browser.

The cache (docs/features.md) is for any tool to read without lmprobe:

- ``features.safetensors``: ``top_values`` (features x N float32, descending), ``top_prompt`` and
  ``top_token`` (features x N int64: the prompt's index row and the token's position in it; -1
  where the feature fired fewer than N times, with value 0), ``frequency`` (features float64: the
  fraction of stored tokens whose score is above zero) and ``max_value`` (features float32);
- ``manifest.json``: the dataset, dictionary, layer, hookpoint, N, token count and what the score is.

Scores are the dictionary's own (``W x + b``, what ``lmprobe sae-topk`` ranks); a feature *fires* on
a token when its score is above zero. Tokens are read prompt after prompt in batches sized by
``memory``; the running top-N is merged batch by batch, so memory does not grow with the dataset.
A checkpoint every ``checkpoint_tokens`` tokens lets an interrupted run resume where it stopped.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_output, atomic_write
from ..errors import InvalidArgumentError
from ..format.reader import Dataset
from ..html import esc, page, table, tokens_html
from ..lock import OutputLock
from ..opening import load
from ..paths import check_output_path
from ..sae.loader import SAEConfig, dense_encoder, load_dictionary
from ..safeio import read_json
from ..tensors import load_file, save_file
from ..units import parse_size
from .report import load_tokenizer_for

__all__ = ["FeatureCache", "features"]

CACHE_FILE = "features.safetensors"
MANIFEST_FILE = "manifest.json"
_PARTIAL = ".features-partial.safetensors"
_PARTIAL_STATE = ".features-partial.json"
CONTEXT_BEFORE, CONTEXT_AFTER = 12, 4


class FeatureCache:
    """The running top-N of every feature over the tokens seen so far (pure arithmetic, no I/O)."""

    def __init__(self, n_features: int, top: int):
        self.top = top
        self.values = np.full((n_features, top), -np.inf, dtype=np.float32)
        self.prompt = np.full((n_features, top), -1, dtype=np.int64)
        self.token = np.full((n_features, top), -1, dtype=np.int64)
        self.fired = np.zeros(n_features, dtype=np.int64)
        self.max_value = np.full(n_features, -np.inf, dtype=np.float32)
        self.tokens_seen = 0

    def add(self, scores: np.ndarray, prompt: np.ndarray, token: np.ndarray) -> None:
        """Merge a batch: ``scores`` (tokens, features), each token's prompt row and position."""
        n = len(scores)
        if n == 0:
            return
        self.tokens_seen += n
        fires = scores > 0
        self.fired += fires.sum(axis=0)
        self.max_value = np.maximum(self.max_value, scores.max(axis=0))
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

    def tensors(self) -> dict[str, np.ndarray]:
        values = np.where(np.isfinite(self.values), self.values, 0).astype(np.float32)
        freq = self.fired / max(self.tokens_seen, 1)
        return {"top_values": values, "top_prompt": self.prompt.copy(), "top_token": self.token.copy(),
                "frequency": freq.astype(np.float64),
                "max_value": np.where(np.isfinite(self.max_value), self.max_value, 0).astype(np.float32)}

    def state(self) -> dict[str, np.ndarray]:
        return {"values": self.values, "prompt": self.prompt, "token": self.token, "fired": self.fired,
                "max_value": self.max_value, "tokens_seen": np.array([self.tokens_seen], dtype=np.int64)}

    def restore(self, t: dict[str, np.ndarray]) -> None:
        for name in ("values", "prompt", "token", "fired", "max_value"):
            if t[name].shape != getattr(self, name).shape:
                raise InvalidArgumentError("the partial feature cache does not match this run; pass overwrite=True")
            setattr(self, name, t[name].copy())
        self.tokens_seen = int(t["tokens_seen"][0])


def features(dataset: Any, sae_root: str | os.PathLike, dictionary: str, layer: int, out: str | os.PathLike, *,
             top: int = 20, hookpoint: str | None = None, memory: int | str = "512MiB", pages: int | None = None,
             tokenizer: str | None = None, checkpoint_tokens: int = 1 << 20, overwrite: bool = False,
             quiet: bool = False) -> Path:
    """Run dictionary ``dictionary`` (layer ``layer``) over every stored token and write the cache and browser to ``out``.

    ``pages`` limits the feature pages to the most frequent features (default: every feature that
    fired). Returns ``out``.
    """
    ds = dataset if isinstance(dataset, Dataset) else load(dataset)
    if ds.storage != "full_sequence":
        raise InvalidArgumentError("lmprobe features needs every token: this dataset is pooled (extract with "
                                   "--storage full_sequence)")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgumentError(f"top must be a positive integer, got {top!r}")
    layer = ds.check_layer(layer, hookpoint)
    budget = parse_size(memory)
    out = check_output_path(out, "features folder")
    dct = load_dictionary(SAEConfig(root_path=sae_root, dictionary_name=dictionary, device="cpu", cache_layers=1))
    weights = dct.get_layer(layer)
    W = dense_encoder(weights)  # (features, dim) float32
    if W.shape[1] != ds.hidden_desc(hookpoint).dim:
        raise InvalidArgumentError(f"dictionary {dictionary!r} layer {layer} reads {W.shape[1]}-dim vectors; the "
                                   f"dataset stores {ds.hidden_desc(hookpoint).dim}")
    b = np.zeros(W.shape[0], np.float32) if weights.bias is None else np.asarray(weights.bias, dtype=np.float32)
    settings = {"dataset": ds.source, "num_prompts": ds.num_prompts, "dictionary": dictionary,
                "sae_root": os.fspath(sae_root), "layer": layer, "hookpoint": hookpoint or ds.hookpoints[0], "top": top,
                "features": int(W.shape[0])}
    out.mkdir(parents=True, exist_ok=True)
    with OutputLock(out):
        if (out / MANIFEST_FILE).exists() and not overwrite:
            done = read_json(out / MANIFEST_FILE, what="feature manifest")
            if {k: done.get(k) for k in settings} != settings:
                raise InvalidArgumentError(f"{out} holds a feature cache made with other settings; pass "
                                           "overwrite=True (--overwrite) or choose another --out")
        else:
            cache = _compute(ds, W, b, settings, out, layer, hookpoint, budget, checkpoint_tokens, overwrite, quiet)
            manifest = {**settings, "tokens": cache.tokens_seen, "file": CACHE_FILE,
                        "score": "W x + b of the dictionary's layer (lmprobe sae-topk's score); fires when > 0",
                        "top_token": "position of the token in its prompt (0-based)",
                        "top_prompt": "row of the dataset's index"}
            with atomic_output(out / CACHE_FILE) as tmp:
                save_file(cache.tensors(), tmp, metadata={"format": "np"})
            atomic_write(out / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")  # last: the cache is complete
            for name in (_PARTIAL, _PARTIAL_STATE):
                (out / name).unlink(missing_ok=True)
        t = load_file(out / CACHE_FILE)
        _browser(ds, W, b, t, out, layer, hookpoint, settings, pages, load_tokenizer_for(ds, tokenizer))
    return out


def _compute(ds: Dataset, W: np.ndarray, b: np.ndarray, settings: dict, out: Path, layer: int,
             hookpoint: str | None, budget: int, checkpoint_tokens: int, overwrite: bool, quiet: bool) -> FeatureCache:
    n_features = W.shape[0]
    cache = FeatureCache(n_features, settings["top"])
    start = 0
    state_path = out / _PARTIAL_STATE
    if state_path.exists() and not overwrite:
        st = read_json(state_path, what="partial feature state")
        if st.get("settings") == settings and (out / _PARTIAL).exists():
            cache.restore(load_file(out / _PARTIAL))
            start = int(st["next_prompt"])
    # a batch's scores (tokens x features float32) and its vectors fit the budget
    per_token = 4 * (n_features + W.shape[1]) * 3
    batch_tokens = max(1, budget // per_token)
    lengths = ds.token_lengths()
    from tqdm.auto import tqdm

    bar = tqdm(total=int(lengths.sum()), initial=int(lengths[:start].sum()), unit="tok", desc="features",
               disable=quiet or not sys.stderr.isatty())
    since = 0
    p = start
    try:
        while p < ds.num_prompts:
            q, n = p, 0
            while q < ds.num_prompts and (n == 0 or n + lengths[q] <= batch_tokens):
                n += int(lengths[q])
                q += 1
            ids, offs, lens = ds.token_addresses(np.arange(p, q))
            prompt = np.repeat(np.arange(p, q), lens)
            token = np.arange(len(ids)) - np.repeat(np.cumsum(lens) - lens, lens)
            for a in range(0, len(ids), batch_tokens):  # a prompt longer than the batch goes in pieces
                x = np.asarray(ds.read_hidden_rows(layer, ids[a : a + batch_tokens], offs[a : a + batch_tokens],
                                                   hookpoint=hookpoint), dtype=np.float32)
                cache.add(x @ W.T + b, prompt[a : a + batch_tokens], token[a : a + batch_tokens])
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


def _browser(ds: Dataset, W: np.ndarray, b: np.ndarray, t: dict, out: Path, layer: int, hookpoint: str | None,
             settings: dict, pages: int | None, tok: Any) -> None:
    freq, maxv = t["frequency"], t["max_value"]
    fired = np.flatnonzero(freq > 0)
    order = fired[np.lexsort((fired, -freq[fired]))]
    shown = order if pages is None else order[: max(0, int(pages))]
    token_text = _TokenText(ds, tok)
    contexts = _contexts(ds, W, b, t, shown, layer, hookpoint)
    (out / "feature").mkdir(exist_ok=True)
    rows = []
    for f in order.tolist():
        link = f'<a href="feature/{f}.html">{f}</a>' if f in contexts else str(f)
        p0, t0 = int(t["top_prompt"][f, 0]), int(t["top_token"][f, 0])
        top_tok = esc(token_text.tokens(p0)[t0]) if p0 >= 0 else ""
        rows.append((link, f'<span data-v="{freq[f]}">{freq[f]:.4%}</span>', f'<span data-v="{maxv[f]}">'
                     f"{maxv[f]:.4g}</span>", f"<code>{top_tok}</code>"))
    silent = len(freq) - len(fired)
    body = (f"<p>{len(freq):,} features of dictionary <b>{esc(settings['dictionary'])}</b>, layer {layer}, over "
            f"{_tokens_note(ds)}. "
            f"{len(fired):,} fired at least once; {silent:,} never did. Click a column to sort.</p>"
            + table(rows, ["feature", "frequency", "max activation", "top token"], sortable=True, raw=True))
    atomic_write(out / "index.html", page("Feature browser", body, subtitle=esc(ds.source)))
    for f, ctx in contexts.items():
        parts = [f'<p><a href="../index.html">all features</a> · frequency {freq[f]:.4%} · max activation '
                 f"{maxv[f]:.4g}</p>"]
        for (p, pos, value, acts) in ctx:
            toks = token_text.tokens(p)
            lo, hi = max(0, pos - CONTEXT_BEFORE), min(len(toks), pos + CONTEXT_AFTER + 1)
            shade = [float(a) if a > 0 else None for a in acts[lo:hi]]
            parts.append(f'<div class="prompt"><div class="meta">prompt {p}, token {pos}: <b>{value:.4g}</b></div>'
                         + tokens_html(toks[lo:hi], shade, vmax=float(maxv[f]) or None, hue="green", hit=pos - lo)
                         + "</div>")
        atomic_write(out / "feature" / f"{f}.html", page(f"Feature {f}", "".join(parts),
                                                          subtitle=f"layer {layer} · {esc(settings['dictionary'])}"))


def _tokens_note(ds: Dataset) -> str:
    return f"{int(ds.token_lengths().sum()):,} stored tokens of {ds.num_prompts:,} prompts"


def _contexts(ds: Dataset, W: np.ndarray, b: np.ndarray, t: dict, shown: np.ndarray, layer: int,
              hookpoint: str | None) -> dict[int, list]:
    """For each shown feature, its top contexts with the feature's score at every token of the prompt.

    Each prompt is read once, whatever the number of features that list it.
    """
    need: dict[int, list[int]] = {}
    for f in shown.tolist():
        for p in set(t["top_prompt"][f][t["top_prompt"][f] >= 0].tolist()):
            need.setdefault(p, []).append(f)
    scores: dict[tuple[int, int], np.ndarray] = {}
    for p, feats in sorted(need.items()):
        x = np.asarray(ds.token_hidden(p, layer, hookpoint=hookpoint), dtype=np.float32)
        s = x @ W[feats].T + b[feats]  # (tokens, len(feats))
        for j, f in enumerate(feats):
            scores[(p, f)] = s[:, j]
    out: dict[int, list] = {}
    for f in shown.tolist():
        ctx = []
        for p, pos, v in zip(t["top_prompt"][f].tolist(), t["top_token"][f].tolist(), t["top_values"][f].tolist(),
                             strict=True):
            if p >= 0:
                ctx.append((p, pos, v, scores[(p, f)]))
        out[f] = ctx
    return out


class _TokenText:
    """Each prompt's token strings: stored, decoded from stored ids, or ``#position`` as a last resort."""

    def __init__(self, ds: Dataset, tok: Any):
        self.ds, self.tok = ds, tok
        self.cache: dict[int, list[str]] = {}

    def tokens(self, p: int) -> list[str]:
        if p not in self.cache:
            view = self.ds.prompt(p, tokenizer=self.tok)
            toks = view.token_strings()
            if len(toks) != view.num_tokens:
                toks = [f"[{i}]" for i in range(view.num_tokens)]
            self.cache[p] = toks
        return self.cache[p]

