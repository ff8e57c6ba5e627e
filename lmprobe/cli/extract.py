"""The command line's extraction: ``extract`` and ``hookpoints``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .. import api
from ..base.display import escape_controls
from ..errors import InvalidArgumentError
from ..extraction.config import ExtractionConfig
from ..extraction.runner import execute, rows_text
from ..storage.hub import check_repo_id
from .options import (
    count,
    positive_int,
)


def cmd_extract(args: argparse.Namespace) -> int:
    if args.push:
        check_repo_id(args.push)  # before hours of extraction, not after
        if "://" in str(args.out):
            raise InvalidArgumentError(f"--push publishes the local folder --out names, and --out {args.out} is not "
                                       f"one; write straight to the Hub with --out hf://datasets/{args.push} instead")
    settings = {name: getattr(args, name) for name in ExtractionConfig.field_names() if hasattr(args, name)}
    cfg = ExtractionConfig(**settings, statistics=not args.no_statistics)
    outcome = execute(cfg)
    ds = outcome.dataset
    if outcome.wrote and not args.quiet:  # else the runner said it had nothing to do
        print(f"wrote {rows_text(ds, corpus=cfg.corpus)} ({ds.storage}, {ds.dtype}) to {args.out}")
    if args.push:
        api.push_to_hub(args.out, args.push, private=args.private, token=args.token, quiet=args.quiet)
    return 0


def cmd_hookpoints(args: argparse.Namespace) -> int:
    arch = api.hookpoints(args.model, revision=args.revision, trust_remote_code=args.trust_remote_code,
                          block_path=args.block_path)
    print(escape_controls(arch.describe()))
    return 0


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this group's subcommands through ``command(name, **kwargs)`` (the parser's add_parser)."""
    p = command(
        "extract",
        help="run a model over prompts and write an lmprobe dataset",
        description="Run MODEL over the prompts in SOURCE and store hidden states (and optionally top-k logits and "
        "perplexity) as an lmprobe dataset in DIR. Re-running after an interruption resumes.",
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, help="local model folder, Hub id, or lmprobe-tiny (the embedded model)")
    g.add_argument("--revision", default=None, help="model revision (branch, tag or commit) on the Hub (default: main)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow the model repo's own Python code to run")
    g.add_argument("--block-path", default=None,
                   help="attribute path of the decoder block list, for unknown architectures (default: found by name)")
    g.add_argument("--backend", choices=["transformers", "nnsight"], default="transformers",
                   help="transformers: hooks on a local model; nnsight: an nnsight trace")
    g.add_argument("--remote", action="store_true",
                   help="with --backend nnsight: run on NDIF (API key from NNSIGHT_API_KEY or nnsight's config)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--compute-dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="dtype the model runs in (auto: float32 on CPU, the checkpoint's dtype on GPU)")
    g.add_argument("--batch-size", type=positive_int, default=8, metavar="N", help="prompts per forward pass")
    g.add_argument("--max-length", type=positive_int, default=None, metavar="N",
                   help="longest prompt in tokens (default: the model's)")
    g.add_argument("--truncate", choices=["left", "right"], default=None,
                   help="cut prompts longer than --max-length (left keeps the end) instead of failing (default: fail)")
    g = p.add_argument_group("input")
    g.add_argument("--prompts", required=True, metavar="SOURCE",
                   help="a .jsonl, .csv, .tsv, .parquet or .txt file (one per line), a folder of them, or a Hugging Face "
                   "dataset (hf://datasets/OWNER/NAME or OWNER/NAME)")
    g.add_argument("--text-column", default="text", help="column of SOURCE that holds the prompt text")
    g.add_argument("--label-column", default="label", help="label column (int or string); optional when 'label'")
    g.add_argument("--dataset-config", default=None, metavar="NAME", help="configuration of a Hugging Face dataset source")
    g.add_argument("--split", default="train", help="split of a Hugging Face dataset source")
    g.add_argument("--chat-template", action="store_true",
                   help="wrap each prompt in the tokenizer's chat template; store only the prompt's own tokens")
    g = p.add_argument_group("corpus extraction (one row per window of a long text)")
    g.add_argument("--context-len", type=positive_int, default=None, metavar="T",
                   help="cut every document into windows of at most T tokens, one row each (default: the model's "
                   "length when --max-tokens is given)")
    g.add_argument("--max-tokens", type=count, default=None, metavar="N",
                   help="stop at exactly N stored tokens, e.g. 50M (windows of the model's length unless --context-len)")
    g.add_argument("--no-special-tokens", dest="special_tokens", action="store_false",
                   help="add no special tokens (BOS, ...) to the windows")
    g = p.add_argument_group("what to store")
    g.add_argument("--layers", default="all", help="'all', '0,3,-1', ranges like '10:20' (Python slice: 10..19)")
    g.add_argument("--hookpoints", default="resid_post",
                   help="where in each block to read, a comma list: resid_pre, attn_out, resid_mid, mlp_in, mlp_out, "
                   "resid_post, or a module path in the block with :input/:output, e.g. mlp.act_fn:output")
    g.add_argument("--storage", choices=["pooled", "full_sequence"], default="pooled",
                   help="pooled: last token only; full_sequence: every token")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32", help="stored dtype")
    g.add_argument("--logits-topk", type=positive_int, default=None, metavar="K",
                   help="store the top-K logits at the last token (default: none)")
    g.add_argument("--perplexity", action="store_true", help="store per-prompt and per-token perplexity")
    g.add_argument("--token-strings", action="store_true", help="store decoded tokens (and token ids)")
    g.add_argument("--token-ids", action="store_true", help="store token ids")
    g.add_argument("--drop-special-tokens", action="store_true",
                   help="do not store the tokenizer's special tokens (BOS, EOS, ...); the model still sees them")
    g.add_argument("--no-statistics", action="store_true",
                   help="skip the running per-layer statistics (count, mean, std, mean norm)")
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, metavar="DIR", help="dataset folder to write (or to resume)")
    g.add_argument("--shard-size", default="1GiB", help="shard byte budget, e.g. 512MB, 1GiB (16GiB at most)")
    g.add_argument("--checkpoint-interval", type=float, default=30.0, metavar="SECONDS",
                   help="seconds between checkpoints: at most this much work is redone after an interruption")
    g.add_argument("--no-space-check", dest="space_check", action="store_false",
                   help="start even when the output's disk has less free space than the planned bytes")
    g.add_argument("--overwrite", action="store_true", help="replace an existing or partial output instead of resuming")
    g.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    g = p.add_argument_group("publishing")
    g.add_argument("--push", default=None, metavar="REPO", help="publish the dataset to this Hub dataset repo when done")
    g.add_argument("--private", action="store_true", help="with --push: create the repo private")
    g.add_argument("--token", default=None, help="with --push: Hub token (default: HF_TOKEN or the saved login)")
    p.set_defaults(func=cmd_extract)

    p = command("hookpoints", help="show where each named hookpoint is on every block of a model",
                description="Examine MODEL as `extract` does before the weights load (a miniature with random weights) "
                "and print, for each kind of block, how each named hookpoint is read or why it does not exist there.")
    p.add_argument("--model", required=True, help="local model folder, Hub id, or lmprobe-tiny (the embedded model)")
    p.add_argument("--revision", default=None, help="model revision (branch, tag or commit) on the Hub")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model repo's own Python code to run")
    p.add_argument("--block-path", default=None, help="attribute path of the decoder block list (default: found)")
    p.set_defaults(func=cmd_hookpoints)
