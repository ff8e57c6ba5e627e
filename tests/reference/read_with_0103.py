"""Run inside a virtual environment holding the reference implementation (``lmprobe==0.10.3`` from PyPI).

    python read_with_0103.py DATASET_DIR OUT.safetensors

Reads DATASET_DIR with each of 0.10.3's own readers and saves what they return, so that the test
(tests/format/test_reference_0103.py, in lmprobe's own environment) can compare it with lmprobe's reading.
0.10.3's readers take Hub repo ids only; an offline Hugging Face cache whose snapshot is the
dataset folder (a symlink) points them at it without any network access.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

dataset_dir, out_path = Path(sys.argv[1]).resolve(), sys.argv[2]
repo_id, commit = "local/dataset", "0" * 40
work = Path(tempfile.mkdtemp(prefix="lmprobe-0103-"))
repo = work / "hub" / "datasets--local--dataset"
(repo / "refs").mkdir(parents=True)
(repo / "refs" / "main").write_text(commit)  # no trailing newline: huggingface_hub reads it verbatim
(repo / "snapshots").mkdir()
(repo / "snapshots" / commit).symlink_to(dataset_dir, target_is_directory=True)
# read at import time by huggingface_hub and lmprobe: set before importing them
os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(work / "hub"), LMPROBE_CACHE_DIR=str(work / "cache"),
                  HF_HUB_DISABLE_TELEMETRY="1")

import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import lmprobe  # noqa: E402
from lmprobe import ActivationStore, load_activation_dataset, load_activations, pull_dataset  # noqa: E402

assert lmprobe.__version__ == "0.10.3", lmprobe.__version__
out = {}
tensors, info = load_activation_dataset(repo_id)
for key, t in tensors.items():
    out[f"load_activation_dataset/{key}"] = (t.float() if t.is_floating_point() else t).numpy()
acts = load_activations(repo_id, show_progress=False)
for layer, a in acts.items():
    out[f"load_activations/{layer}"] = a
pulled = pull_dataset(repo_id)
store = ActivationStore.from_dataset(repo_id)
for layer in store.layers:
    out[f"ActivationStore/{layer}"] = store.get_activations(layer=layer)
save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, out_path)  # views are saved wrongly otherwise
print(json.dumps({"pulled": pulled, "store_prompts": list(store.prompts), "layers": list(store.layers)}))
