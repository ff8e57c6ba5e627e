"""An interrupted writer resumes from its last checkpoint and ends equal to an uninterrupted run."""

from __future__ import annotations

import filecmp
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import lmprobe
from lmprobe.errors import ResumeMismatchError
from lmprobe.format.validate import validate
from lmprobe.format.writer import DatasetWriter

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _crash_writer  # noqa: E402


def _child(out, mode, n):
    return subprocess.run([sys.executable, str(HERE / "_crash_writer.py"), str(out), mode, str(n)], capture_output=True,
                          text=True)


def _resume(out):
    w = _crash_writer.writer(out)
    for _ in _crash_writer.write_from(w, w.num_prompts):
        pass
    w.close()


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ds"
    r = _child(out, "none", 0)
    assert r.returncode == 0, r.stderr
    return out


def assert_same_dataset(a, b):
    assert _files(a) == _files(b)
    for rel in _files(a):
        assert filecmp.cmp(Path(a) / rel, Path(b) / rel, shallow=False), rel


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 21, 34, 55, 80, 88, 89, 90, 91])
def test_crash_at_any_rename_then_resume(tmp_path, reference, n):
    out = tmp_path / "ds"
    r = _child(out, "replace", n)
    assert r.returncode == 9, r.stderr
    assert not (out / "index/train-00000-of-00001.parquet").exists()
    _resume(out)
    assert_same_dataset(reference, out)
    assert validate(out).ok


@pytest.mark.parametrize("k", [0, 1, 6, 13])
def test_crash_between_batches_then_resume(tmp_path, reference, k):
    out = tmp_path / "ds"
    assert _child(out, "batch", k).returncode == 9
    _resume(out)
    assert_same_dataset(reference, out)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(tmp_path, reference):
    out = tmp_path / "ds"
    code = (
        f"import sys, time; sys.path.insert(0, {str(HERE)!r}); import _crash_writer as c\n"
        f"w = c.writer({str(out)!r})\n"
        "for _ in c.write_from(w, w.num_prompts): time.sleep(0.05)\n"
        "w.close()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 60
    while not (out / ".lmprobe-staging/state.json").exists() and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    _resume(out)
    assert_same_dataset(reference, out)


def test_resume_with_another_configuration_is_refused(tmp_path):
    out = tmp_path / "ds"
    assert _child(out, "batch", 4).returncode == 9
    with pytest.raises(ResumeMismatchError, match=r"dim: 4 -> 5"):
        DatasetWriter(out, layers=[0, 3], dim=5, model_name="m", storage="full_sequence", shard_size=4 * 4 * 7,
                      logits_k=2, label_type="int", token_ids=True)
    # nothing was lost: the right configuration still resumes
    w = _crash_writer.writer(out)
    assert w.num_prompts == 12
    w.abort()
    # overwrite starts over
    with DatasetWriter(out, layers=[1], dim=2, model_name="m", overwrite=True) as w:
        w.add_batch(texts=["x"], num_tokens=[1], hidden={1: [[1.0, 2.0]]})
    assert lmprobe.load(out).num_prompts == 1


def test_index_equals_reference_rows(tmp_path, reference):
    out = tmp_path / "ds"
    _child(out, "batch", 5)
    _resume(out)
    a = pq.read_table(reference / "index/train-00000-of-00001.parquet")
    b = pq.read_table(out / "index/train-00000-of-00001.parquet")
    assert a.equals(b) and a.schema.metadata == b.schema.metadata
    assert b.column("text").to_pylist() == [f"p{i}" for i in range(40)]
