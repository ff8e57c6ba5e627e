"""``lmprobe sae-topk`` / ``python -m lmprobe.sae``: load one layer and print its top features for a probe vector."""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence

from ..base.layers import stored_layer
from ..errors import DictionaryError, InvalidArgumentError, LayerNotFoundError, LmprobeError
from .activation import describe
from .loader import SAEConfig, encode_topk, load_dictionary, project_topk


def add_topk_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", required=True, help="folder holding dictionaries, or hf://OWNER/NAME (a model repo)")
    p.add_argument("--dict", required=True, dest="dictionary", help="dictionary name (a folder under --root)")
    p.add_argument("--layer", required=True, type=int, help="the layer of the dictionary to load (-1: its last)")
    p.add_argument("--topk", type=int, default=10, help="features to print (default 10)")
    p.add_argument("--dataset", default=None, help="take the probe vector from this lmprobe dataset (path or repo)")
    p.add_argument("--prompt", type=int, default=0, help="with --dataset: the prompt (index row) to use (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random probe vector (default 0)")
    p.add_argument("--device", default="auto", help="auto (default: cuda when available), cpu, cuda or cuda:N")
    p.add_argument("--scores", action="store_true",
                   help="rank raw scores W x + b (the dictionary format's projection) instead of the SAE's "
                   "activations under its recorded rule (relu, top-k, JumpReLU)")


def run_topk(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    dct = load_dictionary(SAEConfig(root_path=args.root, dictionary_name=args.dictionary, device=args.device))
    if args.layer < 0:  # -1: the dictionary's last layer, the one layer grammar of lmprobe
        try:
            args.layer = stored_layer(args.layer, dct.layers)
        except LayerNotFoundError as exc:
            raise DictionaryError(f"dictionary {args.dictionary!r}: {exc}") from None
    layer = dct.get_layer(args.layer)
    t_load = time.perf_counter() - t0
    if args.dataset:
        from ..opening import load  # datasets need numpy and pyarrow; the dictionary alone does not

        ds = load(args.dataset)
        if not 0 <= args.prompt < ds.num_prompts:
            raise InvalidArgumentError(f"prompt {args.prompt} is not in {args.dataset}: --prompt takes an index row, "
                                       f"0..{ds.num_prompts - 1}")
        vec = ds.hidden(ds.check_layer(args.layer), rows=[args.prompt])[0]
        what = f"prompt {args.prompt} of {args.dataset}: {ds.texts[args.prompt][:60]!r}"
    else:
        rng = random.Random(args.seed)
        vec = [rng.gauss(0.0, 1.0) for _ in range(layer.hidden_dim)]
        what = f"a random probe vector (seed {args.seed})"
    t1 = time.perf_counter()
    top = project_topk(layer, vec, k=args.topk) if args.scores else encode_topk(layer, vec, k=args.topk)
    t_proj = time.perf_counter() - t1
    print(f"dictionary {args.dictionary!r} layer {args.layer}: {layer.feature_count} features x {layer.hidden_dim} "
          f"dims, {layer.nnz} weights, activation {describe(layer.activation)} (loaded in {t_load * 1000:.0f} ms, "
          f"device {dct.device})")
    ranked = "raw scores W x + b" if args.scores else "activations; features that do not fire are left out"
    print(f"top {len(top)} features for {what} by {ranked} ({t_proj * 1000:.1f} ms):")
    for idx, score in top:
        print(f"  feat_{idx}\t{score:.6f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmprobe.sae", description="Print the top SAE features of a probe vector.")
    add_topk_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_topk(args)
    except LmprobeError as exc:
        print(f"lmprobe sae-topk: error: {exc}", file=sys.stderr)
        return 2
