"""Runs lmprobe.extract and holds it right after its first commit landed (with a job marker: the marker's commit): writes FLAG, then waits until GO exists (at most 300 s, then exits 3), then goes on. Used by
test_concurrent_jobs.py:
    python _held_extract.py '[SOURCE, MODEL, OUT, KWARGS, FLAG, GO]'
"""

import json
import os
import sys
import time
from pathlib import Path

from huggingface_hub import HfApi

import lmprobe

source, model, out, kw, flag, go = json.loads(sys.argv[1])
real, held = HfApi.create_commit, []


def create_commit(self, *a, **k):
    info = real(self, *a, **k)
    if not held:
        held.append(True)
        Path(flag).write_text("committed")
        deadline = time.monotonic() + 300
        while not Path(go).exists():  # released by the test once the other job has run
            if time.monotonic() > deadline:
                os._exit(3)  # (from any thread)
            time.sleep(0.05)
    return info


HfApi.create_commit = create_commit
lmprobe.extract(model, source, out=out, **kw)
