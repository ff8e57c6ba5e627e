"""Datasets for tests: prompts, a random dataset written in batches, an index column edited in place."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PROMPTS = [
    {"text": "The cat sat on the mat.", "label": 1, "source": "a"},
    {"text": "A dog.", "label": 0, "source": "b"},
    {"text": "Interpretability researchers study the activations of language models every single day.", "label": 1,
     "source": "a"},
    {"text": "Hi", "label": 0, "source": "c"},
    {"text": "This was a terrible meal, cold and far too salty, said she.", "label": 0, "source": "b"},
    {"text": "Sunny today.", "label": 1, "source": "a"},
    {"text": "Numbers like 12 and 345 appear in text as well as words.", "label": 1, "source": "c"},
]


def make_prompts(rng, n: int, *, max_tokens: int = 9, min_tokens: int = 1):
    n_tok = rng.integers(min_tokens, max_tokens + 1, size=n)
    texts = [f"prompt {i} " + "x" * int(t) for i, t in enumerate(n_tok)]
    return texts, n_tok


def write_dataset(out, rng, *, n=23, layers=(0, 2, 5), dim=8, storage="pooled", shard_size=5 * 32, batch=7,
                  logits_topk=None, dtype="float32", max_tokens=9, min_tokens=1, **kw):
    """Write a random dataset in batches; return the arrays that went in (for comparisons)."""
    from lmprobe.format.writer import DatasetWriter

    texts, n_tok = make_prompts(rng, n, max_tokens=max_tokens, min_tokens=min_tokens)
    labels = rng.integers(0, 3, size=n)
    full = storage == "full_sequence"
    rows = int(n_tok.sum()) if full else n
    hidden = {layer: rng.normal(size=(rows, dim)).astype(np.float32) for layer in layers}
    lv = -np.sort(-rng.normal(size=(n, logits_topk)).astype(np.float32), axis=1) if logits_topk else None
    li = rng.integers(0, 1000, size=(n, logits_topk)) if logits_topk else None
    tok_start = np.concatenate([[0], np.cumsum(n_tok)])
    kw.setdefault("label_type", "int")
    kw.setdefault("columns", {"source": "string", "idx": "int64"})
    w = DatasetWriter(out, layers=list(layers), dim=dim, model_name="test/model", storage=storage,
                      shard_size=shard_size, logits_topk=logits_topk, dtype=dtype, **kw)
    for s in range(0, n, batch):
        e = min(n, s + batch)
        if full:
            hb = {layer: h[tok_start[s]:tok_start[e]] for layer, h in hidden.items()}
        else:
            hb = {layer: h[s:e] for layer, h in hidden.items()}
        extra = {}
        if logits_topk:
            extra = {"logits_values": lv[s:e], "logits_indices": li[s:e]}
        if kw.get("token_ids"):
            extra["token_ids"] = [list(range(int(t))) for t in n_tok[s:e]]  # token j of a prompt has id j
        w.add_batch(texts=texts[s:e], num_tokens=n_tok[s:e], hidden=hb, labels=labels[s:e].tolist(),
                    columns={"source": [f"src{i % 2}" for i in range(s, e)], "idx": list(range(s, e))}
                    if "source" in (kw["columns"] or {}) else None, **extra)
    w.close()
    return {"texts": texts, "n_tok": n_tok, "labels": labels, "hidden": hidden, "lv": lv, "li": li,
            "tok_start": tok_start}



def edit_index_column(root, name, edit):
    """Rewrite one index column (keeping the schema metadata): ``edit(list) -> list``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "index/train-00000-of-00001.parquet"
    table = pq.read_table(path)
    field = table.schema.field(name)
    values = edit(table.column(name).to_pylist())
    table = table.set_column(table.column_names.index(name), field, pa.array(values, field.type))
    pq.write_table(table.replace_schema_metadata(pq.read_schema(path).metadata), path)


def write_sorted_labels(path: Path, n: int, dim: int, shard: str) -> None:
    """A pooled dataset of ``n`` rows sorted by label (the first half 0, the second 1), label in column 0 and the
    row number in column 1: a reader that does not mix shows it at once."""
    from lmprobe.format.writer import DatasetWriter

    with DatasetWriter(path, layers=[0], dim=dim, model_name="m", shard_size=shard, label_type="int",
                       statistics=False) as w:
        for a in range(0, n, 8192):
            b = min(8192, n - a)
            x = np.random.default_rng(a).normal(size=(b, dim)).astype(np.float32)
            labels = [int(i >= n // 2) for i in range(a, a + b)]
            x[:, 0] = labels
            x[:, 1] = np.arange(a, a + b)
            w.add_batch(texts=["x"] * b, num_tokens=[1] * b, hidden={0: x}, labels=labels)
