"""Every module's doctests run and pass: an example in a docstring is a promise to the reader.

An example that cannot run here (it needs a model download, the Hub, a GPU) says ``# doctest: +SKIP``.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import lmprobe

PKG = Path(lmprobe.__file__).parent


def _modules() -> list[str]:
    out = []
    for p in sorted(PKG.rglob("*.py")):
        if p.name == "__main__.py":  # importing an entry point runs the command line
            continue
        rel = p.relative_to(PKG.parent).with_suffix("")
        out.append(".".join(rel.parts[:-1] if p.name == "__init__.py" else rel.parts))
    return out


@pytest.mark.parametrize("name", _modules())
def test_the_modules_doctests_pass(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, report=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} doctest examples fail (see the " \
                               "captured output above)"
