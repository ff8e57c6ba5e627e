"""Fast answers: the wall time of `lmprobe --help`, of an argument error, and of learning a
dataset's special token ids, each in a fresh process, against the path that loads transformers (the baseline,
measured in the same run).

    PYTHONPATH=$PWD python benchmarks/bench_cli.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = str(ROOT / "examples" / "prompts.jsonl")


def wall(code_or_args: list[str], repeat: int) -> float:
    """The best wall time of ``python ARGS`` over ``repeat`` fresh processes (a warm page cache)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, *code_or_args], capture_output=True, env=env, check=False)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    n = ap.parse_args().repeat
    out = tempfile.mkdtemp()
    python = wall(["-c", "pass"], n)
    help_s = wall(["-m", "lmprobe", "--help"], n)
    error_s = wall(["-m", "lmprobe", "extract", "--model", "lmprobe-tiny", "--prompts", PROMPTS, "--out",
                    f"{out}/x", "--layers", "9"], n)
    # the baseline: what the layer check cost before, the config read through transformers
    config_s = wall(["-c", "from lmprobe.extraction.model import read_model_spec; read_model_spec('lmprobe-tiny')"], n)
    ids_s = wall(["-c", "from lmprobe.base.tokenizer import special_token_ids; special_token_ids('lmprobe-tiny')"], n)
    tok_s = wall(["-c", "from lmprobe.base.tokenizer import resolve_tokenizer as r; r('lmprobe-tiny').all_special_ids"],
                 n)
    print(f"python -c pass                            {python:6.2f} s")
    print(f"lmprobe --help                            {help_s:6.2f} s")
    print(f"extract --layers 9 (6 layers): the error  {error_s:6.2f} s   baseline, the config through "
          f"transformers: {config_s:6.2f} s  ({config_s / error_s:.1f}x)")
    print(f"special token ids from the files          {ids_s:6.2f} s   baseline, the tokenizer through "
          f"transformers: {tok_s:6.2f} s  ({tok_s / ids_s:.1f}x)")


if __name__ == "__main__":
    main()
