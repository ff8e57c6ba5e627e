"""Runs lmprobe.extract to a Hub repo and dies (os._exit, like kill -9) in the commit tail: after the writer closed,
either as the session starts its final commit (``before``) or while that commit is sent (``while``), or as it starts
its final commit with the sequence shards still staged under their provisional names, never sent (``unsent``: their
uploads cut short).

Used by test_hub_output.py:
    python _crash_tail.py '[SOURCE, MODEL, OUT, WHEN, KWARGS]'
"""

import json
import os
import sys

import lmprobe
from lmprobe.storage import commits

source, model, out, when, kw = json.loads(sys.argv[1])
finish, commit, add = commits.HubCommitter.finish, commits.HubCommitter._commit, commits.HubCommitter.add


def unsent_add(self, file):
    if when == "unsent" and "/.provisional/" in file.local.as_posix():
        return None  # stays staged
    return add(self, file)


def dying_finish(self, *a, **k):
    if when in ("before", "unsent"):
        os._exit(9)
    return finish(self, *a, **k)


def dying_commit(self, batch, message, **k):
    if when == "while" and "index" in message:
        os._exit(9)
    return commit(self, batch, message, **k)


commits.HubCommitter.finish, commits.HubCommitter._commit = dying_finish, dying_commit
commits.HubCommitter.add = unsent_add
lmprobe.extract(model, source, out=out, checkpoint_interval=0, **kw)
