"""Runs lmprobe.extract to a Hub output and dies (os._exit, like kill -9: no cleanup) right after the commit that
lands a checkpoint copy (storage/hubresume.py) of at least a chosen number of rows: a deterministic kill point
for resuming on another machine, whatever the commits' timing.

    python _crash_after_copy.py '[SOURCE, MODEL, OUT, MIN_ROWS, KWARGS]'
"""

import json
import os
import sys

import lmprobe
from lmprobe.storage import hubresume

source, model, out, min_rows, kw = json.loads(sys.argv[1])
checkpointed, landed, rows = hubresume.CheckpointCopies.checkpointed, hubresume.CheckpointCopies.landed, {}


def checkpointed_counting(self, staging, state, files):
    if state.get("phase") == "writing" and self._waiting is None:  # a copy is made of this checkpoint
        self.made_rows = state["num_prompts"]
    sent = checkpointed(self, staging, state, files)
    for f in sent:  # the copy handed to the committer (made now or at an earlier checkpoint): its rows
        rows[id(f)] = self.made_rows
    return sent


def landed_then_die(self, files):
    landed(self, files)
    if any(rows.get(id(f), 0) >= min_rows for f in files):
        os._exit(9)  # like kill -9, right after the commit that holds the copy


hubresume.CheckpointCopies.checkpointed = checkpointed_counting
hubresume.CheckpointCopies.landed = landed_then_die
lmprobe.extract(model, source, out=out, checkpoint_interval=0, **kw)
sys.exit(1)  # finished without landing such a copy
