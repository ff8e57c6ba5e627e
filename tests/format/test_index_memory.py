"""A rank's writer at corpus scale: its memory does not grow with the tokens it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT

WRITE = r"""
import json, resource, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[1])
from lmprobe.format.writer import DatasetWriter
out, n_tokens = Path(sys.argv[2]), int(float(sys.argv[3]))
per, batch = 1024, 8
rng = np.random.default_rng(0)
h = np.zeros((per * batch, 8), np.float32)
ids = [rng.integers(0, 128000, size=per) for _ in range(batch)]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with DatasetWriter(out, layers=[0], dim=8, model_name="m", storage="full_sequence", corpus=True, token_ids=True,
                   shard_size="64MB", checkpoint_interval=3600) as w:
    for s in range(0, n_tokens // per, batch):  # windows of 1,024 tokens with ~4 KB of text, as a corpus's
        w.add_batch(texts=[f"window {s + i} " + "lorem ipsum " * 340 for i in range(batch)],
                    num_tokens=[per] * batch, hidden={0: h}, document=list(range(s, s + batch)),
                    window_start=[0] * batch, token_ids=ids)
    writing = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"writing_mib": (writing - base) / 1024,
                  "close_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}))
"""


def writer_peak(tmp_path: Path, n_tokens: float) -> dict:
    r = subprocess.run([sys.executable, "-c", WRITE, str(ROOT), str(tmp_path / f"{n_tokens:g}"), str(n_tokens)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # subprocesses writing 3 M tokens
def test_a_writers_memory_stays_flat_from_6e5_to_2_4e6_tokens(tmp_path):
    """The sizes of the issue's two-node measurement (the non-merging rank grew 49-74 MiB): the writer's
    pending index rows (window text and token ids) now fill their bound well before 6 x 10^5 tokens."""
    small, big = writer_peak(tmp_path, 6e5), writer_peak(tmp_path, 2.4e6)
    assert big["writing_mib"] - small["writing_mib"] < 16, (small, big)
    assert big["close_mib"] - small["close_mib"] < 16, (small, big)
