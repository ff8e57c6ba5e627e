"""Kill an extraction at any point; re-running the same command continues and matches an uninterrupted run."""

from __future__ import annotations

import filecmp
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from support.datasets import PROMPTS
from support.paths import SUPPORT

import lmprobe

pytestmark = pytest.mark.slow  # end-to-end: real processes and model loads

PROMPT_LIST = [dict(p, text=p["text"] + f" (variant {i})") for i in range(4) for p in PROMPTS]  # 28 prompts
KW = dict(layers="0,2", storage="full_sequence", batch_size=3, shard_size="3KB", logits_topk=3, perplexity=True,
          quiet=True)

CRASH_EXTRACT = SUPPORT / "_crash_extract.py"  # extract, then die like kill -9


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*") if p.is_file())


def assert_same(a, b):
    assert _files(a) == _files(b)
    for rel in _files(a):
        if rel.endswith(".parquet") or rel == "README.md":
            continue
        assert filecmp.cmp(Path(a) / rel, Path(b) / rel, shallow=False), rel
    ta = pq.read_table(Path(a) / "index/train-00000-of-00001.parquet")
    tb = pq.read_table(Path(b) / "index/train-00000-of-00001.parquet")
    assert ta.equals(tb)
    ma, mb = lmprobe.load(a).info, lmprobe.load(b).info
    for m in (ma, mb):
        m["provenance"].pop("created_at")
        m.pop("runs")  # when each run started, and which rows it wrote: what differs between the two, by design
    assert ma == mb


@pytest.fixture(scope="module")
def reference(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ds"
    lmprobe.extract(str(llama_dir), PROMPT_LIST, out=out, **KW)
    return out


@pytest.mark.parametrize("die_after", [0, 1, 4, 7, 9])
def test_killed_then_rerun_equals_uninterrupted(llama_dir, tmp_path, reference, die_after):
    out = tmp_path / "ds"
    r = subprocess.run([sys.executable, str(CRASH_EXTRACT), json.dumps([PROMPT_LIST, str(llama_dir), str(out), die_after, KW])],
                       capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    assert not (out / "index").exists()
    lmprobe.extract(str(llama_dir), PROMPT_LIST, out=out, **KW)
    assert_same(reference, out)


def test_sigkill_of_the_cli_then_rerun(llama_dir, tmp_path, reference):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in PROMPT_LIST) + "\n")
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "lmprobe", "extract", "--model", str(llama_dir), "--prompts", str(f), "--out", str(out),
           "--layers", "0,2", "--storage", "full_sequence", "--batch-size", "3", "--shard-size", "3KB",
           "--logits-topk", "3", "--perplexity", "--quiet"]
    p = subprocess.Popen(cmd)
    deadline = time.time() + 60
    while not list((out / ".lmprobe-staging").glob("*.safetensors")) and time.time() < deadline and p.poll() is None:
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert subprocess.run(cmd).returncode == 0
    assert_same(reference, out)


def test_changed_configuration_against_partial_output(llama_dir, tmp_path):
    out = tmp_path / "ds"
    subprocess.run([sys.executable, str(CRASH_EXTRACT), json.dumps([PROMPT_LIST, str(llama_dir), str(out), 3, KW])])
    with pytest.raises(ValueError, match=r"other settings \(layers: \[0, 2\] -> \[0, 1\]\); re-run"):
        lmprobe.extract(str(llama_dir), PROMPT_LIST, out=out, **dict(KW, layers="0,1"))
    ds = lmprobe.extract(str(llama_dir), PROMPT_LIST, out=out, overwrite=True, **dict(KW, layers="0,1"))
    assert ds.layers == [0, 1] and ds.num_prompts == 28


def test_a_changed_batch_size_resumes_and_each_run_is_recorded(llama_dir, tmp_path, reference):
    """The usual retry after an out-of-memory error is a smaller batch; it must not lose the work.
    Batch size, device and checkpoint interval change no stored value beyond float rounding."""
    out = tmp_path / "ds"
    r = subprocess.run([sys.executable, str(CRASH_EXTRACT), json.dumps([PROMPT_LIST, str(llama_dir), str(out), 4, KW])],
                       capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    done = json.loads((out / ".lmprobe-staging" / "state.json").read_text())["num_prompts"]
    assert 0 < done < 28
    ds = lmprobe.extract(str(llama_dir), PROMPT_LIST, out=out, **dict(KW, batch_size=2), checkpoint_interval=5.0)
    ref = lmprobe.load(reference)
    assert ds.texts == ref.texts
    for layer in (0, 2):
        np.testing.assert_allclose(ds.hidden(layer), ref.hidden(layer), rtol=1e-4, atol=1e-5)
    runs = ds.info["runs"]
    assert [(r["first_row"], r["batch_size"], r["checkpoint_interval"], r["device"]) for r in runs] == [
        (0, 3, 0.0, "cpu"), (done, 2, 5.0, "cpu")], runs
    assert ds.info["extraction"]["settings"]["batch_size"] == 2


def test_a_local_models_weights_fingerprint_follows_its_weights(llama_dir, tmp_path):
    """The fingerprint a local model's extraction records changes when the weights are saved again
    (same names, shapes and sizes), not when nothing changed; a hostile header length is not a crash."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from lmprobe.extraction.model import weights_fingerprint

    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    first = weights_fingerprint(model)
    assert first.startswith("files:") and weights_fingerprint(model) == first
    (f,) = model.glob("*.safetensors")
    size, tensors = f.stat().st_size, load_file(f)
    save_file({k: v * 2 for k, v in tensors.items()}, f, metadata={"format": "pt"})
    assert f.stat().st_size == size and weights_fingerprint(model) != first
    (model / "bad.safetensors").write_bytes((2**63).to_bytes(8, "little") + b"{}")
    os.utime(model / "bad.safetensors", ns=(1, 1))
    assert weights_fingerprint(model).startswith("files:")
