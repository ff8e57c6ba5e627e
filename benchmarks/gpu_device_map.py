"""A model spread by ``--device-map auto`` stores what the model whole on one device stores.

    python benchmarks/gpu_device_map.py            # on a GPU machine (about a minute on an H100)
    python benchmarks/gpu_device_map.py --quick    # smaller model and fewer prompts (the default without a GPU)

A random Llama-like model (hidden 1024, 8 layers on a GPU; a locally trained tokenizer, no downloads) is saved
to a temporary folder, and the same prompts are extracted (full_sequence, every layer, top-5 logits,
perplexity, statistics) by ``lmprobe.extract`` in several placements, for each compute dtype (float32,
bfloat16):

- on a GPU: (a) the whole model on cuda; (b) ``device_map="auto"`` with ``max_memory={0: about half the model,
  "cpu": the rest}``, so that accelerate keeps part of it in CPU memory and streams it to the GPU; and, in
  float32, (c) the blocks *computing* on two devices, the first half on cuda:0 and the rest, with the head, on
  the CPU (accelerate's ``dispatch_model`` with the CPU as main device): with one GPU this is what a node of
  several GPUs does to the hooks, which read each block where it runs and gather the rows on the first device;
- without one (a check of this script): (a) the whole model on the CPU, (b) ``device_map="auto"`` with the CPU
  holding about two thirds of it and the rest offloaded to disk.

It prints where the modules went (modules per device), the largest absolute difference of every hidden layer,
the top-5 logits and the perplexities of each placement against (a), an allclose verdict for each, and the
timings with their ratio to (a). The exit status is 1 when the vectors disagree or a model was not spread.
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

#: (rtol, atol as a fraction of the largest value) by compute dtype. (b) computes on the device (a) computes on,
#: so its differences are a kernel's choice of reduction order; (c) computes half the blocks on the CPU, whose
#: float32 kernels sum in another order than the GPU's
TOLERANCE = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2)}


def make_model(out: Path, hidden: int, layers: int) -> Path:
    import torch
    from support.tiny_models import train_tokenizer
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


def two_devices(real_load, layers: int):
    """A loader that puts the embedding and the first half of the blocks on cuda:0, the rest and the head on the
    CPU, each computing where it sits (the CPU is accelerate's main device, so its modules are not streamed)."""
    from accelerate import dispatch_model

    from lmprobe.extraction.placement import Placement

    def load(spec, *, placement, compute_dtype="auto", quiet=False):
        model, commit = real_load(spec, placement=Placement("cpu"), compute_dtype=compute_dtype, quiet=quiet)
        device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": "cpu", "lm_head": "cpu"}
        device_map.update({f"model.layers.{i}": 0 if i < layers // 2 else "cpu" for i in range(layers)})
        return dispatch_model(model, device_map=device_map, main_device="cpu"), commit

    return load


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
    n_prompts = args.prompts or (24 if quick else 64)
    print(f"device: {torch.cuda.get_device_name(0) if gpu else 'CPU only (the GPU comparisons are skipped)'}; "
          f"torch {torch.__version__}")

    placed: list[dict] = []
    real_load = model_mod.load_model
    loader = {"load": real_load}

    def spy(*a, **k):  # where the modules of each model the extraction loads went
        model, commit = loader["load"](*a, **k)
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
                runs = [("(a) whole on cuda", dict(device="cuda"), None, set()),
                        ("(b) device_map auto, GPU + CPU",
                         dict(device="auto", device_map="auto", max_memory=f"0={size // 2},cpu={4 * size}"), None,
                         {"0", "cpu"})]
                if compute == "float32":
                    runs.append(("(c) blocks on cuda:0 and the CPU", dict(device="cpu"), two_devices(real_load, layers),
                                 {"0", "cpu"}))
            else:
                runs = [("(a) whole on the CPU", dict(device="cpu"), None, set()),
                        ("(b) device_map auto, CPU + disk",
                         dict(device="cpu", device_map="auto", max_memory=f"cpu={int(size * 0.66)},disk={4 * size}"),
                         None, {"cpu", "disk"})]
            kw = dict(layers="all", storage="full_sequence", dtype="float32", logits_topk=5, perplexity=True,
                      batch_size=8, compute_dtype=compute, quiet=True)
            print(f"\ncompute {compute}:")
            ref, ref_time = None, None
            for name, where, load, wanted in runs:
                loader["load"] = load or real_load
                if gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                ds = lmprobe.extract(str(model_dir), prompts, out=Path(tmp) / f"{compute}-{name[1]}", **kw, **where)
                elapsed = time.perf_counter() - t0
                devices = modules_per_device(placed[-1])
                spread_ok = wanted <= set(devices)
                ok &= spread_ok
                line = f"  {name}: {elapsed:.2f} s"
                if ref is None:
                    ref, ref_time = ds, elapsed
                    print(line)
                    continue
                print(f"{line} ({elapsed / ref_time:.2f}x (a)); {where.get('max_memory', '')}")
                print(f"      modules per device: {devices}" + ("" if spread_ok else f"  NOT SPREAD over {sorted(wanted)}"))
                rtol, atol = TOLERANCE[compute]
                pairs = [(f"hidden layer {layer}", ref.hidden(layer), ds.hidden(layer)) for layer in ref.layers]
                pairs.append(("top-5 logits", ref.logits_topk()[0], ds.logits_topk()[0]))
                pairs.append(("perplexity", np.asarray(ref.index["perplexity_mean"]),
                              np.asarray(ds.index["perplexity_mean"])))
                worst, all_close = 0.0, True
                for what, x, y in pairs:
                    diff = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.size else 0.0
                    scale = max(1.0, float(np.abs(x).max())) if x.size else 1.0
                    close = x.shape == y.shape and bool(np.allclose(y, x, rtol=rtol, atol=atol * scale))
                    all_close &= close
                    worst = max(worst, diff)
                    if not close:
                        print(f"      {what}: max |diff| {diff:.3g}, NOT allclose(rtol={rtol}, atol={atol} x {scale:.3g})")
                same_tokens = bool(np.array_equal(ref.logits_topk()[1], ds.logits_topk()[1]))
                ok &= all_close
                print(f"      every hidden layer, top-5 logits, perplexity: max |diff| {worst:.3g}; allclose(rtol={rtol}, "
                      f"atol={atol} x max |value|): {all_close}; same top-5 token ids: {same_tokens}")
    print("\nOK: every spread model stores what the whole model stores" if ok else "\nFAILED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
