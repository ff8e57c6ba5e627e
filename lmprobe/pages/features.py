"""``lmprobe features``: an SAE dictionary run over every stored token, a feature cache, and a feature browser.

The cache (docs/features.md) is for any tool to read without lmprobe:

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
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..base.allocator import check_memory
from ..base.atomic import atomic_output, atomic_write
from ..base.display import escape_controls
from ..base.html import esc, filter_box, histogram_chart, page, percent, table, tokens_html
from ..base.lock import OutputLock
from ..base.paths import check_output_path
from ..base.progress import Progress, logger
from ..base.safeio import read_json
from ..base.units import parse_size
from ..errors import InvalidArgumentError, LmprobeError
from ..format.reader import Dataset
from ..opening import load
from ..sae.activation import activate, describe
from ..sae.loader import SAEConfig, dense_encoder, load_dictionary
from ..tensors import load_file, save_file
from .report import load_tokenizer_for

__all__ = ["FeatureCache", "features"]

CACHE_FILE = "features.safetensors"
MANIFEST_FILE = "manifest.json"
_PARTIAL = ".features-partial.safetensors"
_PARTIAL_STATE = ".features-partial.json"
CONTEXT_BEFORE, CONTEXT_AFTER = 12, 4
#: how far a context window may widen to start and end on whole words
_WORD_SLACK = 6
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


def features(dataset: Any, sae_root: str | os.PathLike, dictionary: str, layer: int, out: str | os.PathLike, *,
             top: int = 20, hookpoint: str | None = None, memory: int | str = "512MiB", pages: int | None = None,
             tokenizer: str | None = None, checkpoint_tokens: int = 1 << 20, overwrite: bool = False,
             report: str | os.PathLike | None = None, quiet: bool = False) -> Path:
    """Run dictionary ``dictionary`` (layer ``layer``) over every stored token and write the cache and browser to ``out``.

    ``pages`` limits the feature pages to the most frequent features (default: every feature that
    fired). ``report``: the dataset's ``lmprobe report`` page (a file or an http(s) URL), linked
    from every page. Returns ``out``.
    """
    ds = dataset if isinstance(dataset, Dataset) else load(dataset)
    if ds.storage != "full_sequence":
        raise InvalidArgumentError("lmprobe features needs every token: this dataset is pooled (extract with "
                                   "--storage full_sequence)")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgumentError(f"top must be a positive integer, got {top!r}")
    layer = ds.check_layer(layer, hookpoint)
    budget = parse_size(memory)
    report_href = _report_href(report, Path(out))
    out = check_output_path(out, "features folder")
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
    enc = _Encoder(W, b, weights.activation, weights.threshold)
    settings = {"dataset": ds.source, "dataset_identity": ds.identity, "num_prompts": ds.num_prompts,
                "dictionary": dictionary,
                "sae_root": os.fspath(sae_root), "layer": layer, "hookpoint": hookpoint or ds.hookpoints[0], "top": top,
                "features": int(W.shape[0]), "activation": weights.activation}
    out.mkdir(parents=True, exist_ok=True)
    lengths = ds.token_lengths()
    with OutputLock(out):
        t = _finished_cache(out, settings, lengths) if not overwrite else None
        if t is None:
            cache = _compute(ds, enc, settings, out, layer, hookpoint, budget, checkpoint_tokens, overwrite, quiet,
                             lengths)
            manifest = {**settings, "tokens": cache.tokens_seen, "file": CACHE_FILE,
                        "score": f"the feature's activation: W x + b of the dictionary's layer under its activation "
                                 f"rule, {describe(weights.activation)}; fires when > 0",
                        "top_token": "position of the token in its prompt (0-based)",
                        "top_prompt": "row of the dataset's index"}
            with atomic_output(out / CACHE_FILE) as tmp:
                save_file(cache.tensors(), tmp, metadata={"format": "np"})
            atomic_write(out / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")  # last: the cache is complete
            for name in (_PARTIAL, _PARTIAL_STATE):
                (out / name).unlink(missing_ok=True)
            t = load_file(out / CACHE_FILE)
        _browser(ds, enc, t, out, layer, hookpoint, settings, pages, load_tokenizer_for(ds, tokenizer), report_href)
    return out


class _Encoder:
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
    logger.warning(f"lmprobe features: {escape_controls(why, keep_newlines=False)}; computing it again")
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
    logger.warning(f"lmprobe features: {escape_controls(why, keep_newlines=False)}; starting over")
    return 0


def _compute(ds: Dataset, enc: _Encoder, settings: dict, out: Path, layer: int, hookpoint: str | None, budget: int,
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
            ids, offs, lens = ds.token_addresses(np.arange(p, q))
            prompt = np.repeat(np.arange(p, q), lens)
            token = np.arange(len(ids)) - np.repeat(np.cumsum(lens) - lens, lens)
            for a in range(0, len(ids), batch_tokens):  # a prompt longer than the batch goes in pieces
                x = np.asarray(ds.read_hidden_rows(layer, ids[a : a + batch_tokens], offs[a : a + batch_tokens],
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


def _report_href(report: str | os.PathLike | None, out: Path) -> str | None:
    """The link from ``out/index.html`` to the report: an http(s) URL as it is, a file relative to ``out``."""
    if report is None:
        return None
    text = os.fspath(report)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", text) and not re.match(r"^https?://", text):
        raise InvalidArgumentError(f"report must be a file or an http(s) URL, got {text!r}")
    if text.startswith(("http://", "https://")):
        return text
    path = Path(text)
    if path.is_dir():
        path = path / "index.html"
    if not path.is_file():
        raise InvalidArgumentError(f"report {text!r} does not exist (write it with `lmprobe report DATASET --out DIR`)")
    return Path(os.path.relpath(path.resolve(), out.resolve())).as_posix()


def _browser(ds: Dataset, enc: _Encoder, t: dict, out: Path, layer: int, hookpoint: str | None,
             settings: dict, pages: int | None, tok: Any, report_href: str | None = None) -> None:
    freq, maxv = t["frequency"], t["max_value"]
    fired = np.flatnonzero(freq > 0)
    order = fired[np.lexsort((fired, -freq[fired]))]
    shown = order if pages is None else order[: max(0, int(pages))]
    token_text = _TokenText(ds, tok)
    contexts = _contexts(ds, enc, t, shown, layer, hookpoint)
    (out / "feature").mkdir(exist_ok=True)
    rows = []
    for f in order.tolist():
        link = f'<a href="feature/{f}.html">{f}</a>' if f in contexts else str(f)
        p0, t0 = int(t["top_prompt"][f, 0]), int(t["top_token"][f, 0])
        top_tok = esc(token_text.tokens(p0)[t0]) if p0 >= 0 else ""
        rows.append((link, percent(freq[f]), f"{maxv[f]:.3g}", f"<code>{top_tok}</code>"))
    silent = len(freq) - len(fired)
    back = f' Back to the <a href="{esc(report_href)}">dataset report</a>.' if report_href else ""
    body = (f"<p>{len(freq):,} features of dictionary <b>{esc(settings['dictionary'])}</b>, layer {layer}, over "
            f"{_tokens_note(ds)}. {len(fired):,} fired at least once; {silent:,} never did.{back}</p>"
            + '<div class="charts">' + _density_chart(freq, silent) + "</div>"
            + filter_box("filter: feature number or top token")
            + '<p class="legend">Frequency: the share of stored tokens a feature fires on. Click a column to sort.</p>'
            + table(rows, ["feature", "frequency", "max activation", "top token"], sortable=True, raw=True))
    atomic_write(out / "index.html", page("Feature browser", body, subtitle=esc(ds.source)))
    hist, edges = t.get("histogram"), t.get("histogram_edges")
    if report_href and "://" not in report_href:
        report_href = "../" + report_href  # feature pages are one folder down
    back = f' · <a href="{esc(report_href)}">dataset report</a>' if report_href else ""
    for f, ctx in contexts.items():
        parts = [f'<p><a href="../index.html">all features</a>{back} · fires on {percent(freq[f])} of tokens · '
                 f"max activation {maxv[f]:.3g}</p>"]
        if hist is not None and edges is not None:
            parts.append('<div class="charts">' + _activation_chart(f, hist[f], edges) + "</div>")
        parts.append(f"<h2>Top contexts</h2>{_contexts_html(ctx, token_text, float(maxv[f]))}")
        atomic_write(out / "feature" / f"{f}.html", page(f"Feature {f}", "".join(parts),
                                                          subtitle=f"layer {layer} · {esc(settings['dictionary'])}"))


def _density_chart(freq: np.ndarray, silent: int) -> str:
    """How many features fire how often: a histogram of log10 frequency, 4 bins a decade."""
    fired = freq[freq > 0]
    if not len(fired):
        return ""
    lo = min(-0.25, math.floor(math.log10(fired.min()) * 4) / 4)
    edges = 10.0 ** np.arange(lo, 0.125, 0.25)  # up to 1: every token
    counts, _ = np.histogram(np.clip(fired, edges[0], 1.0), bins=edges)
    return histogram_chart(edges, counts.tolist(), title="Feature density", log_x=True, ylabel="features",
                           xlabel="share of tokens a feature fires on (log scale)",
                           caption=f"every feature that fired; {silent:,} never fired and are not shown")


def _activation_chart(f: int, counts: np.ndarray, edges: np.ndarray) -> str:
    """The feature's firing scores over every stored token, on the log bins they were counted in."""
    nz = np.flatnonzero(counts)
    if not len(nz):
        return ""
    a, z = int(nz[0]), int(nz[-1]) + 1
    while z - a < 4:  # at least one decade of axis
        a, z = max(0, a - 1), min(len(counts), z + 1)
    return histogram_chart(edges[a : z + 1], counts[a:z].tolist(), title="Activation histogram", log_x=True,
                           xlabel="activation (log scale)", ylabel="tokens",
                           caption=f"the activation of feature {f} on every stored token where it fired "
                           f"({int(counts.sum()):,} tokens)")


def _starts_word(tok: str) -> bool:
    """Whether a token begins a word (a space, punctuation or a special token before it), not continues one."""
    return not tok or not tok[0].isalnum()


def context_window(toks: list[str], pos: int, before: int = CONTEXT_BEFORE, after: int = CONTEXT_AFTER) -> tuple[int, int]:
    """Tokens [lo, hi) around ``pos``: ``before`` and ``after`` tokens, widened (a little) to whole words."""
    lo, hi = max(0, pos - before), min(len(toks), pos + after + 1)
    for _ in range(_WORD_SLACK):
        if lo == 0 or _starts_word(toks[lo]):
            break
        lo -= 1
    for _ in range(_WORD_SLACK):
        if hi >= len(toks) or _starts_word(toks[hi]):
            break
        hi += 1
    return lo, hi


def _contexts_html(ctx: list, token_text: _TokenText, vmax: float) -> str:
    """The top contexts, each cut at word boundaries with an ellipsis; identical ones shown once."""
    seen: dict[tuple, list] = {}
    for p, pos, value, acts in ctx:
        toks = token_text.tokens(p)
        lo, hi = context_window(toks, pos)
        key = (tuple(toks[lo:hi]), pos - lo, lo > 0, hi < len(toks))
        if key in seen:
            seen[key][1].append(p)
            continue
        shade = [float(a) if a > 0 else None for a in acts[lo:hi]]
        body = tokens_html(list(toks[lo:hi]), shade, vmax=vmax or None, hue="green", hit=pos - lo,
                           cut_before=lo > 0, cut_after=hi < len(toks))
        seen[key] = [(p, pos, value, body), []]
    out = []
    for (p, pos, value, body), same in seen.values():
        also = (f" · the same context in prompt{'s' if len(same) > 1 else ''} {', '.join(map(str, same))}"
                if same else "")
        out.append(f'<div class="prompt"><div class="meta">prompt {p}, token {pos}: <b>{value:.3g}</b>{also}</div>'
                   f"{body}</div>")
    return "".join(out)


def _tokens_note(ds: Dataset) -> str:
    return f"{int(ds.token_lengths().sum()):,} stored tokens of {ds.num_prompts:,} prompts"


def _contexts(ds: Dataset, enc: _Encoder, t: dict, shown: np.ndarray, layer: int,
              hookpoint: str | None) -> dict[int, list]:
    """For each shown feature, its top contexts with the feature's activation at every token of the prompt.

    Each prompt is read once, whatever the number of features that list it.
    """
    need: dict[int, list[int]] = {}
    for f in shown.tolist():
        for p in set(t["top_prompt"][f][t["top_prompt"][f] >= 0].tolist()):
            need.setdefault(p, []).append(f)
    scores: dict[tuple[int, int], np.ndarray] = {}
    for p, feats in sorted(need.items()):
        x = np.asarray(ds.token_hidden(p, layer, hookpoint=hookpoint), dtype=np.float32)
        s = enc(x)[:, feats]  # (tokens, len(feats)): a top-k rule needs every feature's score
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

