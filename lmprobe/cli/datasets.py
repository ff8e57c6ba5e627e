"""The command line's datasets as they are: ``merge``, ``validate``, ``info``, ``demo``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from .. import api
from ..base.display import escape_controls
from ..format.demo import write_demo
from ..opening import is_remote, load
from ..pages import summary
from ..sae.loader import is_dictionary_folder, validate_dictionary
from ..saev import is_saev_folder, validate_saev


def cmd_merge(args: argparse.Namespace) -> int:
    api.merge(args.parts, args.out, overwrite=args.overwrite)
    print(f"merged {len(args.parts)} datasets into {args.out}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    worst = 0
    for path in args.paths:
        problems, kind = None, ""
        if is_saev_folder(path):
            problems, kind = validate_saev(path, check_sizes=True), "saev"
        elif is_dictionary_folder(path):
            problems, kind = validate_dictionary(Path(path).parent, Path(path).name), "SAE dictionary"
        if problems is not None:
            print(f"{path}: {kind} {'OK' if not problems else 'INVALID'} ({len(problems)} problem(s))")
            for p in problems:
                print(f"  error: {escape_controls(p, keep_newlines=False)}")
            worst = max(worst, 1 if problems else 0)
            continue
        summary.check_not_a_dump_folder(path, "validate")
        report = api.validate(path, checksums=not args.no_checksums)
        print(escape_controls(report))
        if not report.ok or (args.strict and report.warnings):
            worst = 1
    return worst


def cmd_info(args: argparse.Namespace) -> int:
    text = summary.artefact_text(args.path) if not is_remote(args.path) else None  # a saev export, a dictionary
    if text is None:
        summary.check_not_a_dump_folder(args.path, "info")
        text = summary.text(load(args.path), path=args.path)
    print(text)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    path = write_demo(args.out, overwrite=args.overwrite)
    print(f"wrote a synthetic demo dataset to {path}")
    return cmd_info(argparse.Namespace(path=str(path)))


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this group's subcommands through ``command(name, **kwargs)`` (the parser's add_parser)."""
    p = command("merge", help="combine datasets made by independent jobs with the same model and settings")
    p.add_argument("parts", nargs="+", metavar="PART", help="dataset folders, in the order their prompts should appear")
    p.add_argument("--out", required=True, metavar="DIR", help="folder of the merged dataset (shards are linked, "
                   "not copied)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in DIR")
    p.set_defaults(func=cmd_merge)

    p = command("validate", help="check datasets against the format document")
    p.add_argument("paths", nargs="+", metavar="PATH", help="dataset folder(s)")
    p.add_argument("--no-checksums", action="store_true", help="skip sha256 checks (faster on large datasets)")
    p.add_argument("--strict", action="store_true", help="fail on warnings too")
    p.set_defaults(func=cmd_validate)

    p = command("info", help="print a summary of a dataset")
    p.add_argument("path", metavar="PATH", help="dataset folder, Hub repo or fsspec URL")
    p.set_defaults(func=cmd_info)

    p = command("demo", help="write a small synthetic dataset (no model needed)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the dataset into")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in DIR")
    p.set_defaults(func=cmd_demo)
