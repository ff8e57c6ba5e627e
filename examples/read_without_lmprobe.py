"""Read an lmprobe dataset with nothing but pyarrow, numpy and safetensors, as a third party would.

    python examples/read_without_lmprobe.py DATASET_DIR [LAYER]

Everything needed is in the parquet index's schema metadata: the shard file pattern, the tensor
key pattern and the shard list. Each shard is opened once and every row it holds is taken from it.
Every stored dtype reads as float32, bfloat16 included: numpy has no bfloat16 (safetensors' numpy
reader refuses it), so its 16-bit patterns are read from the file and widened, without torch.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from safetensors import safe_open


def read_tensor(path: Path, key: str) -> np.ndarray:
    """Tensor ``key`` of a safetensors file as a numpy array (bfloat16 widened to float32)."""
    with open(path, "rb") as f:  # a safetensors file: 8-byte header length, JSON header, then the data
        n = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(n))[key]
    if entry["dtype"] != "BF16":
        with safe_open(str(path), framework="np") as f:
            return f.get_tensor(key)
    start, end = entry["data_offsets"]
    bits = np.fromfile(path, dtype="<u2", count=(end - start) // 2, offset=8 + n + start)
    # a bfloat16 is the upper half of a float32: shift its 16 bits into place
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def main() -> None:
    root = Path(sys.argv[1])
    table = pq.read_table(root / "index" / "train-00000-of-00001.parquet")
    meta = {k.decode()[len("lmprobe:"):]: json.loads(v) for k, v in table.schema.metadata.items()
            if k.decode().startswith("lmprobe:")}
    hidden = meta["tensors"]["hidden_layers"]
    layer = int(sys.argv[2]) if len(sys.argv) > 2 else hidden["layers"][-1]
    shard_index = table.column("shard_index").to_numpy()
    row_offset = table.column("row_offset").to_numpy()

    rows_by_shard = defaultdict(list)
    for i, s in enumerate(shard_index):
        rows_by_shard[int(s)].append(i)
    X = np.empty((table.num_rows, hidden["dim"]), dtype=np.float32)
    key = hidden["key_pattern"].format(layer=layer)
    for shard, rows in rows_by_shard.items():
        path = root / hidden["file_pattern"].format(layer=layer, shard=shard)
        X[rows] = read_tensor(path, key)[row_offset[rows]]

    labels = table.column("label").to_pylist()
    print(f"model {meta['model']['name']}, {meta['num_prompts']} prompts, layer {layer}: X {X.shape}")
    print(f"first prompt: {table.column('text')[0].as_py()!r}, label {labels[0]}, |x| = {np.linalg.norm(X[0]):.4f}")
    if all(isinstance(v, int) for v in labels):
        y = np.array(labels)
        centroid_gap = np.linalg.norm(X[y == y.max()].mean(0) - X[y == y.min()].mean(0))
        print(f"distance between class centroids: {centroid_gap:.4f}")


if __name__ == "__main__":
    main()
