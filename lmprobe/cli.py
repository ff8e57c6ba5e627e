"""The ``lmprobe`` command line: argument parsing only; every command calls the Python API."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .errors import LmprobeError


def _cmd_validate(args: argparse.Namespace) -> int:
    from .format.validate import validate

    worst = 0
    for path in args.paths:
        report = validate(path, checksums=not args.no_checksums)
        print(report)
        if not report.ok or (args.strict and report.warnings):
            worst = 1
    return worst


def _cmd_info(args: argparse.Namespace) -> int:
    from .format.reader import load
    from .units import format_size

    ds = load(args.path)
    info = ds.info
    h = info["tensors"].get("hidden_layers", {})
    lines = [
        f"dataset      {args.path}",
        f"format       lmprobe {info['format_version']}",
        f"model        {ds.model.get('name')} (revision {ds.model.get('revision') or 'unknown'})",
        f"prompts      {ds.num_prompts} ({info.get('prompt_ordering', '?')} order)",
    ]
    labels = ds.labels
    if labels is not None:
        import collections

        counts = collections.Counter(labels.tolist())
        shown = ", ".join(f"{k!r}: {v}" for k, v in sorted(counts.items(), key=lambda kv: str(kv[0]))[:10])
        lines.append(f"labels       {len(counts)} classes ({shown}{', ...' if len(counts) > 10 else ''})")
    else:
        lines.append("labels       none")
    if h:
        layers = h["layers"]
        lines += [
            f"layers       {len(layers)}: {layers if len(layers) <= 12 else str(layers[:6])[:-1] + ', ..., ' + str(layers[-1]) + ']'}",
            f"hidden       dim {h['dim']}, {h['dtype']}, {h['storage']}"
            + (f" ({h.get('last_token_shards')} last-token + {len(h['shards']) - h.get('last_token_shards', 0)} sequence shards)"
               if h["storage"] == "full_sequence" else f" ({len(h['shards'])} shards per layer)"),
        ]
        if h["storage"] == "full_sequence":
            lines.append(f"tokens       {int(ds.token_lengths().sum())}")
    lg = info["tensors"].get("logits_topk")
    if lg:
        lines.append(f"logits       top-{lg['k']} at the last token ({len(lg['shards'])} shards)")
    core = {"text", "label", "num_tokens", "shard_index", "row_offset"}
    extra = [c for c in ds.table.column_names if c not in core]
    lines.append(f"columns      {', '.join(extra) if extra else '(core columns only)'}")
    prov = info.get("provenance") or {}
    lines.append(
        f"made with    lmprobe {prov.get('lmprobe_version')}, backend {prov.get('extraction_backend')}, "
        f"torch {prov.get('torch_version')}, transformers {prov.get('transformers_version')}, {prov.get('created_at')}"
    )
    root = Path(args.path)
    if root.is_dir():
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        lines.append(f"size         {format_size(size)} on disk")
    print("\n".join(lines))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import write_demo

    path = write_demo(args.out, overwrite=args.overwrite)
    print(f"wrote a synthetic demo dataset to {path}")
    return _cmd_info(argparse.Namespace(path=str(path)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmprobe",
        description="Extract language-model activations into the lmprobe dataset format 2.0, publish and read them.",
    )
    parser.add_argument("--version", action="version", version=f"lmprobe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("validate", help="check datasets against the format document")
    p.add_argument("paths", nargs="+", metavar="PATH", help="dataset folder(s)")
    p.add_argument("--no-checksums", action="store_true", help="skip sha256 checks (faster on large datasets)")
    p.add_argument("--strict", action="store_true", help="fail on warnings too")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("info", help="print a summary of a dataset")
    p.add_argument("path", metavar="PATH")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("demo", help="write a small synthetic dataset (no model needed)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LmprobeError as exc:
        print(f"lmprobe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lmprobe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
