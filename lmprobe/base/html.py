"""Self-contained HTML: a page shell, escaped text, tokens coloured by a value, and small SVG charts.

Nothing here fetches anything at view time (no CDN scripts, fonts or images): a page written with
these helpers opens offline. Every string that comes from a dataset is escaped (``esc``), control
characters included, so a hostile prompt or token cannot inject markup.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

__all__ = ["bar_chart", "esc", "filter_box", "histogram_chart", "line_chart", "nice_ticks", "page", "percent", "table",
           "tokens_html", "visible_whitespace"]

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2330;background:#fafbfc}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #e3e6ea;padding-bottom:4px}
.sub{color:#5b6472;margin:0 0 16px} table{border-collapse:collapse;margin:8px 0}
td,th{padding:3px 10px;border-bottom:1px solid #eceef1;text-align:left;vertical-align:top}
th{background:#f1f3f6;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:18px}
figure.span2{grid-column:span 2} figure.histogram{grid-column:1/-1} @media(max-width:700px){figure.span2{grid-column:auto}}
figure{margin:0;background:#fff;border:1px solid #e3e6ea;padding:8px} figure svg{width:100%;height:auto;max-height:360px;display:block}
figcaption{font-size:12px;color:#5b6472} .ell{color:#8a93a0} .filter{font:inherit;padding:4px 8px;width:320px}
.prompt{background:#fff;border:1px solid #e3e6ea;padding:10px;margin:10px 0}
.toks{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:13px;line-height:1.9}
.tok{border-radius:3px;padding:1px 1px;white-space:pre}
.tok.hit{outline:2px solid #c2185b;font-weight:700}
.meta{color:#5b6472;font-size:12px} .pred{font-family:ui-monospace,monospace;font-size:12px}
a{color:#1a5fb4} .legend{font-size:12px;color:#5b6472}
.keys{font-size:12px;margin:2px 0 4px} .key{margin-right:14px;white-space:nowrap}
.key i{display:inline-block;width:14px;height:3px;margin:0 5px 3px 0;vertical-align:middle}
table.facts td{text-align:left}
"""

#: marks the page as rendered, and records script errors where a test (or a person) can see them
_SCRIPT = """
window.addEventListener('error',function(e){document.body.dataset.errors=(document.body.dataset.errors||'')+e.message+';'});
document.addEventListener('DOMContentLoaded',function(){
  document.querySelectorAll('table.sortable th').forEach(function(th,i){th.style.cursor='pointer';
    th.addEventListener('click',function(){var tb=th.closest('table').tBodies[0];
      var rows=Array.from(tb.rows),asc=th.dataset.asc!=='1';th.dataset.asc=asc?'1':'0';
      rows.sort(function(a,b){var x=a.cells[i].dataset.v||a.cells[i].textContent,y=b.cells[i].dataset.v||b.cells[i].textContent;
        var p=parseFloat(x),q=parseFloat(y);var c=(isNaN(p)||isNaN(q))?x.localeCompare(y):p-q;return asc?c:-c;});
      rows.forEach(function(r){tb.appendChild(r)});});});
  var box=document.getElementById('filter');
  if(box){var apply=function(){var q=box.value.trim().toLowerCase(),n=0;
      document.querySelectorAll('table.sortable tbody tr').forEach(function(r){
        var id=r.cells[0].textContent.trim(),show=!q||(/^[0-9]+$/.test(q)?id===q:r.textContent.toLowerCase().indexOf(q)>=0);
        r.style.display=show?'':'none';if(show)n++;});
      document.getElementById('filter-count').textContent=q?n+' shown':'';};
    box.addEventListener('input',apply);
    var m=/[#&]q=([^&]*)/.exec(location.hash);if(m){box.value=decodeURIComponent(m[1]);apply();}}
  document.body.dataset.rendered='ok';});
"""


def esc(value: object) -> str:
    """Text for HTML: markup escaped, control characters shown as escapes (never interpreted)."""
    s = str(value)
    s = "".join(ch if ch in "\t\n" or (ord(ch) >= 32 and ord(ch) != 127) else f"\\x{ord(ch):02x}" for ch in s)
    return html.escape(s, quote=True)


def page(title: str, body: str, *, subtitle: str = "") -> str:
    """A whole page: inline style and script, nothing fetched."""
    sub = f'<p class="sub">{subtitle}</p>' if subtitle else ""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><title>{esc(title)}</title>'
            f"<style>{_STYLE}</style><script>{_SCRIPT}</script></head>"
            f"<body><main><h1>{esc(title)}</h1>{sub}{body}</main></body></html>\n")


def table(rows: Sequence[Sequence[object]], header: Sequence[str] | None = None, *, sortable: bool = False,
          raw: bool = False, cls: str = "") -> str:
    """A table; numbers right-aligned. ``raw=True``: cells are already HTML. ``cls="facts"``: label and value
    pairs, every cell left-aligned (pass values as text)."""
    out = [f'<table class="{" ".join(c for c in ("sortable" if sortable else "", cls) if c)}">']
    if header:
        out.append("<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr></thead>")
    out.append("<tbody>")
    for row in rows:
        cells = []
        for v in row:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                cells.append(f'<td class="num" data-v="{v}">{_num(v)}</td>')
            else:
                cells.append(f"<td>{v if raw else esc(v)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _num(v: float) -> str:
    if isinstance(v, int):
        return f"{v:,}"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"


#: how a whitespace character shows where it would otherwise be invisible (a token of spaces, a top-k entry)
WHITESPACE_MARKS = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5"}  # ␣ ↵ ⇥


def visible_whitespace(text: str, *, keep_breaks: bool = False) -> str:
    r"""``text`` with its spaces, newlines and tabs drawn as ␣, ↵ and ⇥ (``keep_breaks``: a newline also still
    breaks the line after its mark), so that a whitespace token is seen, not an empty box.

    >>> visible_whitespace(" a\n")
    '␣a↵'
    """
    return "".join(WHITESPACE_MARKS.get(c, c) + ("\n" if keep_breaks and c == "\n" else "") for c in text)


def tokens_html(tokens: Sequence[str], values: Sequence[float | None], *, vmax: float | None = None,
                hue: str = "red", hit: int | None = None, titles: Sequence[str] | None = None,
                cut_before: bool = False, cut_after: bool = False) -> str:
    """Tokens as spans shaded by ``values`` (None: unshaded); ``hit`` outlines one token.

    A line wraps between two tokens, never inside one (``<wbr>`` between the spans, each kept whole); a token of
    whitespace alone shows its marks (``visible_whitespace``). ``cut_before``/``cut_after``: the tokens are an
    excerpt; an ellipsis shows the text goes on.
    """
    finite = [v for v in values if v is not None and math.isfinite(v)]
    top = vmax if vmax is not None else (max(finite) if finite else 1.0)
    top = top if top > 0 else 1.0
    rgb = {"red": (214, 39, 40), "blue": (31, 119, 180), "green": (44, 160, 44)}[hue]
    out = []
    for i, tok in enumerate(tokens):
        v = values[i] if i < len(values) else None
        style = ""
        if v is not None and math.isfinite(v) and v > 0:
            a = min(1.0, v / top) * 0.85
            style = f' style="background:rgba({rgb[0]},{rgb[1]},{rgb[2]},{a:.3f})"'
        title = titles[i] if titles is not None else ("" if v is None else f"{v:.4g}")
        cls = "tok hit" if hit == i else "tok"
        shown = visible_whitespace(tok, keep_breaks=True) if tok and not tok.strip() else tok
        out.append(f'<span class="{cls}" title="{esc(title)}"{style}>{esc(shown)}</span>')
    lead = '<span class="ell">… </span>' if cut_before else ""
    trail = '<span class="ell"> …</span>' if cut_after else ""
    return '<div class="toks">' + lead + "<wbr>".join(out) + trail + "</div>"


def nice_ticks(lo: float, hi: float, *, n: int = 6, integer: bool = False) -> list[float]:
    """Round tick values covering [lo, hi]: a step of 1, 2 or 5 times a power of ten, about ``n`` ticks.

    ``integer``: the step is a whole number (token positions, layers, counts).

    >>> nice_ticks(0, 65.87)
    [0.0, 20.0, 40.0, 60.0, 80.0]
    >>> nice_ticks(0, 0.987)
    [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    """
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    if integer:
        step = max(1.0, round(step))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [float(round(k * step, 12)) for k in range(first, last + 1)]


def tick_label(v: float, step: float) -> str:
    """A tick value with as many decimals as its step needs: 0.25, 20, 1,000."""
    if v == 0:
        return "0"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0
    if decimals > 6:
        return f"{v:.1e}"
    return f"{v:,.{decimals}f}"


def percent(fraction: float) -> str:
    """A fraction as a percentage to 2 significant digits: 82%, 5.3%, 0.041%."""
    v = float(fraction) * 100
    if v == 0 or not math.isfinite(v):
        return f"{v:g}%"
    if v >= 10:
        return f"{v:.0f}%"
    if v < 1e-4:
        return f"{v:.1e}%"
    return f"{float(f'{v:.2g}'):g}%"


#: plot margins: left (y tick labels), bottom (x ticks and label), top, right
_PAD_L, _PAD_B, _PAD_T, _PAD_R = 56, 38, 12, 14


def _y_grid(yt: Sequence[float], sy, width: int) -> list[str]:
    """Labelled round y ticks at ``sy(y)``, each with a light grid line across the plot."""
    step = yt[1] - yt[0] if len(yt) > 1 else 1.0
    out = []
    for y in yt:
        out.append(f'<text class="ytick" x="{_PAD_L - 4}" y="{sy(y) + 4:.1f}" font-size="12" text-anchor="end">'
                   f"{tick_label(y, step)}</text>")
        out.append(f'<line x1="{_PAD_L}" y1="{sy(y):.1f}" x2="{width - _PAD_R}" y2="{sy(y):.1f}" stroke="#eee"/>')
    return out


def _axis_labels(width: int, height: int, xlabel: str | None, ylabel: str) -> list[str]:
    out = [f'<text x="12" y="{height / 2:.0f}" font-size="13" text-anchor="middle" '
           f'transform="rotate(-90 12 {height / 2:.0f})">{esc(ylabel)}</text>']
    if xlabel:
        out.append(f'<text x="{(_PAD_L + width) / 2:.0f}" y="{height - 4}" font-size="13" text-anchor="middle">'
                   f"{esc(xlabel)}</text>")
    return out


def _frame(width: int, height: int, xs: Sequence[float], ys_all: Sequence[float], xlabel: str, ylabel: str):
    """Axes with round ticks; x ticks are every x when there are few (layers), round ones otherwise."""
    x0, x1 = min(xs), max(xs)
    integer_x = all(float(x).is_integer() for x in xs)
    yt = nice_ticks(min(0.0, min(ys_all)), max(ys_all))
    y0, y1 = yt[0], yt[-1]
    if x1 == x0:
        x1 = x0 + 1

    def sx(x: float) -> float:
        return _PAD_L + (x - x0) / (x1 - x0) * (width - _PAD_L - _PAD_R)

    def sy(y: float) -> float:
        return height - _PAD_B - (y - y0) / (y1 - y0) * (height - _PAD_B - _PAD_T)

    axes = [f'<line x1="{_PAD_L}" y1="{height - _PAD_B}" x2="{width - _PAD_R}" y2="{height - _PAD_B}" stroke="#888"/>',
            f'<line x1="{_PAD_L}" y1="{_PAD_T}" x2="{_PAD_L}" y2="{height - _PAD_B}" stroke="#888"/>']
    axes += _y_grid(yt, sy, width)
    if len(set(xs)) <= 12:
        xt = sorted(set(xs))
        xstep = 1.0 if integer_x else min((b - a for a, b in zip(xt, xt[1:], strict=False)), default=1.0)
    else:
        xt = [x for x in nice_ticks(x0, x1, n=7, integer=integer_x) if x0 <= x <= x1]
        xstep = xt[1] - xt[0] if len(xt) > 1 else 1.0
    for x in xt:
        axes.append(f'<text class="xtick" x="{sx(x):.1f}" y="{height - _PAD_B + 14}" font-size="12" '
                    f'text-anchor="middle">{tick_label(x, xstep)}</text>')
    axes += _axis_labels(width, height, xlabel, ylabel)
    return sx, sy, "".join(axes)


_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")


def line_chart(series: dict[str, tuple[Sequence[float], Sequence[float]]], *, title: str, xlabel: str,
               ylabel: str, caption: str = "", width: int = 440, height: int = 250,
               bands: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None) -> str:
    """An inline SVG line chart: ``series[name] = (xs, ys)``; ``bands[name] = (lows, highs)`` shade a range."""
    xs_all = [float(x) for xs, _ in series.values() for x in xs]
    ys_all = [float(y) for _, ys in series.values() for y in ys if math.isfinite(y)]
    for lo, hi in (bands or {}).values():
        ys_all += [float(v) for v in list(lo) + list(hi) if math.isfinite(v)]
    if not xs_all or not ys_all:
        return ""
    sx, sy, axes = _frame(width, height, xs_all, ys_all, xlabel, ylabel)
    parts = [axes]
    for i, (name, (xs, ys)) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        if bands and name in bands:
            lo, hi = bands[name]
            pts = [f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, hi, strict=True)]
            pts += [f"{sx(x):.1f},{sy(y):.1f}" for x, y in reversed(list(zip(xs, lo, strict=True)))]
            parts.append(f'<polygon points="{" ".join(pts)}" fill="{color}" fill-opacity="0.15" stroke="none"/>')
        pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys, strict=True) if math.isfinite(y))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in zip(xs, ys, strict=True):
            if math.isfinite(y) and len(xs) <= 64:
                parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}">'
                             f"<title>{esc(name)}: x={_num(x)}, y={_num(y)}</title></circle>")
    # the key goes below the plot, never over its lines (in the corner it covered them)
    key = "".join(f'<span class="key"><i style="background:{_COLORS[i % len(_COLORS)]}"></i>{esc(name)}</span>'
                  for i, name in enumerate(series)) if len(series) > 1 else ""
    return _figure(title, caption, width, height, parts, key=key)


def bar_chart(labels: Sequence[str], values: Sequence[float], *, title: str, ylabel: str, caption: str = "",
              width: int = 440, height: int = 250, errors: Sequence[float] | None = None, wide: bool = False) -> str:
    """An inline SVG bar chart (with optional error bars); ``wide``: twice as wide, over two grid columns."""
    if wide:
        width *= 2
    if not values:
        return ""
    n = len(values)
    peak = max([float(v) + (float(errors[i]) if errors else 0.0) for i, v in enumerate(values)] + [0.0]) or 1.0
    integer = all(float(v).is_integer() for v in values) and not errors
    yt = nice_ticks(0.0, peak, integer=integer)
    top = yt[-1]
    inner_w, inner_h = width - _PAD_L - _PAD_R, height - _PAD_B - _PAD_T
    bw = inner_w / n
    parts = [f'<line x1="{_PAD_L}" y1="{height - _PAD_B}" x2="{width - _PAD_R}" y2="{height - _PAD_B}" stroke="#888"/>']
    parts += _y_grid(yt, lambda y: height - _PAD_B - y / top * inner_h, width)
    for i, (lab, v) in enumerate(zip(labels, values, strict=True)):
        h = max(0.0, float(v)) / top * inner_h
        x = _PAD_L + i * bw + bw * 0.15
        parts.append(f'<rect x="{x:.1f}" y="{height - _PAD_B - h:.1f}" width="{bw * 0.7:.1f}" height="{h:.1f}" '
                     f'fill="#1f77b4"><title>{esc(lab)}: {_num(float(v))}</title></rect>')
        if errors:
            e = float(errors[i]) / top * inner_h
            cx, cy = x + bw * 0.35, height - _PAD_B - h
            parts.append(f'<line x1="{cx:.1f}" y1="{cy - e:.1f}" x2="{cx:.1f}" y2="{cy + e:.1f}" stroke="#333"/>')
        if n <= 24:
            parts.append(f'<text x="{x + bw * 0.35:.1f}" y="{height - _PAD_B + 14}" font-size="12" '
                         f'text-anchor="middle">{esc(str(lab)[:10])}</text>')
    parts += _axis_labels(width, height, None, ylabel)
    return _figure(title, caption, width, height, parts, cls="chart span2" if wide else "chart")


def histogram_chart(edges: Sequence[float], counts: Sequence[int], *, title: str, xlabel: str, ylabel: str,
                    caption: str = "", log_x: bool = False, width: int = 880, height: int = 200) -> str:
    """An inline SVG histogram: ``counts[i]`` between ``edges[i]`` and ``edges[i + 1]`` (``log_x``: a log axis)."""
    if len(counts) == 0 or max(counts) <= 0:
        return ""
    f = math.log10 if log_x else float
    lo, hi = f(edges[0]), f(edges[-1])
    inner_w, inner_h = width - _PAD_L - _PAD_R, height - _PAD_B - _PAD_T
    yt = nice_ticks(0.0, float(max(counts)), n=5, integer=True)
    top = yt[-1]

    def sx(v: float) -> float:
        return _PAD_L + (f(v) - lo) / (hi - lo) * inner_w

    parts = [f'<line x1="{_PAD_L}" y1="{height - _PAD_B}" x2="{width - _PAD_R}" y2="{height - _PAD_B}" stroke="#888"/>']
    parts += _y_grid(yt, lambda y: height - _PAD_B - y / top * inner_h, width)
    for i, c in enumerate(counts):
        if c <= 0:
            continue
        x0, x1 = sx(edges[i]), sx(edges[i + 1])
        h = c / top * inner_h
        parts.append(f'<rect class="bin" x="{x0 + 0.5:.1f}" y="{height - _PAD_B - h:.1f}" width="{max(1.0, x1 - x0 - 1):.1f}" '
                     f'height="{h:.1f}" fill="#2ca02c"><title>{_num(float(edges[i]))} to {_num(float(edges[i + 1]))}: '
                     f"{int(c):,}</title></rect>")
    if log_x:
        mults = (1, 2, 5) if hi - lo <= 2.5 else (1,)
        xt = [m * 10.0**d for d in range(math.floor(lo), math.ceil(hi) + 1) for m in mults]
        xt = [x for x in xt if lo - 1e-9 <= math.log10(x) <= hi + 1e-9]
        labels = [tick_label(x, x) for x in xt]
    else:
        xt = [x for x in nice_ticks(edges[0], edges[-1]) if edges[0] <= x <= edges[-1]]
        labels = [tick_label(x, xt[1] - xt[0] if len(xt) > 1 else 1.0) for x in xt]
    for x, label in zip(xt, labels, strict=True):
        parts.append(f'<text class="xtick" x="{sx(x):.1f}" y="{height - _PAD_B + 14}" font-size="12" '
                     f'text-anchor="middle">{label}</text>')
    parts += _axis_labels(width, height, xlabel, ylabel)
    return _figure(title, caption, width, height, parts, cls="chart histogram")


def filter_box(placeholder: str) -> str:
    """A search box that hides the rows of the page's sortable table that do not match (``#q=TEXT`` pre-fills it)."""
    return (f'<p><input id="filter" class="filter" type="search" placeholder="{esc(placeholder)}" '
            f'aria-label="{esc(placeholder)}"> <span id="filter-count" class="legend"></span></p>')


def _figure(title: str, caption: str, width: int, height: int, parts: list[str], *, cls: str = "chart",
            key: str = "") -> str:
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{esc(title)}">{"".join(parts)}</svg>')
    keys = f'<div class="keys">{key}</div>' if key else ""
    cap = f"<figcaption><b>{esc(title)}</b>{' ' + esc(caption) if caption else ''}</figcaption>"
    return f'<figure class="{cls}">{svg}{keys}{cap}</figure>'

