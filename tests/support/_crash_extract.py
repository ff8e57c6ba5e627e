"""Runs lmprobe.extract and dies (os._exit, like kill -9: no cleanup) after a chosen number of forward passes.

Used by test_extract_resume.py and test_corpus.py:
    python _crash_extract.py '[SOURCE, MODEL, OUT, DIE_AFTER, KWARGS]'
SOURCE is anything lmprobe.extract takes as prompts (a path, or a list of prompts).
"""

import json
import os
import sys

import lmprobe
from lmprobe.extraction import backend_hf

source, model, out, die_after, kw = json.loads(sys.argv[1])
real, calls = backend_hf.TransformersBackend.run, [0]


def run(self, *a, **k):
    calls[0] += 1
    if calls[0] > die_after:
        os._exit(9)  # like kill -9: no cleanup, the writer thread dies mid-batch
    return real(self, *a, **k)


backend_hf.TransformersBackend.run = run
lmprobe.extract(model, source, out=out, checkpoint_interval=0, **kw)
