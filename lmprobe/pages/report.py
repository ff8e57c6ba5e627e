"""``lmprobe report``: one self-contained HTML page about a dataset, made from what it stores.

The page holds the dataset card's facts, per-layer plots from the stored statistics (mean norm,
the spread of the per-dimension std), norm by token position for full_sequence data, a sample of
prompts as tokens coloured by per-token perplexity with the model's top-k next-token
predictions, the label balance and, when labels exist, the probe sweep. Plots are inline SVG:
the page needs no network access to be viewed. Only what the page shows is read (from the Hub or
object storage, only those files are fetched).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..base.atomic import atomic_write
from ..base.html import bar_chart, esc, line_chart, page, table
from ..base.paths import check_output_path
from ..base.tokenizer import resolve_tokenizer
from ..base.units import plural
from ..errors import FormatError, InvalidArgumentError
from ..format.reader import Dataset
from ..opening import load
from ..probe import has_sklearn, sweep
from .summary import is_corpus

__all__ = ["load_tokenizer_for", "report"]

#: prompts whose token norms make the position plot (read from the stored vectors)
_POSITION_PROMPTS = 64
_MAX_POSITIONS = 256


def load_tokenizer_for(ds: Dataset, tokenizer: str | None = None) -> Any:
    """The tokenizer that decodes the dataset's token ids: ``tokenizer`` (a folder or Hub id; an error when it
    cannot be loaded), else the dataset's model's when it can be loaded (``resolve_tokenizer``); None when it
    cannot (ids are then shown as ``#id``)."""
    if tokenizer:
        return resolve_tokenizer(tokenizer, need="--tokenizer")
    return resolve_tokenizer(ds.model.get("name"), ds.model.get("revision"))


def _parse_rows(prompts: Any, n: int) -> list[int]:
    if prompts is None:
        return []
    items = [x.strip() for x in prompts.split(",")] if isinstance(prompts, str) else list(prompts)
    out = []
    for x in items:
        try:
            i = int(x)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"--prompts takes row numbers like 3,17; got {x!r}") from None
        if not -n <= i < n:
            raise InvalidArgumentError(f"prompt {i} does not exist: the dataset has {n} prompts (0..{n - 1})")
        out.append(i % n)
    return out


def report(dataset: Any, out: str | os.PathLike, *, prompts: Any = None, sample: int = 8,
           tokenizer: str | None = None, probe: bool = True, seed: int = 0, quiet: bool = False) -> Path:
    """Write ``out/index.html`` about ``dataset`` (a Dataset, a folder, a Hub repo or an fsspec URL).

    ``prompts`` (``"3,17"`` or a list) are shown besides ``sample`` prompts drawn with ``seed``;
    ``tokenizer`` decodes token ids when the dataset stores no token strings (default: the
    dataset's model, when it loads here). ``probe=False`` skips the probe sweep. The report prints
    nothing (``quiet`` is accepted for symmetry with ``features``); the caller says where it wrote.
    """
    ds = dataset if isinstance(dataset, Dataset) else load(dataset)
    chosen = _parse_rows(prompts, ds.num_prompts)  # bad input fails before any work
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 0:
        raise InvalidArgumentError(f"sample must be a non-negative integer, got {sample!r}")
    out = check_output_path(out, "report folder")
    tok = load_tokenizer_for(ds, tokenizer)
    rng = np.random.default_rng(seed)
    rest = [i for i in rng.permutation(ds.num_prompts)[: sample + len(chosen)].tolist() if i not in chosen]
    rows = chosen + sorted(rest[: sample])

    sections = [_facts(ds), _plots(ds), _prompts(ds, rows, tok)]
    labels = _labels(ds, probe)
    if labels:
        sections.append(labels)
    model = ds.model.get("name") or "dataset"
    html = page(f"lmprobe report: {model}", "".join(sections),
                subtitle=f"{plural(ds.num_prompts, _row_noun(ds))} · {esc(ds.files)}")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "index.html", html)
    return out / "index.html"


def _row_noun(ds: Dataset) -> str:
    """What a row is: a window of a document (corpus extraction), as ``lmprobe info`` says, or a prompt."""
    return "window" if is_corpus(ds) else "prompt"


def _facts(ds: Dataset) -> str:
    info, h = ds.info, ds.meta.hidden
    prov = info.get("provenance") or {}
    model = ds.model
    lengths = ds.token_lengths()
    size = sum(f.bytes or 0 for f in ds.meta.files())
    noun = _row_noun(ds)
    rows = [("model", model.get("name")), ("revision", model.get("revision") or "(none recorded)"),
            (f"{noun}s", f"{ds.num_prompts:,}"),
            ("stored tokens", f"{int(lengths.sum()):,}" if h and h.storage == "full_sequence"
             else f"{int(lengths.sum()):,} (last token stored per {noun})")]
    if h is not None:
        here = ds.default_layers()
        layers = ", ".join(map(str, h.layers))
        if len(here) < len(h.layers):  # a `lmprobe pull --layers` copy: the page shows what it holds
            layers = (f"{', '.join(map(str, here))} of {layers} (a partial copy; `lmprobe pull "
                      f"{ds.files.origin or 'REPO'} --layers L` fetches more)")
        rows += [("layers", layers), ("hookpoints", ", ".join(ds.hookpoints)),
                 ("dim", f"{h.dim:,}"), ("dtype", h.dtype), ("storage", h.storage)]
    if ds.meta.logits is not None:
        rows.append(("top-k logits", str(ds.meta.logits.k)))
    rows.append(("size of the data files", f"{size / 2**20:,.1f} MiB"))
    for key in ("lmprobe_version", "extraction_backend", "torch_version", "transformers_version", "created_at"):
        if prov.get(key) is not None:
            rows.append((key.replace("_", " "), str(prov[key])))
    # every value as text, left-aligned alike (numbers were right-aligned beside left-aligned text)
    return "<h2>Dataset</h2>" + table(rows, cls="facts")


def _plots(ds: Dataset) -> str:
    charts = []
    st = ds.meta.statistics
    if st is not None and ds.meta.hidden is not None:
        norm_series, spread_series, bands = {}, {}, {}
        for hp in ds.hookpoints:
            layers, norms, med, lo, hi = [], [], [], [], []
            for layer in ds.layers:
                try:
                    s = ds.statistics(layer, hookpoint=None if hp == ds.hookpoints[0] else hp)
                except (FormatError, LookupError):
                    continue
                layers.append(layer)
                norms.append(float(s["mean_norm"]))
                std = np.asarray(s["std"], dtype=np.float64)
                q = np.percentile(std, [5, 50, 95]) if std.size else [math.nan] * 3
                lo.append(float(q[0]))
                med.append(float(q[1]))
                hi.append(float(q[2]))
            if layers:
                norm_series[hp] = (layers, norms)
                spread_series[hp] = (layers, med)
                bands[hp] = (lo, hi)
        one_layer = bool(norm_series) and all(len(ls) == 1 for ls, _ in norm_series.values())
        if one_layer:  # a line chart would be one dot in an empty frame: the numbers, as a table
            layer = next(iter(norm_series.values()))[0][0]
            stats = [(hp, f"{norm_series[hp][1][0]:.4g}", f"{spread_series[hp][1][0]:.4g}",
                      f"{bands[hp][0][0]:.4g} to {bands[hp][1][0]:.4g}") for hp in norm_series]
            head = ["hookpoint", "mean L2 norm", "median std", "std, 5th to 95th percentile"]
            charts.append(f'<figure class="chart">{table(stats, head, cls="facts")}<figcaption><b>Statistics of layer '
                          f"{layer}</b> over every stored vector (one layer is stored: nothing to plot by layer)"
                          "</figcaption></figure>")
        elif norm_series:
            charts.append(line_chart(norm_series, title="Mean L2 norm by layer", xlabel="layer", ylabel="mean norm",
                                     caption="over every stored vector (stored statistics)"))
            charts.append(line_chart(spread_series, bands=bands, title="Per-dimension std by layer", xlabel="layer",
                                     ylabel="std", caption="median dimension; the band spans the 5th to 95th "
                                     "percentile of the dimensions' std"))
    if ds.storage == "full_sequence" and ds.num_prompts:
        charts.append(_position_chart(ds))
    if not charts:
        return "<h2>Activations</h2><p>No statistics are stored (extracted with --no-statistics).</p>"
    return '<h2>Activations</h2><div class="charts">' + "".join(c for c in charts if c) + "</div>"


def _position_chart(ds: Dataset) -> str:
    """Mean norm by token position over a sample of prompts, for the first, middle and last layer."""
    rows = np.random.default_rng(0).permutation(ds.num_prompts)[:_POSITION_PROMPTS]
    here = ds.default_layers()  # a partial copy: the layers it holds
    if not here:
        return ""
    layers = sorted({here[0], here[len(here) // 2], here[-1]})
    ids, offs, lengths = ds.shards.token_addresses(rows)
    pos = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    keep = pos < _MAX_POSITIONS
    series = {}
    for layer in layers:
        x = np.asarray(ds.shards.read_hidden_rows(layer, ids[keep], offs[keep]), dtype=np.float32)
        norms = np.linalg.norm(x, axis=1)
        p = pos[keep]
        sums = np.bincount(p, weights=norms)
        counts = np.bincount(p)
        valid = counts > 0
        series[f"layer {layer}"] = (np.flatnonzero(valid).tolist(), (sums[valid] / counts[valid]).tolist())
    return line_chart(series, title="Norm by token position", xlabel="token position", ylabel="mean norm",
                      caption=f"mean over {plural(len(rows), _row_noun(ds))}; outsized first tokens are attention "
                      "sinks")


def _prompts(ds: Dataset, rows: list[int], tok: Any) -> str:
    if not rows:
        return ""
    views = [ds.prompt(i, tokenizer=tok) for i in rows]
    logs = [math.log(p) for v in views for p in (v.token_perplexity or []) if p and math.isfinite(p) and p > 0]
    vmax = float(np.percentile(logs, 95)) if logs else None
    note = ("Tokens are shaded by log per-token perplexity (darker: more surprising to the model; the first "
            "token has no prediction). Hover a token for its value.")
    if not any(v.token_perplexity for v in views):
        note = "This dataset stores no per-token perplexity (extract with --perplexity to colour the tokens)."
    return (f'<h2>{_row_noun(ds).capitalize()}s</h2><p class="legend">{note}</p>'
            + "".join(v.html(vmax=vmax) for v in views))


def _labels(ds: Dataset, probe: bool) -> str:
    labels = ds.labels
    if labels is None:
        return ""
    values, counts = np.unique(np.asarray([str(x) for x in labels]), return_counts=True)
    parts = [bar_chart([str(v) for v in values], counts.tolist(), title="Label balance", ylabel="prompts")]
    if probe and len(values) >= 2 and counts.min() >= 2:
        folds = min(5, int(counts.min()))
        method = "logistic" if has_sklearn() else "mass_mean"  # mass-mean needs numpy alone
        t = sweep(ds, cv=folds, method=method, baselines=True)
        what = "logistic regression" if method == "logistic" else "mass-mean probes"
        parts.append(bar_chart([str(x) for x in t["layer"]], t["accuracy"].tolist(),
                               errors=t["accuracy_std"].tolist(), title="Probe accuracy by layer", wide=True,
                               ylabel="accuracy", caption=f"{folds}-fold cross-validated {what} "
                               "on the last-token vectors: the mean accuracy over the folds, the line spans "
                               f"one standard deviation (lmprobe probe --cv {folds} --method {method})"))
        best = t.loc[t["accuracy"].idxmax()]
        base = float(best["accuracy"] - best["over_baseline"])
        verdict = "beats every baseline" if best["beats_baselines"] else "beats no baseline: it shows nothing yet"
        parts.append(f'<p class="legend">Best probe: layer {esc(str(best["layer"]))}, accuracy '
                     f'{best["accuracy"]:.3f} &plusmn; {best["accuracy_std"]:.3f}; best baseline '
                     f'{esc(str(best["best_baseline"]))} {base:.3f} on the same folds. The probe {verdict} '
                     f'(lmprobe probe --baselines).</p>')
        if not has_sklearn():
            parts.append('<p class="legend">Install lmprobe[probe] for logistic probes and the text baselines.</p>')
    return '<h2>Labels</h2><div class="charts">' + "".join(parts) + "</div>"
