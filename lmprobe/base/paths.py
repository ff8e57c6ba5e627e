"""Turning untrusted file and key patterns into paths that stay inside the dataset root.

Metadata read from a dataset is untrusted: ``file_pattern`` is a Python format string, and
``str.format`` happily evaluates ``{layer.__class__}`` or ``{shard[0]}``. We accept only bare
``{layer}``/``{shard}`` fields with an integer format spec, and refuse any resulting path that is
absolute, climbs with ``..``, or resolves (through symlinks) outside the root.
"""

from __future__ import annotations

import os
import re
import string
from pathlib import Path, PurePosixPath

from ..errors import InvalidArgumentError, OutputExistsError, UnsafePathError

_SPEC_RE = re.compile(r"^(0?[1-9]\d?)?d?$")  # integer widths such as "03d"


def check_pattern(pattern: object, allowed: tuple[str, ...], what: str) -> str:
    """Check that ``pattern`` is a plain format string over ``allowed`` fields; return it.

    >>> check_pattern("tensors/h{layer:03d}_{shard:03d}.safetensors", ("layer", "shard"), "file_pattern")
    'tensors/h{layer:03d}_{shard:03d}.safetensors'
    """
    if not isinstance(pattern, str) or not pattern:
        raise UnsafePathError(f"{what} must be a non-empty string, got {pattern!r}")
    if "\x00" in pattern or "\\" in pattern:
        raise UnsafePathError(f"{what} {pattern!r} contains a NUL byte or a backslash")
    try:
        parts = list(string.Formatter().parse(pattern))
    except ValueError as exc:
        raise UnsafePathError(f"{what} {pattern!r} is not a valid format string: {exc}") from None
    for _literal, field, spec, conversion in parts:
        if field is None:
            continue
        if field not in allowed:
            raise UnsafePathError(
                f"{what} {pattern!r} uses the field {{{field}}}; only "
                + ", ".join(f"{{{a}}}" for a in allowed)
                + " are allowed (no attribute or index access)"
            )
        if conversion:
            raise UnsafePathError(f"{what} {pattern!r} uses a conversion (!{conversion}); none is allowed")
        if spec and not _SPEC_RE.match(spec):
            raise UnsafePathError(
                f"{what} {pattern!r} uses the format spec {spec!r}; only integer widths like '03d' are allowed"
            )
    return pattern


def check_relpath(rel: object, what: str) -> str:
    """Check that ``rel`` is a relative POSIX path without ``..`` components; return it."""
    if not isinstance(rel, str) or not rel:
        raise UnsafePathError(f"{what} must be a non-empty relative path, got {rel!r}")
    if "\x00" in rel or "\\" in rel:
        raise UnsafePathError(f"{what} {rel!r} contains a NUL byte or a backslash")
    p = PurePosixPath(rel)
    if p.is_absolute() or rel.startswith("/") or re.match(r"^[A-Za-z]:", rel):
        raise UnsafePathError(f"{what} {rel!r} is absolute; dataset files must be relative to the dataset root")
    if any(part == ".." for part in p.parts):
        raise UnsafePathError(f"{what} {rel!r} climbs out of the dataset root with '..'")
    if rel.endswith("/"):
        raise UnsafePathError(f"{what} {rel!r} names a folder, not a file")
    return rel


def format_relpath(pattern: str, what: str, **fields: int) -> str:
    """Format a checked pattern and check the result is a safe relative path."""
    return check_relpath(pattern.format(**fields), what)


def check_output_path(out: str | os.PathLike, what: str = "output") -> Path:
    """``out`` can be created or written: a local path (not a URL), no existing part of which is a file."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", os.fspath(out)):
        raise InvalidArgumentError(f"the {what} {out} is a URL, but this writes a local folder; write it locally and "
                                   "publish it with `lmprobe push` (extract alone writes to hf:// and s3:// directly)")
    p = Path(os.path.abspath(out))
    for parent in [p, *p.parents]:
        if parent.exists():
            if parent != p and not parent.is_dir():
                raise OutputExistsError(f"{parent} is a file, so the {what} {out} cannot be created under it; "
                                        "choose another location")
            break
    return p


def resolve_inside(root: Path, rel: str, what: str) -> Path:
    """Join ``rel`` to ``root`` and refuse it if it resolves (symlinks included) outside ``root``."""
    check_relpath(rel, what)
    root_real = Path(os.path.realpath(root))
    target = Path(os.path.realpath(root_real / rel))
    if target != root_real and root_real not in target.parents:
        raise UnsafePathError(f"{what} {rel!r} resolves to {target}, outside the dataset root {root_real}")
    return target
