"""A dead torchrun peer is one line, found early; every node shows its own rank's progress.

The watcher (extraction/torchrun.py, PeerWatch) is tested against a store in memory; the two-node test runs
torchrun on 127.0.0.1 (tests/support/nodes.py), SIGKILLs one node in the middle of its share and reads the
other's output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from support.datasets import PROMPTS

from lmprobe.errors import PeerStoppedError
from lmprobe.extraction.torchrun import PeerWatch, peer_stopped


class MemoryStore:
    """The three calls of a c10d store the watcher makes, in memory, shared by the ranks of one test."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.down = False

    def add(self, key: str, n: int) -> int:
        with self.lock:
            if self.down:
                raise RuntimeError("store gone")
            v = int(self.values.get(key, b"0")) + n
            self.values[key] = str(v).encode()
            return v

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.values[key]


def kill_node(agent: int) -> None:
    """SIGKILL a node: its torchrun agent and every process under it (the ranks run in sessions of their own, so a
    signal to the agent's process group does not reach them)."""
    def children(pid: int) -> list[int]:
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == pid:
                    out += [int(d), *children(int(d))]
        return out

    for pid in [agent, *children(agent)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _watch(store, rank, world, exits, timeout=0.6):
    return PeerWatch(rank, world, timeout, store=store, exit=lambda code: exits.append((rank, code)))


def _until(cond, limit=10.0):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < limit:
        time.sleep(0.05)


def test_a_peer_that_stops_beating_is_said_in_one_line_by_every_rank(capsys):
    store, exits = MemoryStore(), []
    watches = [_watch(store, r, 3, exits) for r in range(3)]
    for w in watches[:2]:  # rank 2 never beats: its process is gone
        w._thread.start()
    _until(lambda: len(exits) == 2)
    for w in watches[:2]:
        w._stop.set()
    assert sorted(exits) == [(0, 1), (1, 1)]  # rank 1 found it, rank 0 learned it from the flag
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("lmprobe extract: error: rank 2 stopped (") for line in err), err
    assert all(line.endswith("run the same command again on every node to resume") for line in err)


def test_a_peer_that_finished_is_not_dead_and_a_live_one_is_not_either(capsys):
    store, exits = MemoryStore(), []
    watches = [_watch(store, r, 3, exits) for r in range(3)]
    for w in watches:
        w._thread.start()
    watches[2].finish()  # rank 2 ended (its atexit): the others keep going
    time.sleep(2.0)  # more than three timeouts
    assert exits == [], capsys.readouterr().err
    for w in watches:
        w._stop.set()


def test_a_store_that_stops_answering_is_the_rendezvous_node_stopping(capsys):
    store, exits = MemoryStore(), []
    watch = _watch(store, 1, 2, exits)
    other = _watch(store, 0, 2, [])
    watch._thread.start(), other._thread.start()
    time.sleep(0.3)
    store.down = True
    _until(lambda: exits)
    watch._stop.set(), other._stop.set()
    assert exits == [(1, 1)]
    assert "rank 0 stopped (the node that hosts the job's rendezvous stopped answering)" in capsys.readouterr().err


def test_a_collective_that_lost_its_peer_is_one_line():
    exc = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                       "[127.0.0.1]:29781")
    stopped = peer_stopped(exc)
    assert isinstance(stopped, PeerStoppedError)
    assert str(stopped) == ("another rank of this job stopped (its connection closed); run the same command again on "
                            "every node to resume")
    assert peer_stopped(RuntimeError("CUDA out of memory")) is None  # a bug or another failure keeps its traceback


@pytest.mark.slow  # two torchrun nodes, model loads
def test_a_killed_node_is_one_line_on_the_other_found_early_and_every_node_shows_progress(llama_dir, tmp_path):
    from support.nodes import launch, run

    f = tmp_path / "prompts.jsonl"
    many = [dict(p, text=p["text"] + f" #{i}") for i in range(1800) for p in PROMPTS]  # 12,600: ~20 s a share
    f.write_text("\n".join(json.dumps(p) for p in many) + "\n")
    out = tmp_path / "shared" / "acts"
    argv = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", str(out), "--layers", "1",
            "--storage", "full_sequence", "--batch-size", "1", "--checkpoint-interval", "0"]
    env = {"LMPROBE_PEER_TIMEOUT": "6", "LMPROBE_PROGRESS_INTERVAL": "0"}
    procs = launch(tmp_path, argv, env=env)
    lines: list[list[str]] = [[], []]

    def read(i):
        for line in procs[i].stdout:
            lines[i].append(line)

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in (0, 1)]
    for r in readers:
        r.start()
    _until(lambda: all(any("extract rank" in x for x in ls) for ls in lines), limit=300)
    assert all(any("extract rank" in x for x in ls) for ls in lines), lines  # item 2: both nodes show progress
    victim = next(i for i in (0, 1) if any("extract rank 1/2" in x for x in lines[i]))
    survivor = 1 - victim
    kill_node(procs[victim].pid)
    killed_at = time.monotonic()
    procs[survivor].wait(timeout=240)
    took = time.monotonic() - killed_at
    readers[survivor].join(timeout=10)
    text = "".join(lines[survivor])
    assert procs[survivor].returncode != 0, text[-3000:]
    said = [x for x in lines[survivor] if "stopped (" in x]
    assert said and "rank 1 stopped" in said[0] and "run the same command again on every node to resume" in said[0], \
        text[-3000:]
    assert not re.search(r'File "[^"]*lmprobe/', text), text[-3000:]  # no traceback frame inside lmprobe
    assert "Connection closed by peer" not in text, text[-3000:]
    assert not any("wrote " in x for x in lines[survivor])  # it stopped before finishing its share
    assert took < 60, took  # found early: within the watch's timeout and a beat, not at the end of the share
    procs[victim].wait()
    # the same command again on every node resumes and finishes
    outs = run(tmp_path, argv, env={**env, "LMPROBE_PROGRESS_INTERVAL": "5"})  # nodes.wait reads one pipe at a time
    assert any("resuming after" in o for o in outs), outs


def test_a_store_never_reached_is_no_watch_not_a_false_stop(capsys):
    """Without a store to reach (another launcher), the watch gives up quietly: it never stops a healthy rank."""
    store, exits = MemoryStore(), []
    store.down = True
    watch = _watch(store, 1, 2, exits)
    watch._thread.start()
    watch._thread.join(timeout=10)
    assert exits == [] and not watch._thread.is_alive()
    assert "cannot watch the other ranks" in capsys.readouterr().err
