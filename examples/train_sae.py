"""From activations to a dictionary: train a small top-k SAE on an lmprobe dataset, export it, look at it.

    python examples/train_sae.py [--dataset DIR] [--layer L] [--out WORK]

1. extracts every token of examples/prompts.jsonl from the embedded lmprobe-tiny (unless --dataset);
2. trains a top-k SAE in plain PyTorch from the training reader: globally shuffled batches,
   normalised to mean norm sqrt(dim) from the dataset's statistics, the first token (BOS) skipped;
3. saves it in sparsify's layout (cfg.json + sae.safetensors) with the normalisation folded in,
   exports it as an SAE dictionary with `lmprobe export-sae`, and prints the top features of a few
   prompts' last tokens with `lmprobe sae-topk`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import lmprobe
from lmprobe.stream import ShardStream

HERE = Path(__file__).resolve().parent


class TopKSAE(torch.nn.Module):
    """encode: top-k of relu(W_enc (x - b_dec) + b_enc); decode: W_dec z + b_dec."""

    def __init__(self, d: int, features: int, k: int):
        super().__init__()
        self.k = k
        self.encoder = torch.nn.Linear(d, features)
        self.W_dec = torch.nn.Parameter(self.encoder.weight.detach().clone())  # (features, d), tied at start
        self.b_dec = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = torch.relu(self.encoder(x - self.b_dec))
        top = pre.topk(self.k, dim=-1)
        z = torch.zeros_like(pre).scatter_(-1, top.indices, top.values)
        return z @ self.W_dec + self.b_dec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default=None, help="a full_sequence dataset (default: extract one from lmprobe-tiny)")
    ap.add_argument("--layer", type=int, default=None, help="layer to train on (default: the last stored)")
    ap.add_argument("--out", default="out/train-sae", help="working folder")
    ap.add_argument("--features", type=int, default=256, help="SAE features (default: 256)")
    ap.add_argument("--k", type=int, default=8, help="features active per token, the top-k rule (default: 8)")
    ap.add_argument("--epochs", type=int, default=20, help="passes over the dataset (default: 20)")
    args = ap.parse_args()
    work = Path(args.out)
    if args.dataset is None:
        ds = lmprobe.extract("lmprobe-tiny", str(HERE / "prompts.jsonl"), out=work / "acts", storage="full_sequence",
                             token_ids=True, quiet=True)
    else:
        ds = lmprobe.load(args.dataset)
    layer = ds.layers[-1] if args.layer is None else args.layer

    torch.manual_seed(0)
    stream = ShardStream(ds, layer, batch_size=64, seed=0, normalize="mean_norm", skip_first_tokens=1,
                         memory="64MiB")
    sae = TopKSAE(ds.dim, args.features, args.k)
    opt = torch.optim.Adam(sae.parameters(), lr=3e-3)
    for epoch in range(args.epochs):
        stream.set_epoch(epoch)
        total, n = 0.0, 0
        for batch in stream:
            x = torch.from_numpy(batch)
            loss = ((sae(x) - x) ** 2).sum(-1).mean() / x.pow(2).sum(-1).mean()  # fraction of variance unexplained
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, n = total + float(loss.detach()) * len(x), n + len(x)
        if epoch % 5 == 0 or epoch == args.epochs - 1:
            print(f"epoch {epoch:3d}: FVU {total / n:.3f} over {n} vectors")

    # the SAE saw x * scale: fold the scale in so the saved encoder takes raw activations
    scale = float(stream.scale[0, 0])
    run = work / "sae-run" / f"layers.{layer}"
    run.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({"encoder.weight": (sae.encoder.weight.detach() * scale).contiguous(),
               "encoder.bias": sae.encoder.bias.detach().contiguous(),
               "W_dec": (sae.W_dec.detach() / scale).contiguous(),
               "b_dec": (sae.b_dec.detach() / scale).contiguous()}, str(run / "sae.safetensors"))
    (run / "cfg.json").write_text(json.dumps({"activation": "topk", "k": args.k, "num_latents": args.features,
                                              "d_in": ds.dim, "normalize_decoder": False}))
    lm = [sys.executable, "-m", "lmprobe"]
    subprocess.run(lm + ["export-sae", str(run), "--layer", str(layer), "--root", str(work / "sae"), "--dict",
                         "tiny-topk"], check=True)
    rows = np.linspace(0, ds.num_prompts - 1, 3).astype(int)
    for i in rows:
        print(f"prompt {i}: {ds.texts[i][:60]!r}")
        subprocess.run(lm + ["sae-topk", "--root", str(work / "sae"), "--dict", "tiny-topk", "--layer", str(layer),
                             "--dataset", str(ds.files), "--prompt", str(i), "--topk", "5"], check=True)


if __name__ == "__main__":
    main()
