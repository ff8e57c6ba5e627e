"""Writes a fixed dataset; dies (os._exit, like kill -9: no cleanup runs) at a chosen point.

Used by test_format_resume.py:  python _crash_writer.py OUT MODE N
MODE "replace": die at the N-th os.replace; "batch": die after N batches; "none": finish.
CRASH_DTYPE (environment): the stored dtype, float32 unless given.
"""

from __future__ import annotations

import os
import sys

import numpy as np

N, B, DIM, LAYERS = 40, 3, 4, (0, 3)


def data():
    rng = np.random.default_rng(42)
    n_tok = rng.integers(1, 7, size=N)
    hidden = {layer: rng.normal(size=(int(n_tok.sum()), DIM)).astype(np.float32) for layer in LAYERS}
    lv = rng.normal(size=(N, 2)).astype(np.float32)
    li = rng.integers(0, 50, size=(N, 2))
    return n_tok, hidden, lv, li


def writer(out):
    from lmprobe.format.writer import DatasetWriter

    return DatasetWriter(out, layers=list(LAYERS), dim=DIM, model_name="m", storage="full_sequence",
                         shard_size=DIM * 4 * 7, logits_topk=2, label_type="int", token_ids=True,
                         checkpoint_interval=0, provenance={"created_at": "fixed"}, statistics=True,
                         dtype=os.environ.get("CRASH_DTYPE", "float32"))


def write_from(w, start):
    n_tok, hidden, lv, li = data()
    starts = np.concatenate([[0], np.cumsum(n_tok)])
    for s in range(start, N, B):
        e = min(N, s + B)
        yield s
        w.add_batch(texts=[f"p{i}" for i in range(s, e)], num_tokens=n_tok[s:e], labels=[i % 2 for i in range(s, e)],
                    hidden={layer: h[starts[s]:starts[e]] for layer, h in hidden.items()},
                    logits_values=lv[s:e], logits_indices=li[s:e],
                    token_ids=[list(range(int(t))) for t in n_tok[s:e]])


def main():
    out, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "replace":
        real, count = os.replace, [0]

        def dying_replace(a, b):
            count[0] += 1
            if count[0] == n:
                os._exit(9)
            real(a, b)

        os.replace = dying_replace
    w = writer(out)
    for done, _ in enumerate(write_from(w, w.num_prompts)):
        if mode == "batch" and done == n:
            os._exit(9)
    w.close()


if __name__ == "__main__":
    main()
