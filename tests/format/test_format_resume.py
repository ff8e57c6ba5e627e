"""An interrupted writer resumes from its last checkpoint and ends equal to an uninterrupted run; a tampered
checkpoint is refused, and a remote output's resume never needs back a shard that was uploaded and deleted."""

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
from support import _crash_writer
from support.paths import SUPPORT

import lmprobe
from lmprobe.errors import LmprobeError, ResumeMismatchError
from lmprobe.format.validate import validate
from lmprobe.format.writer import DatasetWriter

INDEX = "index/train-00000-of-00001.parquet"


def _child(out, mode, n, env=None):
    return subprocess.run([sys.executable, str(SUPPORT / "_crash_writer.py"), str(out), mode, str(n)], capture_output=True,
                          text=True, env=env)


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


@pytest.mark.parametrize(("mode", "n"), [("batch", 1), ("batch", 6), ("replace", 5), ("replace", 34)])
def test_an_int8_output_resumes_equal_to_an_uninterrupted_run(tmp_path, monkeypatch, mode, n):
    """int8 shards hold two tensors (codes and scales): a partial shard reopens with both, bit for bit."""
    import os

    env = {**os.environ, "CRASH_DTYPE": "int8"}
    assert _child(tmp_path / "ref", "none", 0, env).returncode == 0
    out = tmp_path / "ds"
    r = _child(out, mode, n, env)
    assert r.returncode == 9, r.stderr
    monkeypatch.setenv("CRASH_DTYPE", "int8")
    _resume(out)
    assert_same_dataset(tmp_path / "ref", out)
    assert validate(out).ok and lmprobe.load(out).dtype == "int8"


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(tmp_path, reference):
    out = tmp_path / "ds"
    code = (
        f"import sys, time; sys.path.insert(0, {str(SUPPORT)!r}); import _crash_writer as c\n"
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
                      logits_topk=2, label_type="int", token_ids=True)
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


def test_a_tampered_checkpoint_cannot_move_outside_files_in(tmp_path, rng):
    out = tmp_path / "ds"
    w = DatasetWriter(out, layers=[0], dim=4, model_name="m", shard_size="64B")
    for _ in range(3):
        w.add_batch(texts=["a", "b"], num_tokens=[1, 1], hidden={0: rng.normal(size=(2, 4))})
    w.checkpoint()
    w.abort()
    secret = tmp_path / "secret.txt"
    secret.write_text("do not move me")
    state_path = out / ".lmprobe-staging/state.json"
    state = json.loads(state_path.read_text())
    state["streams"]["last"]["closed"][0]["files"]["0"]["staging"] = "../../secret.txt"
    state_path.write_text(json.dumps(state))
    with pytest.raises(LmprobeError, match="staging"):
        DatasetWriter(out, layers=[0], dim=4, model_name="m", shard_size="64B")
    assert secret.read_text() == "do not move me"


def test_a_resumed_remote_output_never_needs_an_uploaded_shard_back(tmp_path, rng, monkeypatch):
    """Found by the interrupted-operation matrix (an interrupted S3 overwrite, then the same command): a
    checkpoint recorded a closed shard without its hash, the upload thread then deleted the local file,
    and the resumed writer could not re-hash it ("shard ... is missing; the partial output is damaged")."""
    import threading

    import lmprobe.format.shards as shards
    from lmprobe.base.hashing import sha256_file
    from lmprobe.format import DatasetWriter

    gate = threading.Event()
    threading.Timer(0.5, gate.set).start()  # the hasher falls half a second behind

    def slow(f):
        gate.wait(10)
        return sha256_file(f)

    monkeypatch.setattr(shards, "sha256_file", slow)
    out = tmp_path / "staging"
    uploaded = []

    def upload_and_delete(rel):  # what UploadSink does with a finished shard
        uploaded.append(rel)
        (out / rel).unlink()

    kw = dict(layers=[0], dim=4, model_name="m", shard_size="256B", on_file_complete=upload_and_delete,
              checkpoint_interval=3600)
    w = DatasetWriter(out, **kw)
    for b in range(4):
        w.add_batch(texts=[f"t{b}{i}" for i in range(10)], num_tokens=np.full(10, 3),
                    hidden={0: rng.normal(size=(10, 4)).astype(np.float32)})
    w.checkpoint()
    assert uploaded  # shards left the machine
    gate.set()
    w.abort()  # stops where the checkpoint stands, as a crash would: the next run resumes from it
    monkeypatch.setattr(shards, "sha256_file", sha256_file)
    resumed = DatasetWriter(out, **kw)  # raised FormatError "... is missing" before the fix
    resumed.close()


def test_a_remote_output_killed_while_its_last_shards_upload_finishes_on_the_same_command(tmp_path, rng, monkeypatch):
    """The matrix, run again after the fix above: killed after 60-230 of ~250 objects, the re-run still said
    "shard ... is missing": the sequence shards go up as the writer finishes, are deleted here once uploaded,
    and the resumed finish looked for them here."""
    from lmprobe.format import DatasetWriter, writer

    out = tmp_path / "staging"
    uploaded = []

    def upload_and_delete(rel):
        uploaded.append(rel)
        (out / rel).unlink()

    kw = dict(layers=[0], dim=4, model_name="m", storage="full_sequence", shard_size="256B",
              on_file_complete=upload_and_delete)
    w = DatasetWriter(out, **kw)
    for b in range(4):
        w.add_batch(texts=[f"t{b}{i}" for i in range(5)], num_tokens=np.full(5, 4),
                    hidden={0: rng.normal(size=(20, 4)).astype(np.float32)})
    real = writer.index.write_index

    def killed(*a, **k):
        raise KeyboardInterrupt  # after the shards went up, before the index: as kill -9 there

    monkeypatch.setattr(writer.index, "write_index", killed)
    with pytest.raises(KeyboardInterrupt):
        w.close()
    w.abort()
    assert any("shard" in r for r in uploaded)
    monkeypatch.setattr(writer.index, "write_index", real)
    DatasetWriter(out, **kw).close()  # raised FormatError "shard ... is missing" before the fix
    assert (out / INDEX).exists()


def _remote_writer(root: Path, name: str, snapshots: list | None = None, **kw) -> DatasetWriter:
    """A writer whose finished files leave for ``root/remote-<name>`` (an upload), keeping a copy of each
    checkpoint (``on_checkpoint``) in ``snapshots`` as a Hub output's session does."""
    import shutil

    out, remote = root / name, root / f"remote-{name}"

    def complete(rel, sha256=None):
        (remote / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(out / rel, remote / rel)

    def renamed(old, new):
        (remote / new).parent.mkdir(parents=True, exist_ok=True)
        (remote / old).rename(remote / new)

    def checkpointed(staging, state, files):
        copy = root / f"snapshot-{len(snapshots)}"
        (copy / "index").mkdir(parents=True)
        for i in range(state["index_parts"]):
            shutil.copy(staging / "index" / f"part-{i:06d}.parquet", copy / "index")
        if state["statistics_file"]:
            shutil.copy(staging / state["statistics_file"], copy)
        (copy / "state.json").write_text(json.dumps(state))
        snapshots.append(copy)

    return DatasetWriter(out, on_file_complete=complete, on_file_renamed=renamed,
                         on_checkpoint=checkpointed if snapshots is not None else None, **kw)


def test_a_checkpoint_taken_on_another_machine_resumes_by_refilling_its_open_shards(tmp_path, rng):
    """A writer whose files left the machine, reopened elsewhere on a copy of its checkpoint
    (state, index rows, statistics: never the open shards' partial files) recomputes only the rows of the shards
    the checkpoint left open, then goes on; the dataset is byte for byte an uninterrupted writer's."""
    import shutil

    n, dim = 40, 4
    lengths = rng.integers(1, 7, size=n)
    hidden = {layer: rng.normal(size=(int(lengths.sum()), dim)).astype(np.float32) for layer in (0, 1)}
    logits = rng.normal(size=(n, 2)).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    kw = dict(layers=[0, 1], dim=dim, model_name="m", storage="full_sequence", shard_size=6 * dim * 4, logits_topk=2,
              checkpoint_interval=0, provenance={"created_at": "2026-01-01T00:00:00+00:00"})

    def batch(i):
        return dict(texts=[f"p{i}"], num_tokens=lengths[i:i + 1],
                    hidden={layer: h[starts[i]:starts[i + 1]] for layer, h in hidden.items()},
                    logits_values=logits[i:i + 1], logits_indices=np.array([[0, 1]], dtype=np.int32))

    whole = _remote_writer(tmp_path, "whole", **kw)
    for i in range(n):
        whole.add_batch(**batch(i))
    whole.close()

    snapshots: list = []
    first = _remote_writer(tmp_path, "a", snapshots, **kw)
    for i in range(23):
        first.add_batch(**batch(i))
    first.abort()  # killed; its node is gone with the open shards' partial files
    seeded = tmp_path / "b" / ".lmprobe-staging"
    shutil.copytree(snapshots[-1], seeded)
    shutil.copytree(tmp_path / "remote-a", tmp_path / "remote-b")
    again = _remote_writer(tmp_path, "b", **kw)
    assert again.num_prompts == 23 and again.refill_from is not None and 0 < again.refill_from < 23
    for i in range(again.refill_from, 23):
        again.refill_batch(first=i, **batch(i))
    assert again.refill_from is None
    for i in range(23, n):
        again.add_batch(**batch(i))
    again.close()
    shutil.copytree(tmp_path / "b", tmp_path / "remote-b", dirs_exist_ok=True)
    shutil.copytree(tmp_path / "whole", tmp_path / "remote-whole", dirs_exist_ok=True)
    a = sorted(p.relative_to(tmp_path / "remote-whole") for p in (tmp_path / "remote-whole").rglob("*") if p.is_file())
    b = sorted(p.relative_to(tmp_path / "remote-b") for p in (tmp_path / "remote-b").rglob("*") if p.is_file())
    assert [p for p in a if ".provisional" not in str(p)] == [p for p in b if ".provisional" not in str(p)]
    for rel in a:
        if ".provisional" not in str(rel):
            assert (tmp_path / "remote-whole" / rel).read_bytes() == (tmp_path / "remote-b" / rel).read_bytes(), rel


def test_a_refill_that_recomputes_other_rows_is_refused(tmp_path, rng):
    """Rows recomputed differently (another model, other prompts) do not fill the open shards as the checkpoint
    says: refused in one line, not a dataset of two runs' rows."""
    import shutil

    from lmprobe.errors import FormatError

    kw = dict(layers=[0], dim=4, model_name="m", storage="full_sequence", shard_size=6 * 4 * 4, checkpoint_interval=0)
    snapshots: list = []
    first = _remote_writer(tmp_path, "a", snapshots, **kw)
    for i in range(9):
        first.add_batch(texts=[f"p{i}"], num_tokens=[3], hidden={0: rng.normal(size=(3, 4)).astype(np.float32)})
    first.abort()
    shutil.copytree(snapshots[-1], tmp_path / "b" / ".lmprobe-staging")
    again = _remote_writer(tmp_path, "b", **kw)
    with pytest.raises(FormatError, match="recomputed rows"):
        for i in range(again.refill_from, 9):
            again.refill_batch(first=i, texts=[f"p{i}"], num_tokens=[2],
                               hidden={0: rng.normal(size=(2, 4)).astype(np.float32)})
    again.abort()


def test_a_checkpoint_records_where_a_source_read_in_order_is_replayed_from(tmp_path, rng):
    """A corpus: a caller that reads its source in order cannot start again at any row, only
    where one of its batches began. The checkpoint records the rows, tokens and source position before the batch
    that opened the earliest open shard (``replay``); a writer reopened elsewhere on a copy gives them back, and
    the batches given again from there, as they were given, make an uninterrupted writer's dataset."""
    import shutil

    n, dim, bs = 40, 4, 3
    lengths = rng.integers(1, 7, size=n)
    hidden = {0: rng.normal(size=(int(lengths.sum()), dim)).astype(np.float32)}
    starts = np.concatenate([[0], np.cumsum(lengths)])
    kw = dict(layers=[0], dim=dim, model_name="m", storage="full_sequence", shard_size=7 * dim * 4,
              checkpoint_interval=0, provenance={"created_at": "2026-01-01T00:00:00+00:00"})

    def batch(i):
        j = min(i + bs, n)
        return dict(texts=[f"p{k}" for k in range(i, j)], num_tokens=lengths[i:j],
                    hidden={0: hidden[0][starts[i]:starts[j]]}, progress={"document": j})

    whole = _remote_writer(tmp_path, "whole", **kw)
    for i in range(0, n, bs):
        whole.add_batch(**batch(i))
    whole.close()

    snapshots: list = []
    first = _remote_writer(tmp_path, "a", snapshots, **kw)
    for i in range(0, 24, bs):
        first.add_batch(**batch(i))
    first.abort()
    shutil.copytree(snapshots[-1], tmp_path / "b" / ".lmprobe-staging")
    shutil.copytree(tmp_path / "remote-a", tmp_path / "remote-b")
    again = _remote_writer(tmp_path, "b", **kw)
    replay = again.replay
    assert replay is not None and again.refill_from is not None
    assert 0 < replay.prompts <= again.refill_from and replay.prompts % bs == 0  # where a batch began
    assert replay.progress == {"document": replay.prompts} and replay.tokens == int(lengths[:replay.prompts].sum())
    done = again.num_prompts
    for i in range(replay.prompts, n, bs):
        if i < done:
            again.refill_batch(first=i, **batch(i))
        else:
            again.add_batch(**batch(i))
    again.close()
    shutil.copytree(tmp_path / "b", tmp_path / "remote-b", dirs_exist_ok=True)
    shutil.copytree(tmp_path / "whole", tmp_path / "remote-whole", dirs_exist_ok=True)
    a = sorted(p.relative_to(tmp_path / "remote-whole") for p in (tmp_path / "remote-whole").rglob("*")
               if p.is_file() and ".provisional" not in str(p))
    assert a and a == sorted(p.relative_to(tmp_path / "remote-b") for p in (tmp_path / "remote-b").rglob("*")
                             if p.is_file() and ".provisional" not in str(p))
    for rel in a:
        assert (tmp_path / "remote-whole" / rel).read_bytes() == (tmp_path / "remote-b" / rel).read_bytes(), rel


@pytest.mark.parametrize("replay", [{"prompts": 7, "tokens": 0, "progress": None},  # past the checkpoint's rows
                                    {"prompts": 1, "tokens": -1, "progress": None},
                                    {"prompts": 1, "tokens": 1, "progress": {"document": 2**60}},
                                    {"prompts": "1", "tokens": 1, "progress": None}])
def test_a_damaged_replay_point_is_refused(tmp_path, rng, replay):
    out = tmp_path / "ds"
    w = DatasetWriter(out, layers=[0], dim=4, model_name="m", shard_size="64B")
    for _ in range(3):
        w.add_batch(texts=["a", "b"], num_tokens=[1, 1], hidden={0: rng.normal(size=(2, 4))}, progress={"document": 1})
    w.checkpoint()
    w.abort()
    state_path = out / ".lmprobe-staging/state.json"
    state = json.loads(state_path.read_text())
    assert state["replay"]["prompts"] <= 6
    state_path.write_text(json.dumps({**state, "replay": replay}))
    with pytest.raises(ResumeMismatchError, match="damaged"):
        DatasetWriter(out, layers=[0], dim=4, model_name="m", shard_size="64B")
