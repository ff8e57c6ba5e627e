"""Settings written once: a dataclass field's docstring and command-line hints, read back by every front end.

A settings class (``ExtractionConfig``) documents each field with a string literal under it, as
sparsify's and simple_parsing's configs do, and marks the command-line side with
``option(default, group=...)``. From that one place, :func:`field_docs` gives each field's text
(the Python API's signature and docstring, the command line's ``--help``), and :func:`cli_of`
what the command line needs beyond the type and the default (the group in ``--help``, a metavar).

>>> from dataclasses import dataclass, fields
>>> @dataclass
... class Settings:
...     size: int = option(8, group="work", metavar="N")
...     '''How many at once.'''
>>> cli_of(fields(Settings)[0])
CommandLine(group='work', metavar='N')

(:func:`field_docs` reads the class's source file, so ``Settings`` would have to live in one.)
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import MISSING, Field, dataclass, field, fields
from functools import cache
from itertools import pairwise
from typing import Any

__all__ = ["CommandLine", "Recorded", "cli_of", "command_line_text", "field_docs", "option", "plain_text", "recorded_of", "settings_doc",
           "settings_signature", "spec_names_of"]


@dataclass(frozen=True)
class CommandLine:
    """How a field appears on the command line (type, default and help come from the field itself)."""

    group: str
    """The heading it is listed under in ``--help``."""
    metavar: str | None = None
    """The value's name in ``--help`` (``N``, ``DIR``); None: the option's own name."""


@dataclass(frozen=True)
class Recorded:
    """How a field is recorded in the settings a dataset keeps (``lmprobe:extraction``'s ``settings``), which a
    re-run compares to decide whether a partial output resumes."""

    place: int
    """Its place among the recorded settings: the written order, kept so that the bytes of the metadata (and so
    a dataset's sha256) do not change when a field is added or moved."""
    when: str = "always"
    """``always``, or only for a ``prompts`` or a ``corpus`` extraction."""


def option(default: Any = MISSING, *, group: str, metavar: str | None = None, record: int | None = None,
           record_when: str = "always", spec: tuple[str, ...] = ()) -> Any:
    """A dataclass field with ``default`` that the command line lists under ``group``; ``record``: its place in the
    recorded settings (:class:`Recorded`, only for ``record_when``); ``spec``: the fields of the dataset's
    description (``format.datasetspec.DatasetSpec``) that take its value."""
    meta: dict[str, Any] = {"cli": CommandLine(group, metavar), "spec": tuple(spec)}
    if record is not None:
        meta["record"] = Recorded(record, record_when)
    if default is MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


def cli_of(f: Field) -> CommandLine:
    """The command-line side of a field made with :func:`option`."""
    return f.metadata["cli"]


def recorded_of(f: Field) -> Recorded | None:
    """How a field made with :func:`option` is recorded in a dataset's settings; None: it is not."""
    return f.metadata.get("record")


def spec_names_of(f: Field) -> tuple[str, ...]:
    """The fields of a dataset's description that take the value of a field made with :func:`option`."""
    return f.metadata.get("spec", ())


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), dedented; "" where none."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return {f.name: docs.get(f.name, "") for f in fields(cls)}


def plain_text(doc: str) -> str:
    """A docstring as one line of plain text (for ``--help``): reST literals unquoted, whitespace folded.

    >>> plain_text("Stop at ``max_tokens``\\n   tokens.")
    'Stop at max_tokens tokens.'
    """
    return re.sub(r"\s+", " ", doc.replace("``", "")).strip()


def command_line_text(doc: str) -> str:
    """A field's docstring as the command line says it: without its paragraphs that begin "In Python" (values only
    Python can pass, such as a list or a DataFrame), as one line of plain text.

    >>> command_line_text("A file or a folder.\\n\\nIn Python also a list of strings.")
    'A file or a folder.'
    """
    kept = [part for part in re.split(r"\n\s*\n", doc) if not part.strip().startswith("In Python")]
    return plain_text("\n\n".join(kept))


def settings_signature(func: Any, settings: type) -> inspect.Signature:
    """``func``'s signature with its ``**options`` spelled out as the keyword-only fields of ``settings`` (with their
    defaults and types), for ``help()``, notebooks' tooltips and ``inspect``; the fields ``func`` names itself keep
    their place."""
    sig = inspect.signature(func)
    own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    named = {p.name for p in own}
    spelled = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                                 default=inspect.Parameter.empty if f.default is MISSING else f.default)
               for f in fields(settings) if f.name not in named]
    return sig.replace(parameters=[*own, *spelled])


def settings_doc(settings: type, *, skip: tuple[str, ...] = ()) -> str:
    """The fields of ``settings`` as a docstring section: ``name (default): text`` each, from their docstrings."""
    docs = field_docs(settings)
    lines = ["", "", "    Options:"]
    for f in fields(settings):
        if f.name in skip:
            continue
        default = "" if f.default is MISSING else f" (default {f.default!r})"
        lines.append(textwrap.fill(f"{f.name}{default}: {plain_text(docs[f.name])}", width=100,
                                   initial_indent="        ", subsequent_indent="            "))
    return "\n".join(lines) + "\n"
