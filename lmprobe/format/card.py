"""The dataset card (README.md): YAML front matter for the Hub, and a body that says how to read the data.

lmprobe's part of the body sits between two marker lines (``BEGIN``/``END``). A card is updated
(``update_card``) by replacing that part and merging lmprobe's keys into the front matter: what
the dataset's owner wrote around it stays as it is. A card without the markers (written by hand,
or by an older lmprobe) is kept whole, and lmprobe's part is added after it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import yaml

from .spec import INDEX_PATH


def front_matter(info: dict[str, Any]) -> dict[str, Any]:
    return {
        "configs": [
            {"config_name": "default", "data_files": [{"split": "train", "path": "index/*.parquet"}]}
        ],
        "tags": ["lmprobe", "activations", "interpretability"],
        "task_categories": ["feature-extraction"],
    }


def _layers_text(layers: list[int]) -> str:
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(str(x) for x in layers)


BEGIN = "<!-- lmprobe:card:begin (lmprobe rewrites what lies between these markers; write outside them) -->"
END = "<!-- lmprobe:card:end -->"


def render_card(info: dict[str, Any], schema: pa.Schema, extra_sections: list[str] | None = None) -> str:
    """A whole new card: lmprobe's front matter, then its section between the markers."""
    return "---\n" + yaml.safe_dump(front_matter(info), sort_keys=False) + "---\n\n" + _section(
        info, schema, extra_sections)


def update_card(existing: str | None, info: dict[str, Any], schema: pa.Schema,
                extra_sections: list[str] | None = None) -> str:
    """``existing`` with lmprobe's section replaced (or added) and lmprobe's front-matter keys merged in."""
    if not existing:
        return render_card(info, schema, extra_sections)
    meta: dict[str, Any] = {}
    body = existing
    if existing.startswith("---\n") and "\n---\n" in existing[4:]:
        head, body = existing[4:].split("\n---\n", 1)
        try:
            parsed = yaml.safe_load(head)
        except yaml.YAMLError:
            parsed = None
        if isinstance(parsed, dict):
            meta = parsed
        else:  # not ours to repair: keep it in the body, as text
            body = existing
    ours = front_matter(info)
    meta["configs"] = ours["configs"]  # the index's config is lmprobe's to state
    for key in ("tags", "task_categories"):
        kept = meta.get(key) if isinstance(meta.get(key), list) else []
        meta[key] = kept + [t for t in ours[key] if t not in kept]
    section = _section(info, schema, extra_sections)
    if BEGIN in body and END in body.split(BEGIN, 1)[1]:
        before, rest = body.split(BEGIN, 1)
        after = rest.split(END, 1)[1].removeprefix("\n")
        body = before + section + after
    else:
        body = body.rstrip("\n") + "\n\n" + section
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n\n" + body.lstrip("\n")


def _section(info: dict[str, Any], schema: pa.Schema, extra_sections: list[str] | None) -> str:
    """lmprobe's part of the card, markers included: the facts, how to read it with lmprobe, without lmprobe and
    with 🤗 datasets, then the caller's sections."""
    hidden = info["tensors"]["hidden_layers"]
    logits = info["tensors"].get("logits_topk")
    user_cols = [f.name for f in schema][list(schema.names).index("row_offset") + 1 :]
    lines = [BEGIN, *_facts(info, schema), *_read_with_lmprobe(hidden, logits),
             *_read_without_lmprobe(hidden, logits, user_cols), *_load_with_datasets()]
    for section in extra_sections or []:
        lines += ["", section.rstrip()]
    lines.append(END)
    return "\n".join(lines) + "\n"


def _facts(info: dict[str, Any], schema: pa.Schema) -> list[str]:
    """The title, a sentence and the table of facts: model, prompts, layers, storage, files, provenance."""
    hidden = info["tensors"]["hidden_layers"]
    logits = info["tensors"].get("logits_topk")
    model = info["model"]
    full = hidden["storage"] == "full_sequence"
    n_files = len(hidden["shards"]) * len(hidden["layers"])
    lines = [
        f"# Activations of `{model['name']}`",
        "",
        "An [lmprobe](https://github.com/lmprobe) dataset in the lmprobe dataset format "
        f"{info['format_version']}: hidden states of a language model for {info['num_prompts']} prompts, "
        "stored as per-layer safetensors shards with one parquet index.",
        "",
        "| | |",
        "|---|---|",
        f"| Model | `{model['name']}` (revision `{model.get('revision') or 'unknown'}`) |",
        f"| Prompts | {info['num_prompts']} ({info.get('prompt_ordering', 'input')} order) |",
        f"| Layers | {_layers_text(hidden['layers'])} (output of decoder block i, 0-based) |",
        f"| Hidden size | {hidden['dim']} ({hidden['dtype']}) |",
        f"| Storage | {hidden['storage']}"
        + (f" ({hidden['last_token_shards']} last-token shards, then sequence shards)" if full else " (last token)")
        + " |",
        f"| Shard files | {n_files} ({len(hidden['shards'])} per layer) |",
    ]
    if logits:
        lines.append(f"| Top-k logits | k={logits['k']} at the last token, {len(logits['shards'])} shard(s) |")
    other = [c for c in schema.names if c.startswith(("perplexity", "token_ids", "token_strings", "token_perplexity"))]
    if other:
        lines.append(f"| Other index columns | {', '.join(other)} |")
    prov = info.get("provenance", {})
    lines.append(
        f"| Made with | lmprobe {prov.get('lmprobe_version')}, torch {prov.get('torch_version')}, "
        f"transformers {prov.get('transformers_version')}, {prov.get('created_at')} |"
    )
    return lines


def _read_with_lmprobe(hidden: dict[str, Any], logits: dict[str, Any] | None) -> list[str]:
    """The snippet that reads the dataset with lmprobe."""
    layer = hidden["layers"][-1]
    full = hidden["storage"] == "full_sequence"
    lines = [
        "",
        "## Read it with lmprobe",
        "",
        "```python",
        "import lmprobe",
        "",
        'ds = lmprobe.load("PATH_OR_REPO")',
        f"X = ds.hidden({layer})        # (num_prompts, {hidden['dim']}) last-token vectors, index order",
        "y = ds.labels",
    ]
    if full:
        lines.append(f"toks = ds.token_hidden(0, {layer})  # (num_tokens, {hidden['dim']}) for prompt 0")
    if logits:
        lines.append("values, indices = ds.logits_topk()")
    lines.append("```")
    return lines


def _read_without_lmprobe(hidden: dict[str, Any], logits: dict[str, Any] | None, user_cols: list[str]) -> list[str]:
    """How the files are laid out, and the snippet that reads a vector with pyarrow and safetensors only."""
    layer = hidden["layers"][-1]
    full = hidden["storage"] == "full_sequence"
    lines = [
        "",
        "## Read it without lmprobe",
        "",
        "Everything is described by the `lmprobe:` keys of the index's parquet schema metadata."
        + (" The shards hold bfloat16, which numpy has no type for: a row's bytes are read as uint16, the upper "
           "half of each float32 (docs/format.md of lmprobe)." if hidden["dtype"] == "bfloat16" else "")
        + (" The shards hold int8 codes and a float32 scale per row: a vector is codes x scale (format 3.0)."
           if hidden.get("scale_key_pattern") else ""),
        "",
        "```python",
        "import json",
        *(["import numpy as np"] if hidden["dtype"] == "bfloat16" else []),
        "import pyarrow.parquet as pq",
        "from safetensors import safe_open",
        "",
        f'table = pq.read_table("{INDEX_PATH}")',
        "df = table.to_pandas()",
        'hidden = json.loads(table.schema.metadata[b"lmprobe:tensors"])["hidden_layers"]',
        "",
        f"row, layer = df.iloc[0], {layer}",
        'path = hidden["file_pattern"].format(layer=layer, shard=row["shard_index"])',
        'key = hidden["key_pattern"].format(layer=layer)',
    ]
    if hidden.get("scale_key_pattern"):  # int8: the row's codes times its float32 scale (docs/format.md, Dtypes)
        lines += [
            'with safe_open(path, framework="np") as f:',
            '    codes = f.get_slice(key)[int(row["row_offset"])]',
            '    scale = f.get_slice(hidden["scale_key_pattern"].format(layer=layer))[int(row["row_offset"])]',
            '    vector = codes.astype("float32") * scale  # last-token activation of prompt 0',
        ]
    elif hidden["dtype"] == "bfloat16":  # numpy has no bfloat16: its uint16 view, no torch needed
        lines += [
            'with open(path, "rb") as f:  # the row\'s bytes as uint16: the upper half of each float32',
            '    n = int.from_bytes(f.read(8), "little")',
            '    entry = json.loads(f.read(n))[key]',
            f'    f.seek(8 + n + entry["data_offsets"][0] + 2 * {hidden["dim"]} * int(row["row_offset"]))',
            f'    bits = np.frombuffer(f.read(2 * {hidden["dim"]}), dtype="<u2")',
            'vector = (bits.astype(np.uint32) << 16).view(np.float32)  # last-token activation of prompt 0',
        ]
    else:
        lines += [
            'with safe_open(path, framework="np") as f:',
            '    vector = f.get_slice(key)[int(row["row_offset"])]  # last-token activation of prompt 0',
        ]
    lines += [
        "```",
    ]
    if full:
        lines += [
            "",
            "Token `i` of a prompt is at `token_shard_ids[i]`, `token_shard_offsets[i]` (same file and key",
            "patterns); the last entry equals `shard_index`, `row_offset`.",
        ]
    if logits:
        lines += [
            "",
            "Top-k logits: `tensors.logits_topk.file_pattern` with `shard=shard_index_logits`, row",
            "`row_offset_logits` of the tensors `topk_values` (float32) and `topk_indices` (int32).",
        ]
    if user_cols:
        lines += ["", "Extra index columns: " + ", ".join(f"`{c}`" for c in user_cols) + "."]
    return lines


def _load_with_datasets() -> list[str]:
    """The snippet that loads the index with 🤗 datasets."""
    return [
        "",
        "## Load the index with 🤗 datasets",
        "",
        "```python",
        "from datasets import load_dataset",
        "",
        'index = load_dataset("PATH_OR_REPO", split="train")  # text, label and addressing columns',
        "```",
    ]
