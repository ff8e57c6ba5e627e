"""``lmprobe features``: the feature browser, a page per feature over the SAE feature cache (``lmprobe.sae.features``:
the top tokens of every feature, computed once and resumed after an interruption).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..base.atomic import atomic_write
from ..base.html import esc, filter_box, histogram_chart, page, percent, table, tokens_html
from ..base.lock import OutputLock
from ..base.paths import check_output_path
from ..errors import InvalidArgumentError
from ..format.reader import Dataset
from ..opening import load
from ..sae.features import (
    Encoder,
    FeatureCache,
    build_cache,
    plan_cache,
)
from .report import load_tokenizer_for

__all__ = ["FeatureCache", "features"]

CONTEXT_BEFORE, CONTEXT_AFTER = 12, 4
#: how far a context window may widen to start and end on whole words
_WORD_SLACK = 6


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
    report_href = _report_href(report, Path(out))
    out = check_output_path(out, "features folder")
    job = plan_cache(ds, sae_root, dictionary, layer, top=top, hookpoint=hookpoint, memory=memory)
    out.mkdir(parents=True, exist_ok=True)
    with OutputLock(out):
        t = build_cache(job, out, checkpoint_tokens=checkpoint_tokens, overwrite=overwrite, quiet=quiet)
        _browser(ds, job.enc, t, out, job.layer, hookpoint, job.settings, pages, load_tokenizer_for(ds, tokenizer),
                 report_href)
    return out


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


def _browser(ds: Dataset, enc: Encoder, t: dict, out: Path, layer: int, hookpoint: str | None,
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


def _contexts(ds: Dataset, enc: Encoder, t: dict, shown: np.ndarray, layer: int,
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

