"""``python -m lmprobe.sae ARGS``: the dictionary document's smoke test, the same as ``lmprobe sae-topk ARGS``."""

import sys

from ..cli.app import main

raise SystemExit(main(["sae-topk", *sys.argv[1:]]))
