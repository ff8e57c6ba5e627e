"""The command line's looking at a dataset: ``probe``, ``report``, ``features``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .. import api
from ..opening import load
from ..probe import METHODS, plot_sweep, steer, sweep, train_probe
from ..storage import is_hub_url
from .options import (
    add_cache_option,
    add_quiet_option,
    default_of,
    hookpoint_list,
    open_source,
    positive_int,
    stored_layers,
)


def _pooling(text: str):
    """--pooling: a name, or a token position (an int, negative from the end)."""
    try:
        return int(text)
    except ValueError:
        return text


def _test_arg(text: str | None):
    """--test: COLUMN=VALUE, or a dataset (folder or Hub repo) held out."""
    if text is None:
        return None
    if "=" in text and not is_hub_url(text) and not text.startswith(("/", ".")):
        column, value = text.split("=", 1)
        return (column, int(value) if value.lstrip("-").isdigit() else value)
    return text


def cmd_probe(args: argparse.Namespace) -> int:
    ds = load(args.dataset)
    layers = stored_layers(args.layers, ds.layers)
    if args.concat:
        layers = [layers]
    hookpoints = hookpoint_list(args.hookpoints)
    methods = [m.strip() for m in (args.classifier or args.method).split(",")]
    table = sweep(ds, layers=layers, label_column=args.label_column, method=methods, cv=args.cv,
                  pooling=_pooling(args.pooling), seed=args.seed, hookpoints=hookpoints, task=args.task,
                  groups=args.groups, pairs=args.pairs, test=_test_arg(args.test), bootstrap=args.bootstrap,
                  baselines=args.baselines)
    key = "r2" if args.task == "regression" else "accuracy"
    shown = table.drop(columns=[c for c in table.columns if c.endswith(("_lo", "_hi"))]) if not args.bootstrap else table
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.baselines:
        b = table.attrs["baselines"]
        print("\nbaselines (same folds):")
        print(b[["baseline", key, f"{key}_std", "note"]].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    best = table.loc[table[key].idxmax()]
    where = f"{best['hookpoint']} " if "hookpoint" in table.columns else ""
    line = (f"best {where}layer {best['layer']}: {key} {best[key]:.3f} +- {best[f'{key}_std']:.3f} "
            f"({args.cv}-fold, {best['method']}, pooling {args.pooling})")
    if args.baselines:
        line += (f"; best baseline {best['best_baseline']} {best[key] - best['over_baseline']:.3f}: "
                 + ("beaten" if best["beats_baselines"] else "NOT beaten, the probe beats no baseline"))
    print(line)
    if args.plot:
        plot_sweep(table, args.plot, title=f"{ds.model.get('name')}: {args.label_column} probe")
        print(f"wrote {args.plot}")
    if args.save_to:
        layer = best["layer"]
        layer = int(layer) if not isinstance(layer, str) else [int(x) for x in layer.split("+")]
        p = train_probe(ds, layer, method=best["method"], label_column=args.label_column, task=args.task,
                        pooling=_pooling(args.pooling), pairs=args.pairs,
                        hookpoint=best["hookpoint"] if "hookpoint" in table.columns else None, seed=args.seed)
        weights, meta = p.save(args.save_to)
        print(f"wrote {weights} and {meta}")
    return 0


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, e.g. -4,0,4; got {text!r}") from None


def cmd_steer(args: argparse.Namespace) -> int:
    table = steer(args.model, args.probe, args.prompts, alphas=args.alphas, layer=args.layer, hookpoint=args.hookpoint,
                  ablate=args.ablate, targets=args.target or [], read_layer=args.read_layer,
                  text_column=args.text_column, device=args.device, revision=args.revision,
                  trust_remote_code=args.trust_remote_code)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print(f"unsteered probe score at layer {int(table['read_layer'][0])}: {table.attrs['unsteered_probe_score']:.4f}")
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
    p.add_argument("--layers", default=None, help="layers to probe: all, '16', '0,8,-1', '10:20' (default: all)")
    p.add_argument("--label-column", default=default_of(sweep, "label_column"),
                   help="index column holding the class of each prompt")
    p.add_argument("--method", default=default_of(sweep, "method"), metavar="M[,M...]",
                   help=f"probe methods, a comma list of {', '.join(METHODS)} (docs/probing.md says which when)")
    p.add_argument("--classifier", default=None, help=argparse.SUPPRESS)  # the older name of --method
    p.add_argument("--task", choices=["classification", "regression"], default=default_of(sweep, "task"),
                   help="regression: a numeric --label-column, scored by R^2")
    p.add_argument("--cv", type=positive_int, default=default_of(sweep, "cv"),
                   metavar="K", help="cross-validation folds")
    p.add_argument("--pooling", default=default_of(sweep, "pooling"), metavar="P",
                   help="the vector of a prompt: last_token, first, mean, max, min, a token position (int, negative "
                   "from the end) or tokens (every token a row); all but last_token need a full_sequence dataset")
    p.add_argument("--concat", action="store_true", help="concatenate the --layers into one probe, each layer "
                   "standardised")
    p.add_argument("--groups", default=None, metavar="COLUMN", help="rows sharing this column's value share a fold "
                   "(paraphrases of one item; 'text' groups duplicates)")
    p.add_argument("--pairs", default=None, metavar="COLUMN", help="contrast pairs: the column pairing rows")
    p.add_argument("--test", default=None, metavar="COLUMN=VALUE|DATASET",
                   help="held-out rows (split=test) or a held-out dataset: adds test_* columns")
    p.add_argument("--baselines", action="store_true", help="score the baselines on the same folds and say whether "
                   "the probe beats them")
    p.add_argument("--bootstrap", type=int, default=default_of(sweep, "bootstrap"),
                   metavar="N", help="95%% intervals from N resamples")
    # (dest save_to: nnsight, once imported, gives every object a `save` method, argparse.Namespace too, and argparse
    # then leaves a dest named `save` at that method instead of its default)
    p.add_argument("--save", dest="save_to", default=None, metavar="PATH", help="train the best row's probe on every row and save it "
                   "as PATH.safetensors + PATH.json")
    p.add_argument("--hookpoints", default=None, help="sweep these stored hookpoints too, a comma list "
                   "(default: what hidden_layers holds)")
    p.add_argument("--seed", type=int, default=default_of(sweep, "seed"),
                   help="seed of the fold split and the classifier")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write accuracy against layer to this image (default: no plot)")
    p.set_defaults(func=cmd_probe)

    p = command("steer", help="the causal check: add a probe's direction to the stream (or ablate it) and measure "
                "the probe's score at a later layer and target tokens' log-probabilities")
    p.add_argument("--model", required=True, help="the model the probe's dataset was extracted from")
    p.add_argument("--probe", required=True, metavar="PATH", help="a saved probe (PATH.safetensors + PATH.json, "
                   "from `lmprobe probe --save` or LinearProbe.save)")
    p.add_argument("--prompts", required=True, metavar="SOURCE", help="prompts: a .jsonl/.csv/.txt/.parquet file, "
                   "a folder or a Hub dataset, as extract reads them")
    p.add_argument("--text-column", default=default_of(steer, "text_column"), help="the prompts' text column")
    p.add_argument("--alphas", type=_floats, default=[float(a) for a in default_of(steer, "alphas")], metavar="A,B,...",
                   help="multiples of the probe's unit direction to add (default -4,0,4)")
    p.add_argument("--ablate", action="store_true", help="remove the direction's component instead of adding it")
    p.add_argument("--layer", type=int, default=None, help="the block to steer (default: the probe's layer)")
    p.add_argument("--hookpoint", default=None, help="where in the block (default: the probe's hookpoint)")
    p.add_argument("--read-layer", type=int, default=None, help="where the probe's score is read (default: the next "
                   "layer its dataset stored)")
    p.add_argument("--target", action="append", default=None, metavar="TOKEN",
                   help="a next token whose log-probability to report (one token; repeat for several)")
    p.add_argument("--device", default=default_of(steer, "device"), help="auto, cpu, cuda, cuda:1, mps")
    p.add_argument("--revision", default=None, help="the model's Hub revision")
    p.add_argument("--trust-remote-code", action="store_true", help="run the model repository's own code")
    p.set_defaults(func=cmd_steer)

    p = command("report", help="a self-contained HTML page about a dataset: facts, plots, prompts, labels")
    p.add_argument("dataset", metavar="DATASET", help="dataset folder, Hub repo or fsspec URL")
    p.add_argument("--out", required=True, metavar="DIR", help="writes DIR/index.html")
    p.add_argument("--prompts", default=None, metavar="ROWS", help="prompts to show besides the sample, e.g. 3,17 "
                   "(default: none)")
    p.add_argument("--sample", type=int, default=default_of(api.report, "sample"),
                   metavar="N", help="random prompts to show")
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
    p.add_argument("--top", type=positive_int, default=default_of(api.features, "top"),
                   metavar="N", help="top activating tokens kept per feature")
    p.add_argument("--memory", default=default_of(api.features, "memory"),
                   metavar="SIZE", help="memory for a batch of scores")
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
