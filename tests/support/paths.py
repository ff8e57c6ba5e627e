"""Where things are: the checkout, the tests, this folder (the scripts tests start as subprocesses), test data."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"  # helper modules, and the scripts tests run in subprocesses (_crash_*.py, ...)
DATA = TESTS / "data"
REFERENCE = TESTS / "reference"  # third-party readers run in their own environments
FIXTURE_0103 = DATA / "lmprobe-0.10.3-pooled"
FIXTURE_0103_FULL = DATA / "lmprobe-0.10.3-full_sequence"  # per-token columns, written left-padded
