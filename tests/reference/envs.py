"""Second Python environments for interoperability tests, each made once and reused.

- ``.venv-ref``: the reference implementation, ``lmprobe==0.10.3`` from PyPI, with what its
  readers import (not transformers), for tests/format/test_reference_0103.py;
- ``.venv-interop``: SAELens and EleutherAI's sparsify, for tests/sae/test_sae_sources.py and
  tests/saelens/test_saelens.py; with orjson and Pillow, which saev's loader modules import (saev itself
  is vendored under tests/reference/saev: tests/saev/test_saev_interop.py).

``python tests/reference/envs.py`` makes both (.ci/run does, before the tests); the tests make
a missing one themselves. ``$LMPROBE_REF_VENV`` / ``$LMPROBE_INTEROP_VENV`` move them elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the CPU build (a plain `torch` would pull the CUDA one)
REFERENCE = ["lmprobe==0.10.3"]
REFERENCE_DEPS = ["numpy", "scikit-learn", "tqdm", "huggingface_hub", "packaging", "pyarrow", "safetensors"]
INTEROP = ["sae-lens==6.54.12", "eai-sparsify==1.3.3", "orjson==3.13.0", "pillow==13.0.0"]


def _works(python: Path, check: str) -> bool:
    # -I: not the checkout's own lmprobe, which the current folder would put first on sys.path
    return python.exists() and subprocess.run([str(python), "-I", "-c", check], capture_output=True).returncode == 0


def _make(where: Path, check: str, steps: list[list[str]]) -> Path:
    python = where / "bin" / "python"
    if _works(python, check):
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(where)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for step in steps:
        subprocess.run([*pip, *step], check=True)
    if not _works(python, check):
        raise RuntimeError(f"{where} was made but `{check}` fails in it")
    return python


def reference_python() -> Path:
    where = Path(os.environ.get("LMPROBE_REF_VENV", ROOT / ".venv-ref"))
    return _make(where, "import lmprobe, sys; sys.exit(lmprobe.__version__ != '0.10.3')",
                 [[TORCH], ["--no-deps", *REFERENCE], REFERENCE_DEPS])


def interop_python() -> Path:
    where = Path(os.environ.get("LMPROBE_INTEROP_VENV", ROOT / ".venv-interop"))
    return _make(where, "import sae_lens, sparsify, orjson, PIL", [[TORCH], INTEROP])


if __name__ == "__main__":
    print(reference_python())
    print(interop_python())
