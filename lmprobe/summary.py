"""A dataset's summary: the facts ``lmprobe info`` prints, the report and notebooks show.

Every value is read defensively: metadata of the wrong type is shown as such rather than
failing, and text from the dataset is escaped before it reaches a terminal (display.py).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from .display import escape_controls
from .format.reader import Dataset
from .units import format_size


def _get(d: Any, key: str, default: Any = None) -> Any:
    return d.get(key, default) if isinstance(d, dict) else default


def _layers_text(layers: list[int]) -> str:
    return str(layers) if len(layers) <= 12 else str(layers[:6])[:-1] + ", ..., " + str(layers[-1]) + "]"


def facts(ds: Dataset, *, path: str | None = None) -> list[tuple[str, str]]:
    """(label, value) pairs describing ``ds``, values escaped for display."""
    info = ds.info
    model = info.get("model")
    if isinstance(model, dict):
        model_text = f"{_get(model, 'name')} (revision {_get(model, 'revision') or 'unknown'})"
    else:
        model_text = f"(lmprobe:model is not an object: {model!r})"
    out = [
        ("dataset", path or ds.source),
        ("format", f"lmprobe {info.get('format_version')}"),
        ("model", model_text),
        ("prompts", f"{ds.num_prompts} ({info.get('prompt_ordering', '?')} order)"),
    ]
    labels = ds.labels
    if labels is not None:
        counts = collections.Counter(labels.tolist())
        shown = ", ".join(f"{k!r}: {v}" for k, v in sorted(counts.items(), key=lambda kv: str(kv[0]))[:10])
        out.append(("labels", f"{len(counts)} classes ({shown}{', ...' if len(counts) > 10 else ''})"))
    else:
        out.append(("labels", "none"))
    h = ds.meta.hidden
    if h is not None:
        out.append(("layers", f"{len(h.layers)}: {_layers_text(h.layers)}"))
        out.append(("hookpoints", ", ".join(ds.hookpoints)
                    + ("" if len(ds.hookpoints) == 1 else " (hidden_layers holds the first)")))
        shards = (f"{h.last_token_shards} last-token + {len(h.shards) - h.last_token_shards} sequence shards"
                  if h.storage == "full_sequence" else f"{len(h.shards)} shards per layer")
        out.append(("hidden", f"dim {h.dim}, {h.dtype}, {h.storage} ({shards})"))
        if h.storage == "full_sequence":
            out.append(("tokens", str(int(ds.token_lengths().sum()))))
    lg = ds.meta.logits
    if lg is not None:
        out.append(("logits", f"top-{lg.k} at the last token ({len(lg.shards)} shards)"))
    core = {"text", "label", "num_tokens", "shard_index", "row_offset"}
    extra = [c for c in ds.column_names if c not in core]
    out.append(("columns", ", ".join(extra) if extra else "(core columns only)"))
    prov = info.get("provenance")
    if isinstance(prov, dict):
        out.append(("made with", f"lmprobe {_get(prov, 'lmprobe_version')}, backend {_get(prov, 'extraction_backend')}, "
                                 f"torch {_get(prov, 'torch_version')}, transformers {_get(prov, 'transformers_version')}, "
                                 f"{_get(prov, 'created_at')}"))
    elif prov is not None:
        out.append(("made with", f"(lmprobe:provenance is not an object: {prov!r})"))
    if path is not None and Path(path).is_dir():
        size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
        out.append(("size", f"{format_size(size)} on disk"))
    return [(k, escape_controls(v, keep_newlines=False)) for k, v in out]


def text(ds: Dataset, *, path: str | None = None) -> str:
    """The summary as aligned text lines (``lmprobe info``)."""
    return "\n".join(f"{k:<12} {v}" for k, v in facts(ds, path=path))
