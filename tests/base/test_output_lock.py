"""One writer per output (docs/security.md, "Outputs"): a second writer of a dataset, a pull or an export is refused
at once, naming the process that holds the output, and a dead holder's lock blocks nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.datasets import write_dataset

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.errors import OutputInUseError
from lmprobe.format import DatasetWriter

HOLD_LOCK = r"""
import sys, time
from pathlib import Path
from lmprobe.base.lock import OutputLock
lock = OutputLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def hold_lock(path: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "locked"
    return child


def test_a_second_writer_is_refused_at_once_and_a_dead_ones_lock_does_not_block(tmp_path, rng):
    out = tmp_path / "ds"
    child = hold_lock(out)
    try:
        t0 = time.monotonic()
        with pytest.raises(OutputInUseError, match=f"in use by process {child.pid}"):
            DatasetWriter(out, layers=[0], dim=4, model_name="m")
        assert time.monotonic() - t0 < 5
        assert cli_main(["merge", str(tmp_path / "a"), "--out", str(out)]) == 2
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # the holder died without cleaning up: its lock is gone with it
    write_dataset(out, rng, n=5)
    assert lmprobe.load(out).num_prompts == 5


def test_two_extractions_into_one_output(tmp_path, llama_dir):
    slow = r"""
import sys, time, lmprobe
from lmprobe.extraction import backend_hf
real = backend_hf.TransformersBackend.run
def run(self, *a, **k):
    time.sleep(0.5)
    return real(self, *a, **k)
backend_hf.TransformersBackend.run = run
print("start", flush=True)
lmprobe.extract(sys.argv[1], [f"prompt {i}" for i in range(40)], out=sys.argv[2], batch_size=2, quiet=True)
"""
    out = tmp_path / "ds"
    first = subprocess.Popen([sys.executable, "-c", slow, str(llama_dir), str(out)], stdout=subprocess.PIPE, text=True)
    assert first.stdout.readline().strip() == "start"
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".ds.lmprobe-lock")) and time.monotonic() < deadline:
        time.sleep(0.05)
    r = subprocess.run([sys.executable, "-m", "lmprobe", "extract", "--model", str(llama_dir), "--prompts",
                        str(_prompt_file(tmp_path)), "--out", str(out), "--quiet"], capture_output=True, text=True)
    assert r.returncode == 2 and f"in use by process {first.pid}" in r.stderr, r.stderr
    assert first.wait(timeout=120) == 0
    assert lmprobe.validate(out).ok


def _prompt_file(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.txt"
    p.write_text("\n".join(f"prompt {i}" for i in range(40)) + "\n")
    return p


@pytest.mark.parametrize("command", ["pull", "export-saev", "export-sae"])
def test_other_outputs_are_locked_too(tmp_path, rng, command, hub, capsys):
    from lmprobe.sae.export import export_sae

    write_dataset(tmp_path / "src", rng, n=6, storage="full_sequence", token_ids=True)
    if command == "pull":
        target, args = tmp_path / "pulled", ["pull", "tester/whatever", "--out", str(tmp_path / "pulled")]
    elif command == "export-saev":
        target, args = tmp_path / "dump", ["export-saev", str(tmp_path / "src"), "--out", str(tmp_path / "dump"),
                                           "--context-len", "2"]
    else:
        W = rng.normal(size=(8, 12)).astype(np.float32)
        np.save(tmp_path / "w.npy", W)
        export_sae(layer=0, root=tmp_path / "sae", dictionary="d", W_enc=W, b_enc=np.zeros(12, np.float32))
        target = tmp_path / "sae" / "d"
        np.savez(tmp_path / "w.npz", w=W)
        args = ["export-sae", str(tmp_path / "w.npz"), "--weight-key", "w", "--orientation", "in_out", "--layer", "1",
                "--root", str(tmp_path / "sae"), "--dict", "d"]
    child = hold_lock(target)
    try:
        assert cli_main(args) == 2
        assert f"in use by process {child.pid}" in capsys.readouterr().err
    finally:
        child.kill()
        child.wait()


def test_info_on_a_folder_another_process_is_writing_says_so(tmp_path, rng, capsys):
    """`info` on a folder another process is writing says so, never "re-run the command that wrote it"."""
    out = tmp_path / "ds"
    (out / ".lmprobe-staging").mkdir(parents=True)
    child = hold_lock(out)
    try:
        assert cli_main(["info", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"lmprobe info: error: {out} is being written by process {child.pid} (no index yet); wait "
                       "for that run to finish"), err
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert cli_main(["info", str(out)]) == 2  # its writer died: an interrupted run, to resume
    assert "unfinished dataset (no index yet); re-run the command that wrote it to resume" in capsys.readouterr().err


TOKEN = "hf_testSECRETtoken1234567890"


def test_a_push_refuses_a_folder_under_rewrite_in_one_line(hub, tmp_path, rng, capsys):
    """A push while `extract --overwrite` rewrote the folder published a mix (12 of 48
    prompts paired with another prompt's vector). The rewrite holds the output lock: the push is refused at once,
    in one line naming the writer, and nothing reaches the Hub."""
    import uuid

    from huggingface_hub import HfApi

    out = tmp_path / "ds"
    write_dataset(out, rng, n=12)
    repo = f"tester/rewrite-{uuid.uuid4().hex[:8]}"
    child = hold_lock(out)  # an `extract --overwrite` of the same folder, running
    try:
        with pytest.raises(OutputInUseError, match=f"being written by process {child.pid}.*push again"):
            lmprobe.push_to_hub(out, repo, token=TOKEN, quiet=True)
        capsys.readouterr()
        assert cli_main(["push", str(out), repo, "--token", TOKEN, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"process {child.pid}" in err and "push" in err, err
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert not HfApi(token=TOKEN).repo_exists(repo, repo_type="dataset")
    lmprobe.push_to_hub(out, repo, token=TOKEN, quiet=True)  # the writer gone, the push goes on


def test_a_rewrite_that_starts_during_a_push_is_refused_and_the_push_publishes_one_dataset(hub, tmp_path, rng,
                                                                                          monkeypatch):
    """R40, the other order: `extract --overwrite` of a folder a push is sending is refused at once (the push holds
    the output lock), so the published rows are the ones the pushed index names."""
    import uuid

    from lmprobe.storage import commits

    out = tmp_path / "ds"
    src = write_dataset(out, rng, n=12)
    repo = f"tester/pushing-{uuid.uuid4().hex[:8]}"
    real = commits.HubCommitter.push_files
    refused = []

    def push_files(self, *a, **k):  # mid-push, a rewrite of the same folder starts
        try:
            DatasetWriter(out, layers=[0], dim=8, model_name="m", overwrite=True).abort()
        except OutputInUseError as exc:
            refused.append(str(exc))
        return real(self, *a, **k)

    monkeypatch.setattr(commits.HubCommitter, "push_files", push_files)
    lmprobe.push_to_hub(out, repo, token=TOKEN, quiet=True)
    assert len(refused) == 1 and f"process {__import__('os').getpid()}" in refused[0], refused
    ds = lmprobe.load(f"hf://datasets/{repo}")
    np.testing.assert_array_equal(ds.hidden(0), src["hidden"][0])


def test_a_lock_file_planted_as_a_link_is_not_written_through(tmp_path):
    """`.ds.lmprobe-lock -> somebody's file` beside an output in a shared folder: taking the lock
    must not truncate the file the link names (nor create one), and says so in one line."""
    from lmprobe.base.lock import OutputLock, lock_path
    from lmprobe.errors import UnsafePathError

    victim = tmp_path / "victim.txt"
    victim.write_text("my thesis")
    lock_path(tmp_path / "ds").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="link") as err:
        OutputLock(tmp_path / "ds").acquire()
    assert "\n" not in str(err.value)
    assert victim.read_text() == "my thesis"
    lock_path(tmp_path / "ds2").symlink_to(tmp_path / "created")
    with pytest.raises(UnsafePathError):
        OutputLock(tmp_path / "ds2").acquire()
    assert not (tmp_path / "created").exists()
