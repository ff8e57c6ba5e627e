"""A dataset's summary: the facts ``lmprobe info`` prints, the report and notebooks show.

Every value is read defensively: metadata of the wrong type is shown as such rather than
failing, and text from the dataset is escaped before it reaches a terminal (display.py).
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

from ..base.display import escape_controls
from ..base.units import format_size, plural
from ..format.metadata import recorded_attachments
from ..format.reader import Dataset
from ..format.spec import RESERVED_COLUMNS
from ..sae.activation import describe as describe_activation
from ..sae.loader import SAEConfig, is_dictionary_folder, load_dictionary
from ..saev import SaevDataset, is_saev_folder

#: what the stored (non-addressing) reserved columns hold, in the order they are listed
_STORED = {"token_ids": "token ids", "token_strings": "token strings", "token_perplexity": "per-token perplexity",
           "perplexity_mean": "perplexity (mean, min, max)", "document": "document and window_start of each window"}


def _get(d: Any, key: str, default: Any = None) -> Any:
    return d.get(key, default) if isinstance(d, dict) else default


def _layers_text(layers: list[int]) -> str:
    return str(layers) if len(layers) <= 12 else str(layers[:6])[:-1] + ", ..., " + str(layers[-1]) + "]"


def _layers_fact(ds: Dataset) -> str:
    h = ds.meta.hidden
    text = f"{len(h.layers)}: {_layers_text(h.layers)}"
    here = ds.layers_here()
    if len(here) == len(h.layers):
        return text
    origin = ds.files.origin or "REPO"
    held = f"only {_layers_text(here)}" if here else "none of them"
    return (f"{text} in the dataset; this copy holds {held} (`lmprobe pull {origin} --layers L --out {ds.files}` "
            "fetches more)")


def is_corpus(ds: Dataset) -> bool:
    """Whether the rows are windows of documents (a corpus extraction) rather than prompts."""
    ext = _get(ds.info.get("extraction"), "settings")
    return "document" in ds.column_names or (isinstance(ext, dict) and "context_len" in ext)


def _corpus_fact(ds: Dataset) -> str | None:
    """Documents, window length and token budget of a corpus extraction (None for a prompt dataset)."""
    ext = _get(ds.info.get("extraction"), "settings")
    if not is_corpus(ds):
        return None
    bits = []
    if "document" in ds.column_names:
        docs = ds.prompt_table.column("document").drop_null()
        bits.append(plural(len(set(docs.to_pylist())), "document"))
    n_tokens = int(ds.token_lengths().sum())
    bits.append(f"{n_tokens:,} tokens")
    if isinstance(ext, dict):
        if isinstance(ext.get("context_len"), int):
            bits.append(f"windows of at most {ext['context_len']:,} tokens")
        budget = ext.get("max_tokens")
        if isinstance(budget, int):
            bits.append(f"token budget {budget:,}" + (" (reached)" if n_tokens >= budget else " (not reached: "
                                                      "the source ended or the run stopped early)"))
        else:
            bits.append("no token budget (the whole source)")
    return ", ".join(bits)


def _truncation_fact(ds: Dataset) -> str:
    """How many prompts ``--truncate`` cut, to what length, from which side, and by how much at most."""
    cut = ds.column("truncated_tokens")
    ext = _get(ds.info.get("extraction"), "settings")
    side, limit = _get(ext, "truncate"), _get(ext, "max_length")
    n = int((cut > 0).sum())
    if not n:
        return f"none of the {plural(ds.num_prompts, 'prompt')} was longer than {limit} tokens"
    return (f"{n:,} of {plural(ds.num_prompts, 'prompt')} cut to {limit} tokens, from the {side} (up to "
            f"{int(cut.max()):,} tokens cut; the truncated_tokens column says how many)")


def _how_made(prov: dict) -> str:
    """The extraction backend, where the data was imported from, or that it was written directly (``lmprobe demo``,
    a ``DatasetWriter`` of the user's own arrays)."""
    backend = prov.get("extraction_backend")
    if backend:
        return f"backend {backend}"
    imported = prov.get("imported_from")
    if isinstance(imported, dict):
        kind = {"saelens-activation-cache": "a SAELens activation cache"}.get(imported.get("format"),
                                                                           imported.get("format") or "another format")
        return f"imported from {kind}" + (f" ({imported['source']})" if imported.get("source") else "")
    return "written directly (no extraction)"


def _attachments_fact(info: dict) -> list[tuple[str, str]]:
    out = []
    for kind, what in (("saev", "saev export"), ("sae", "SAE dictionary")):
        for item in recorded_attachments(info)[kind]:
            layers = item.get("layers")
            detail = f"layers {layers}" if isinstance(layers, list) else ""
            if kind == "sae" and isinstance(item.get("feature_count"), int):
                detail += f", {item['feature_count']:,} features"
            if kind == "saev" and isinstance(item.get("n_ex"), int):
                detail += f", {item['n_ex']:,} examples of {item.get('context_len')} tokens"
            out.append((kind + "/", f"{item.get('path')}/: {what} ({detail.strip(', ')})"))
    return out


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
    ]
    corpus = _corpus_fact(ds)
    if corpus is None:
        out.append(("prompts", f"{ds.num_prompts:,} ({info.get('prompt_ordering', '?')} order)"))
    else:
        out += [("windows", f"{ds.num_prompts:,} rows ({info.get('prompt_ordering', '?')} order)"), ("corpus", corpus)]
    labels = ds.labels
    if labels is not None:
        counts = collections.Counter(labels.tolist())
        shown = ", ".join(f"{k!r}: {v}" for k, v in sorted(counts.items(), key=lambda kv: str(kv[0]))[:10])
        out.append(("labels", f"{plural(len(counts), 'class', 'classes')} ({shown}{', ...' if len(counts) > 10 else ''})"))
    else:
        out.append(("labels", "none"))
    h = ds.meta.hidden
    if h is not None:
        out.append(("layers", _layers_fact(ds)))
        out.append(("hookpoints", ", ".join(ds.hookpoints)
                    + ("" if len(ds.hookpoints) == 1 else " (hidden_layers holds the first)")))
        shards = (f"{h.last_token_shards} last-token + {plural(len(h.shards) - h.last_token_shards, 'sequence shard')}"
                  if h.storage == "full_sequence" else f"{plural(len(h.shards), 'shard')} per layer")
        out.append(("hidden", f"dim {h.dim}, {h.dtype}, {h.storage} ({shards})"))
        if h.storage == "full_sequence" and corpus is None:
            out.append(("tokens", f"{int(ds.token_lengths().sum()):,}"))
    lg = ds.meta.logits
    if lg is not None:
        out.append(("logits", f"top-{lg.k} at the last token ({plural(len(lg.shards), 'shard')})"))
    names = set(ds.column_names)
    if "truncated_tokens" in names:
        out.append(("truncated", _truncation_fact(ds)))
    stored = [what for col, what in _STORED.items() if col in names]
    if stored:
        out.append(("stored", ", ".join(stored)))
    # the format's own columns (shard addresses included) are not the user's
    user = [c for c in ds.column_names if c not in RESERVED_COLUMNS]
    out.append(("columns", ", ".join(user) if user else "none besides text" + (" and label" if "label" in names else "")))
    out += _attachments_fact(info)
    prov = info.get("provenance")
    if isinstance(prov, dict):
        out.append(("made with", f"lmprobe {_get(prov, 'lmprobe_version')}, {_how_made(prov)}, "
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
    return _lines(facts(ds, path=path))


def _lines(pairs: list[tuple[str, str]], *, escape: bool = False) -> str:
    """Aligned ``label value`` lines (``escape``: values read from untrusted files, escaped for a terminal)."""
    return "\n".join(f"{k:<12} {escape_controls(v, keep_newlines=False) if escape else v}" for k, v in pairs)


def artefact_text(path: str | os.PathLike) -> str | None:
    """``lmprobe info`` of a folder that is no dataset but a saev export or an SAE dictionary; None for anything else.

    Nothing large is read: the saev metadata and shard list, the dictionary's meta.json and its first layer.
    """
    p = Path(path)
    if is_saev_folder(p):
        sv = SaevDataset(p, verify_hash=False)
        m, data = sv.metadata, sv.metadata.get("data")
        data = data if isinstance(data, dict) else {}
        out = [("examples", f"{sv.n_ex:,} x {sv.tokens_per_ex} tokens ({plural(len(sv.shards), 'shard')}, "
                            f"{sv.ex_per_shard:,} examples per shard)"),
               ("layers", str(sv.layers)), ("d_model", f"{sv.d_model}, {m.get('dtype', 'float32')}"),
               ("model", str(m.get("ckpt")))]
        if data.get("source"):
            out.append(("source", f"{data['source']} ({plural(int(data.get('num_prompts') or 0), 'prompt')})"))
        files = [f for f in ("tokens.bin", "labels.bin") if (p / f).is_file()]
        out.append(("also", ", ".join(files) if files else "no tokens.bin or labels.bin"))
        return f"saev export {escape_controls(p, keep_newlines=False)} (protocol {escape_controls(m.get('protocol'))})\n" + _lines(out, escape=True)
    if is_dictionary_folder(p):
        dct = load_dictionary(SAEConfig(root_path=p.parent, dictionary_name=p.name, device="cpu", cache_layers=1))
        meta, layers = dct.meta, dct.layers
        layer_text = str(layers)
        if layers:
            first = dct.get_layer(layers[0])
            each = " each" if len(layers) > 1 else ""
            layer_text += (f" ({first.feature_count:,} features x {first.hidden_dim} dims{each}, activation "
                           f"{describe_activation(first.activation)})")
        out = [("layers", layer_text), ("features", f"{meta['feature_count']:,} in all (meta.json)"),
               ("model hash", str(meta["model_hash"])), ("format", f"{meta['format']}, {meta['dtype']} weights")]
        return f"SAE dictionary {escape_controls(p, keep_newlines=False)}\n" + _lines(out, escape=True)
    return None
