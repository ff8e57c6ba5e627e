"""The command line's looking at a dataset: ``probe``, ``report``, ``features``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .. import api
from ..opening import load
from ..probe import plot_sweep, sweep
from .options import (
    add_cache_option,
    add_quiet_option,
    hookpoint_list,
    open_source,
    positive_int,
    stored_layers,
)


def cmd_probe(args: argparse.Namespace) -> int:
    ds = load(args.dataset)
    layers = stored_layers(args.layers, ds.layers)
    hookpoints = hookpoint_list(args.hookpoints)
    table = sweep(ds, layers=layers, label_column=args.label_column, classifier=args.classifier, cv=args.cv,
                  pooling=args.pooling, seed=args.seed, hookpoints=hookpoints)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    best = table.loc[table["accuracy"].idxmax()]
    where = f"{best['hookpoint']} " if "hookpoint" in table.columns else ""
    print(f"best {where}layer {int(best['layer'])}: accuracy {best['accuracy']:.3f} +- {best['accuracy_std']:.3f} "
          f"({args.cv}-fold, {args.classifier}, {args.pooling})")
    if args.plot:
        plot_sweep(table, args.plot, title=f"{ds.model.get('name')}: {args.label_column} probe")
        print(f"wrote {args.plot}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    path = api.report(open_source(args.dataset, args.cache, args.quiet), args.out, prompts=args.prompts, sample=args.sample, tokenizer=args.tokenizer,
                      probe=not args.no_probe, quiet=args.quiet)
    if not args.quiet:  # the library says nothing: this is the one line
        print(f"wrote {path}")
    return 0


def cmd_features(args: argparse.Namespace) -> int:
    out = api.features(open_source(args.dataset, args.cache, args.quiet), args.sae, args.dict, args.layer, args.out, top=args.top,
                       hookpoint=args.hookpoint, memory=args.memory, pages=args.pages, tokenizer=args.tokenizer,
                       overwrite=args.overwrite, report=args.report, quiet=args.quiet)
    if not args.quiet:
        print(f"wrote {out / 'features.safetensors'}, {out / 'manifest.json'} and the browser {out / 'index.html'}")
    return 0


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this group's subcommands through ``command(name, **kwargs)`` (the parser's add_parser)."""
    p = command("probe", help="cross-validated linear probes per layer, as a table and a plot")
    p.add_argument("dataset", metavar="DATASET", help="dataset folder or Hub repo")
    p.add_argument("--layers", default="all", help="layers to probe: all, '16', '0,8,-1', '10:20'")
    p.add_argument("--label-column", default="label", help="index column holding the class of each prompt")
    p.add_argument("--classifier", choices=["logistic", "ridge"], default="logistic",
                   help="logistic regression or a ridge classifier (scikit-learn)")
    p.add_argument("--cv", type=positive_int, default=5, metavar="K", help="cross-validation folds")
    p.add_argument("--pooling", choices=["last_token", "mean"], default="last_token",
                   help="the vector of a prompt: its last token, or the mean of its tokens (needs a full_sequence "
                   "dataset)")
    p.add_argument("--hookpoints", default=None, help="sweep these stored hookpoints too, a comma list "
                   "(default: what hidden_layers holds)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fold split and the classifier")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write accuracy against layer to this image (default: no plot)")
    p.set_defaults(func=cmd_probe)

    p = command("report", help="a self-contained HTML page about a dataset: facts, plots, prompts, labels")
    p.add_argument("dataset", metavar="DATASET", help="dataset folder, Hub repo or fsspec URL")
    p.add_argument("--out", required=True, metavar="DIR", help="writes DIR/index.html")
    p.add_argument("--prompts", default=None, metavar="ROWS", help="prompts to show besides the sample, e.g. 3,17 "
                   "(default: none)")
    p.add_argument("--sample", type=int, default=8, metavar="N", help="random prompts to show")
    p.add_argument("--tokenizer", default=None, help="decodes token ids (default: the dataset's model, if it loads)")
    p.add_argument("--no-probe", action="store_true", help="skip the probe sweep of labelled datasets")
    add_cache_option(p)
    add_quiet_option(p)
    p.set_defaults(func=cmd_report)

    p = command("features", help="run an SAE dictionary over every stored token: feature cache and browser")
    p.add_argument("dataset", metavar="DATASET", help="a full_sequence dataset (folder, Hub repo or fsspec URL)")
    p.add_argument("--sae", required=True, metavar="ROOT", help="folder (or hf:// repo) holding the dictionary")
    p.add_argument("--dict", required=True, metavar="NAME", help="dictionary name")
    p.add_argument("--layer", required=True, type=int, help="the dataset's layer the dictionary reads")
    p.add_argument("--hookpoint", default=None, help="stored hookpoint to read (default: hidden_layers')")
    p.add_argument("--out", required=True, metavar="DIR", help="folder of the feature cache and browser")
    p.add_argument("--top", type=positive_int, default=20, metavar="N", help="top activating tokens kept per feature")
    p.add_argument("--memory", default="512MiB", metavar="SIZE", help="memory for a batch of scores")
    p.add_argument("--pages", type=int, default=None, metavar="N", help="feature pages for the N most frequent "
                   "features (default: every feature that fired)")
    p.add_argument("--tokenizer", default=None, help="decodes token ids (default: the dataset's model, if it loads)")
    p.add_argument("--overwrite", action="store_true", help="recompute a cache made with other settings")
    p.add_argument("--report", default=None, metavar="PAGE",
                   help="the dataset's `lmprobe report` (its folder, index.html or an http(s) URL), linked from every "
                   "page (default: no link)")
    add_cache_option(p)
    add_quiet_option(p)
    p.set_defaults(func=cmd_features)
