"""``python -m lmprobe.sae ARGS``: the dictionary document's smoke test, the same as ``lmprobe sae-topk ARGS``.

It hands over to the command line as a new program (``python -m lmprobe sae-topk ARGS``) rather than importing it:
the command line sits on top of the package, and nothing below it imports it."""

import os
import subprocess
import sys

command = [sys.executable, "-m", "lmprobe", "sae-topk", *sys.argv[1:]]
if os.name == "nt":  # Windows' exec starts a new process and returns at once: wait for its exit status instead
    raise SystemExit(subprocess.call(command))
os.execv(sys.executable, command)
