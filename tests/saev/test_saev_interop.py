"""--saev-compat output read by saev's own loaders, at both commits lmprobe supports.

saev (OSU-NLP-Group/saev) is vendored under tests/reference/saev (e43e7dd: protocol 2.0; 3d73f1f:
protocol 2.1) and run in the interop venv (tests/reference/envs.py) by
tests/reference/saev_loaders.py. saev declares Python >= 3.12 and this project runs 3.11: its
loader modules are imported from source as they are, with one shim for the single 3.12 addition
they use (subscripting ``multiprocessing.queues.Queue`` in annotations) and only torchvision
stubbed (its PyPI build cannot sit beside the CPU torch 2.13.0; no loader calls it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from reference.envs import interop_python
from support.datasets import write_dataset
from support.paths import REFERENCE

from lmprobe.cli import main as cli_main
from lmprobe.saev import SaevDataset, export_saev, validate_saev

REF = REFERENCE
COMMIT = {"2.0": "e43e7dd", "2.1": "3d73f1f"}
T, LAYER = 4, 4


@pytest.fixture
def source(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=20, layers=(1, 4), dim=6, storage="full_sequence", shard_size="2KB",
                  min_tokens=3, max_tokens=12, token_ids=True)
    return tmp_path / "ds"


def run_saev(compat: str, folder: Path, out: Path) -> dict:
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    r = subprocess.run([str(interop_python()), "-I", str(REF / "saev_loaders.py"), str(REF / "saev" / COMMIT[compat]),
                        str(folder), str(LAYER), str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def loader_output(out: Path, name: str) -> dict[str, np.ndarray]:
    with np.load(out / f"{name}.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.slow
@pytest.mark.parametrize("compat", ["2.0", "2.1"])
def test_saevs_own_loaders_read_the_compatible_export(tmp_path, source, compat):
    # five examples a shard, so the last shard is short and zero-padded
    folder = export_saev(source, tmp_path / "x" / "saev" / "shards", context_len=T, patches_per_shard=5 * T * 2,
                         saev_compat=compat, quiet=True)
    assert validate_saev(folder) == []
    sv = SaevDataset(folder)
    want = np.stack([[sv.get(e, LAYER, t) for t in range(T)] for e in range(len(sv))])  # (n_ex, T, D)
    result = run_saev(compat, folder, tmp_path / "saev-out")
    assert result["hash"] == folder.name  # saev's Metadata.hash of our metadata is the folder name
    got = loader_output(tmp_path / "saev-out", "shuffled")  # every vector exactly once, in any order
    assert len(got["act"]) == len(sv) * T
    key = got["example"] * T + got["token"]
    assert sorted(key.tolist()) == list(range(len(sv) * T))
    np.testing.assert_array_equal(got["act"], want.reshape(-1, want.shape[-1])[key])
    loaders = result["loaders"]
    if compat == "2.0":
        # saev e43e7dd's ordered loader and indexed dataset read Metadata.n_imgs, which its Metadata no
        # longer has (docs/saev.md says so)
        assert "n_imgs" in loaders["ordered"]["error"] and "n_imgs" in loaders["indexed"]["error"]
    else:
        for name in ("ordered", "indexed"):
            got = loader_output(tmp_path / "saev-out", name)
            np.testing.assert_array_equal(got["example"], np.repeat(np.arange(len(sv)), T))
            np.testing.assert_array_equal(got["token"], np.tile(np.arange(T), len(sv)))
            np.testing.assert_array_equal(got["act"], want.reshape(-1, want.shape[-1]))


def test_compat_21_layout_and_hash(tmp_path, source):
    """What saev 3d73f1f reads: its key names and field order, n_examples, a valid pixel_agg, an 8-digit hash."""
    assert cli_main(["export-saev", str(source), "--out", str(tmp_path / "saev" / "shards"), "--context-len", str(T),
                     "--patches-per-shard", "40", "--saev-compat", "2.1", "--quiet"]) == 0
    (folder,) = (tmp_path / "saev" / "shards").iterdir()
    m = json.loads((folder / "metadata.json").read_text())
    assert list(m) == ["family", "ckpt", "layers", "content_tokens_per_example", "cls_token", "d_model", "n_examples",
                       "max_tokens_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol"]
    assert m["protocol"] == "2.1" and m["pixel_agg"] == "majority" and isinstance(m["data"], str)
    assert json.loads(m["data"])["__class__"] == "LmprobeTokenWindows"  # JSON text, not a base64 pickle
    assert len(folder.name) == 8
    shards = json.loads((folder / "shards.json").read_text())
    assert all(set(s) == {"name", "n_examples"} for s in shards)
    assert sum(s["n_examples"] for s in shards) == m["n_examples"]
    # lmprobe reads it like the others: same vectors as the protocol 2.0 export
    plain = SaevDataset(export_saev(source, tmp_path / "plain", context_len=T, patches_per_shard=40, quiet=True))
    got = np.concatenate(list(SaevDataset(folder).batches(LAYER, 7, shuffle=False)))
    np.testing.assert_array_equal(got, np.concatenate(list(plain.batches(LAYER, 7, shuffle=False))))
    # a tampered metadata.json no longer matches its folder name
    m["ckpt"] = "other"
    (folder / "metadata.json").write_text(json.dumps(m))
    assert any("folder name" in p for p in validate_saev(folder))


def test_compat_20_writes_the_pixel_agg_saev_hashes(tmp_path, source):
    folder = export_saev(source, tmp_path / "saev" / "shards", context_len=T, saev_compat="2.0", quiet=True)
    m = json.loads((folder / "metadata.json").read_text())
    assert "pixel_agg" in m and m["pixel_agg"] is None and m["protocol"] == "2.0" and len(folder.name) == 64
    assert validate_saev(folder) == []


def test_unknown_compat_version_is_one_line(tmp_path, source, capsys):
    assert cli_main(["export-saev", str(source), "--out", str(tmp_path / "saev" / "shards"), "--saev-compat",
                     "3.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "2.0, 2.1" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "saev").exists()
