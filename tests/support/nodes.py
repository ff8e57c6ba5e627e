"""Simulated nodes for multi-machine tests: torchrun on 127.0.0.1 with the c10d rendezvous, each node in a working,
temporary and cache folder of its own (nothing shared between nodes but the network)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_home(root: Path, node: int) -> Path:
    home = root / f"node{node}"
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return home


def launch(root: Path, argv: list[str], *, nodes: int = 2, per_node: int = 1, env: dict | None = None,
           module: str = "lmprobe") -> list[subprocess.Popen]:
    """Start ``nodes`` torchrun agents (``per_node`` ranks each) running ``python -m module argv``."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    procs = []
    for node in range(nodes):
        home = node_home(root, node)
        e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
        e.update(LMPROBE_CACHE=str(home / "cache"), TMPDIR=str(home / "tmp"), OMP_NUM_THREADS="1",
                 PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), e.get("PYTHONPATH", "")]))
        e.update(env or {})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(node),
             "--nproc_per_node", str(per_node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
             "--rdzv_id", run_id, "--rdzv_conf", f"is_host={int(node == 0)}", "--max_restarts", "0",
             "-m", module, *argv], cwd=home, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True))
    return procs


def wait(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    """Every node's output; an AssertionError with the output when one failed."""
    outs = []
    for p in procs:
        text = p.communicate(timeout=timeout)[0]
        assert p.returncode == 0, text[-4000:]
        outs.append(text)
    return outs


def run(root: Path, argv: list[str], **kw) -> list[str]:
    return wait(launch(root, argv, **kw))


def kill_when(procs: list[subprocess.Popen], ready, timeout: float = 300) -> None:
    """SIGKILL every process group of ``procs`` (agents and ranks) once ``ready()`` is true."""
    t0 = time.monotonic()
    while not ready():
        if time.monotonic() - t0 > timeout or any(p.poll() is not None for p in procs):
            raise AssertionError("the run ended (or took too long) before it could be killed: "
                                 + "".join(p.communicate()[0][-2000:] for p in procs if p.poll() is not None))
        time.sleep(0.05)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.communicate()


def disk_use(folder: Path, pattern: str = "*") -> int:
    """Bytes of the files under ``folder`` whose names match ``pattern`` (files that vanish meanwhile: none)."""
    total = 0
    try:
        for p in folder.rglob(pattern):
            try:
                total += p.stat().st_size if p.is_file() else 0
            except FileNotFoundError:
                pass
    except FileNotFoundError:  # a folder removed while it was walked
        pass
    return total


def found(folder: Path, pattern: str) -> bool:
    """Whether a file named like ``pattern`` is under ``folder`` now (folders that vanish meanwhile: no)."""
    try:
        return any(True for _ in folder.rglob(pattern))
    except FileNotFoundError:
        return False


class Peak:
    """The largest shard data (``*.safetensors*``) seen under each of some folders while a run goes (polled every
    ``every`` seconds): the index parts and checkpoints beside them grow with the rows, as the index itself does."""

    def __init__(self, folders, every: float = 0.02):
        self.folders, self.peaks, self._stop = list(folders), [0] * len(folders), threading.Event()
        self.every = every
        self._t = threading.Thread(target=self._poll, daemon=True)

    @property
    def peak(self) -> int:
        """The largest of the folders' peaks."""
        return max(self.peaks)

    def _poll(self):
        while not self._stop.is_set():
            for i, f in enumerate(self.folders):
                self.peaks[i] = max(self.peaks[i], disk_use(f, "*.safetensors*"))
            self._stop.wait(self.every)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
