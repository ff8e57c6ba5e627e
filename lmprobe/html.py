"""Self-contained HTML: a page shell, escaped text, tokens coloured by a value, and small SVG charts.

Nothing here fetches anything at view time (no CDN scripts, fonts or images): a page written with
these helpers opens offline. Every string that comes from a dataset is escaped (``esc``), control
characters included, so a hostile prompt or token cannot inject markup.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

__all__ = ["bar_chart", "esc", "line_chart", "page", "table", "tokens_html"]

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2330;background:#fafbfc}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #e3e6ea;padding-bottom:4px}
.sub{color:#5b6472;margin:0 0 16px} table{border-collapse:collapse;margin:8px 0}
td,th{padding:3px 10px;border-bottom:1px solid #eceef1;text-align:left;vertical-align:top}
th{background:#f1f3f6;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
.charts{display:flex;flex-wrap:wrap;gap:18px} figure{margin:0;background:#fff;border:1px solid #e3e6ea;padding:8px}
figcaption{font-size:12px;color:#5b6472;max-width:420px}
.prompt{background:#fff;border:1px solid #e3e6ea;padding:10px;margin:10px 0}
.toks{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:13px;line-height:1.9;word-break:break-all}
.tok{border-radius:3px;padding:1px 1px;white-space:pre-wrap}
.tok.hit{outline:2px solid #c2185b;font-weight:700}
.meta{color:#5b6472;font-size:12px} .pred{font-family:ui-monospace,monospace;font-size:12px}
a{color:#1a5fb4} .legend{font-size:12px;color:#5b6472}
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
          raw: bool = False) -> str:
    """A table; numbers right-aligned. ``raw=True``: cells are already HTML."""
    out = [f'<table class="{"sortable" if sortable else ""}">']
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


def tokens_html(tokens: Sequence[str], values: Sequence[float | None], *, vmax: float | None = None,
                hue: str = "red", hit: int | None = None, titles: Sequence[str] | None = None) -> str:
    """Tokens as spans shaded by ``values`` (None: unshaded); ``hit`` outlines one token."""
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
        out.append(f'<span class="{cls}" title="{esc(title)}"{style}>{esc(tok)}</span>')
    return '<div class="toks">' + "".join(out) + "</div>"


def _frame(width: int, height: int, xs: Sequence[float], ys_all: Sequence[float], xlabel: str, ylabel: str):
    pad_l, pad_b, pad_t, pad_r = 52, 34, 10, 12
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(0.0, min(ys_all)), max(ys_all)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1

    def sx(x: float) -> float:
        return pad_l + (x - x0) / (x1 - x0) * (width - pad_l - pad_r)

    def sy(y: float) -> float:
        return height - pad_b - (y - y0) / (y1 - y0) * (height - pad_b - pad_t)

    axes = [f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width - pad_r}" y2="{height - pad_b}" stroke="#888"/>',
            f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{height - pad_b}" stroke="#888"/>']
    for k in range(5):
        y = y0 + (y1 - y0) * k / 4
        axes.append(f'<text x="{pad_l - 4}" y="{sy(y) + 4:.1f}" font-size="10" text-anchor="end">{_num(y)}</text>')
        axes.append(f'<line x1="{pad_l}" y1="{sy(y):.1f}" x2="{width - pad_r}" y2="{sy(y):.1f}" stroke="#eee"/>')
    ticks = sorted(set(xs)) if len(set(xs)) <= 12 else [x0 + (x1 - x0) * k / 6 for k in range(7)]
    for x in ticks:
        axes.append(f'<text x="{sx(x):.1f}" y="{height - pad_b + 14}" font-size="10" text-anchor="middle">'
                    f"{_num(x if not float(x).is_integer() else int(x))}</text>")
    axes.append(f'<text x="{(pad_l + width) / 2:.0f}" y="{height - 4}" font-size="11" text-anchor="middle">'
                f"{esc(xlabel)}</text>")
    axes.append(f'<text x="12" y="{height / 2:.0f}" font-size="11" text-anchor="middle" '
                f'transform="rotate(-90 12 {height / 2:.0f})">{esc(ylabel)}</text>')
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
        if len(series) > 1:
            parts.append(f'<text x="{width - 14}" y="{16 + 13 * i}" font-size="11" text-anchor="end" '
                         f'fill="{color}">{esc(name)}</text>')
    return _figure(title, caption, width, height, parts)


def bar_chart(labels: Sequence[str], values: Sequence[float], *, title: str, ylabel: str, caption: str = "",
              width: int = 440, height: int = 250, errors: Sequence[float] | None = None) -> str:
    """An inline SVG bar chart (with optional error bars)."""
    if not values:
        return ""
    n = len(values)
    top = max([float(v) + (float(errors[i]) if errors else 0.0) for i, v in enumerate(values)] + [0.0]) or 1.0
    pad_l, pad_b, pad_t = 52, 34, 10
    inner_w, inner_h = width - pad_l - 12, height - pad_b - pad_t
    bw = inner_w / n
    parts = [f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width - 12}" y2="{height - pad_b}" stroke="#888"/>']
    for k in range(5):
        y = top * k / 4
        py = height - pad_b - y / top * inner_h
        parts.append(f'<text x="{pad_l - 4}" y="{py + 4:.1f}" font-size="10" text-anchor="end">{_num(y)}</text>')
        parts.append(f'<line x1="{pad_l}" y1="{py:.1f}" x2="{width - 12}" y2="{py:.1f}" stroke="#eee"/>')
    for i, (lab, v) in enumerate(zip(labels, values, strict=True)):
        h = max(0.0, float(v)) / top * inner_h
        x = pad_l + i * bw + bw * 0.15
        parts.append(f'<rect x="{x:.1f}" y="{height - pad_b - h:.1f}" width="{bw * 0.7:.1f}" height="{h:.1f}" '
                     f'fill="#1f77b4"><title>{esc(lab)}: {_num(float(v))}</title></rect>')
        if errors:
            e = float(errors[i]) / top * inner_h
            cx, cy = x + bw * 0.35, height - pad_b - h
            parts.append(f'<line x1="{cx:.1f}" y1="{cy - e:.1f}" x2="{cx:.1f}" y2="{cy + e:.1f}" stroke="#333"/>')
        if n <= 24:
            parts.append(f'<text x="{x + bw * 0.35:.1f}" y="{height - pad_b + 14}" font-size="10" '
                         f'text-anchor="middle">{esc(str(lab)[:10])}</text>')
    parts.append(f'<text x="12" y="{height / 2:.0f}" font-size="11" text-anchor="middle" '
                 f'transform="rotate(-90 12 {height / 2:.0f})">{esc(ylabel)}</text>')
    return _figure(title, caption, width, height, parts)


def _figure(title: str, caption: str, width: int, height: int, parts: list[str]) -> str:
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{esc(title)}">{"".join(parts)}</svg>')
    cap = f"<figcaption><b>{esc(title)}</b>{' ' + esc(caption) if caption else ''}</figcaption>"
    return f'<figure class="chart">{svg}{cap}</figure>'
