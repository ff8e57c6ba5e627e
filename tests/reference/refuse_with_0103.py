"""Run inside the reference environment (``lmprobe==0.10.3``): try each of its readers on a dataset.

    python refuse_with_0103.py DATASET_DIR

Prints one JSON line: for each reader, ``{"error": "<message>"}`` when it refused the dataset, or
``{"values": [...]}`` (its float values for layer 0, row 0) when it read it. The same offline Hub cache
as read_with_0103.py points 0.10.3's repo-id readers at the folder.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

dataset_dir = Path(sys.argv[1]).resolve()
repo_id, commit = "local/dataset", "0" * 40
work = Path(tempfile.mkdtemp(prefix="lmprobe-0103-"))
repo = work / "hub" / "datasets--local--dataset"
(repo / "refs").mkdir(parents=True)
(repo / "refs" / "main").write_text(commit)
(repo / "snapshots").mkdir()
(repo / "snapshots" / commit).symlink_to(dataset_dir, target_is_directory=True)
os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(work / "hub"), LMPROBE_CACHE_DIR=str(work / "cache"),
                  HF_HUB_DISABLE_TELEMETRY="1")

import numpy as np  # noqa: E402

import lmprobe  # noqa: E402
from lmprobe import ActivationStore, load_activation_dataset, load_activations, pull_dataset  # noqa: E402

assert lmprobe.__version__ == "0.10.3", lmprobe.__version__


def first_row(reader):
    if reader == "load_activation_dataset":
        tensors, _ = load_activation_dataset(repo_id)
        key = next(k for k in tensors if k.startswith("hidden.layer_0") and not k.endswith(".scale"))
        return tensors[key][0].float().numpy()
    if reader == "load_activations":
        return np.asarray(load_activations(repo_id, show_progress=False)[0][0], dtype=np.float32)
    if reader == "pull_dataset":
        pull_dataset(repo_id)
        return None
    store = ActivationStore.from_dataset(repo_id)
    return np.asarray(store.get_activations(layer=0)[0], dtype=np.float32)


out = {}
for reader in ("load_activation_dataset", "load_activations", "pull_dataset", "ActivationStore"):
    try:
        v = first_row(reader)
        out[reader] = {"values": None if v is None else v.tolist()}
    except Exception as e:  # noqa: BLE001 - what 0.10.3 raises is the observation
        out[reader] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
