"""A model spread by ``--device-map auto`` stores what the model whole on one device stores (issue 43, point 5).

    python benchmarks/gpu_device_map.py            # on a GPU machine: GPU + CPU spread against the model on cuda
    python benchmarks/gpu_device_map.py --quick    # smaller model and fewer prompts (the CPU default)

A random Llama-like model (hidden 1024, 8 layers on a GPU; a locally trained tokenizer, no downloads) is saved
to a temporary folder, and the same prompts are extracted (full_sequence, every layer, top-5 logits,
perplexity) twice for each compute dtype (float32, bfloat16):

- on a GPU: (a) the whole model on cuda, (b) ``device_map="auto"`` with ``max_memory={0: about half the model,
  "cpu": the rest}``, so that accelerate keeps part of it in CPU memory and streams it to the GPU;
- without one (a check of this script): (a) the whole model on the CPU, (b) ``device_map="auto"`` with the CPU
  holding about two thirds of it and the rest offloaded to disk.

It prints where accelerate put the modules, the largest absolute difference of the hidden states, logits and
perplexities of (b) against (a), an allclose verdict for each, and the timings with their ratio (b)/(a).
The exit status is 1 when the vectors disagree or the model was not really spread.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

WORDS = ("the cat sat on a mat while researchers study activations of language models every day with "
         "probes and sparse autoencoders in notebooks").split()

#: (rtol, atol) by compute dtype: both runs compute on the same device with the same kernels, so the
#: differences are at most a kernel's choice of reduction order
TOLERANCE = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2)}


def make_model(out: Path, hidden: int, layers: int) -> Path:
    import torch
    from tiny_models import train_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_tokenizer(out, kind="llama", padding_side="left", vocab_size=300)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=int(hidden * 2.7),
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(k))) for k in rng.integers(5, 60, size=n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model and few prompts (the default without a GPU)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--prompts", type=int)
    args = ap.parse_args()

    import torch

    import lmprobe
    from lmprobe.extraction import loop as loop_mod
    from lmprobe.extraction import model as model_mod
    from lmprobe.extraction.placement import modules_per_device

    gpu = torch.cuda.is_available()
    quick = args.quick or not gpu
    hidden = args.hidden or (256 if quick else 1024)
    layers = args.layers or (4 if quick else 8)
    n_prompts = args.prompts or (24 if quick else 128)
    print(f"device: {torch.cuda.get_device_name(0) if gpu else 'CPU only (the GPU comparison is skipped)'}; "
          f"torch {torch.__version__}")

    placed: list[dict] = []
    real_load = model_mod.load_model

    def spy(*a, **k):  # where accelerate put the modules of each model the extraction loads
        model, commit = real_load(*a, **k)
        placed.append(dict(getattr(model, "hf_device_map", {})))
        return model, commit

    loop_mod.load_model = spy
    ok = True
    with tempfile.TemporaryDirectory(prefix="lmprobe-device-map-") as tmp:
        model_dir = make_model(Path(tmp) / "model", hidden, layers)
        weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))  # float32
        prompts = make_prompts(n_prompts)
        print(f"model: hidden {hidden}, {layers} layers, {weights / 2**20:.0f} MiB in float32; {n_prompts} prompts")
        # one-time costs (imports, kernels, the architecture's examination) before any clock starts
        lmprobe.extract(str(model_dir), prompts[:2], out=Path(tmp) / "warm-up", device="cuda" if gpu else "cpu",
                        quiet=True)
        for compute in ("float32", "bfloat16"):
            size = weights * torch.finfo(getattr(torch, compute)).bits // 32  # the model's bytes in this dtype
            if gpu:
                whole = dict(device="cuda")
                spread = dict(device="auto", device_map="auto", max_memory=f"0={size // 2},cpu={4 * size}")
                wanted = {"0", "cpu"}
            else:
                whole = dict(device="cpu")
                spread = dict(device="cpu", device_map="auto", max_memory=f"cpu={int(size * 0.66)},disk={4 * size}")
                wanted = {"cpu", "disk"}
            kw = dict(layers="all", storage="full_sequence", dtype="float32", logits_topk=5, perplexity=True,
                      batch_size=8, compute_dtype=compute, quiet=True, statistics=False)
            timings = {}
            out = {}
            for name, where in (("whole", whole), ("spread", spread)):
                if gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out[name] = lmprobe.extract(str(model_dir), prompts, out=Path(tmp) / f"{compute}-{name}", **kw,
                                            **where)
                timings[name] = time.perf_counter() - t0
            devices = modules_per_device(placed[-1])
            spread_ok = wanted <= set(devices)
            ok &= spread_ok
            print(f"\ncompute {compute}: max_memory {spread['max_memory']}")
            print(f"  hf_device_map: {devices} (modules per device)"
                  + ("" if spread_ok else f"  NOT SPREAD over {sorted(wanted)}"))
            a, b = out["whole"], out["spread"]
            rtol, atol = TOLERANCE[compute]
            pairs = [(f"hidden layer {layer}", a.hidden(layer), b.hidden(layer)) for layer in a.layers]
            pairs.append(("top-5 logits", a.logits_topk()[0], b.logits_topk()[0]))
            pairs.append(("perplexity", np.asarray(a.index["perplexity_mean"]), np.asarray(b.index["perplexity_mean"])))
            worst = 0.0
            for what, x, y in pairs:
                diff = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.size else 0.0
                close = x.shape == y.shape and np.allclose(y, x, rtol=rtol, atol=atol * max(1.0, float(np.abs(x).max())))
                ok &= close
                worst = max(worst, diff)
                if not close or what in ("top-5 logits", "perplexity", pairs[0][0], pairs[-3][0]):
                    print(f"  {what:>16}: max |diff| {diff:.3g}  allclose(rtol={rtol}, atol={atol}): {close}")
            print(f"  every hidden layer, logits and perplexity: max |diff| {worst:.3g}")
            print(f"  time: whole {timings['whole']:.2f} s, spread {timings['spread']:.2f} s, "
                  f"ratio spread/whole {timings['spread'] / timings['whole']:.2f}")
    print("\nOK: the spread model stores what the whole model stores" if ok else "\nFAILED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
