"""Extraction benchmarks: throughput against the bare forward pass, and peak memory.

    python benchmarks/bench_extract.py            # ~23M-parameter random Llama, 256 length-skewed prompts
    python benchmarks/bench_extract.py --quick

Baselines, measured in the same run on the same prompts and batch size:
- bare forward, length-sorted: the model's decoder stack (no head, no hooks, no storage) over the
  batches lmprobe forms (longest first); lmprobe's overhead alone;
- bare forward, input order: the naive loop, batches in the order given; what length bucketing saves.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

WORDS = ("the cat sat on a mat while researchers study activations of language models every day with "
         "probes and sparse autoencoders in notebooks").split()


def make_model(out: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from tiny_models import train_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_tokenizer(out, kind="llama", padding_side="left", vocab_size=vocab)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=int(hidden * 2.7),
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=3.2, sigma=0.9, size=n), 4, 250).astype(int)  # skewed: most short, a few long
    return [" ".join(rng.choice(WORDS, size=int(k))) for k in lengths]


def bare_forward(model_dir: Path, texts: list[str], batch: int, sort: bool) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = time.perf_counter()  # end to end, like lmprobe.extract: load, tokenize, forward
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = model.model
    order = list(range(len(texts)))
    if sort:
        lengths = [len(x) for x in tok(texts)["input_ids"]]
        order = sorted(order, key=lambda i: (-lengths[i], i))
    with torch.inference_mode():
        for s in range(0, len(texts), batch):
            enc = tok([texts[i] for i in order[s : s + batch]], padding=True, return_tensors="pt")
            pos = (enc["attention_mask"].cumsum(1) - 1).clamp(min=0)
            base(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], position_ids=pos, use_cache=False)
    return time.perf_counter() - t


def lmprobe_extract(model_dir: Path, texts: list[str], batch: int, out: Path) -> float:
    import lmprobe

    t = time.perf_counter()
    lmprobe.extract(str(model_dir), texts, out=out, layers="all", batch_size=batch, quiet=True, overwrite=True)
    return time.perf_counter() - t


_RSS_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
import torch, transformers, lmprobe, numpy as np  # imports first: the baseline
model_dir, out, budget, n = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
rng = np.random.default_rng(1)
words = "alpha beta gamma delta epsilon zeta eta theta".split()
texts = [" ".join(rng.choice(words, size=int(k))) for k in rng.integers(20, 120, size=n)]
# warm-up run: lazy imports, allocator pools and thread pools are not what scales with the data
lmprobe.extract(model_dir, texts[:8], out=out + "-warm", layers="all", storage="full_sequence", quiet=True,
                overwrite=True)
base = hwm()
ds = lmprobe.extract(model_dir, texts, out=out, layers="all", storage="full_sequence", batch_size=8,
                     shard_size=budget, quiet=True, overwrite=True)
peak = hwm()
written = sum(p.stat().st_size for p in __import__("pathlib").Path(out).rglob("*.safetensors"))
print(json.dumps({"base": base, "peak": peak, "written": written}))
"""


def bench_rss(model_dir: Path, tmp: Path, budget: int, n: int, model_bytes: int, runs: int = 3) -> None:
    """Peak RSS growth in fresh processes; allocator timing makes single runs vary, so several are reported."""
    root = str(Path(__file__).resolve().parent.parent)
    growths, written = [], 0
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", _RSS_CHILD, root, str(model_dir), str(tmp / "rss"), str(budget),
                            str(n)], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr)
        m = json.loads(r.stdout.strip().splitlines()[-1])
        growths.append(m["peak"] - m["base"])
        written = m["written"]
    limit = model_bytes + 3 * budget
    print(f"peak RSS, full_sequence extraction writing {written / 2**20:.0f} MiB "
          f"({written / budget:.1f} x the {budget / 2**20:.0f} MiB shard budget), {runs} fresh processes")
    print(f"  growth over a warmed-up process {', '.join(f'{g / 2**20:.0f}' for g in growths)} MiB "
          f"(median {sorted(growths)[runs // 2] / 2**20:.0f}); model {model_bytes / 2**20:.0f} MiB + 3 budgets = "
          f"{limit / 2**20:.0f} MiB; worst ratio {max(growths) / limit:.2f} (target < 1)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="lmprobe-bench-"))
    try:
        hidden, layers, vocab, n, batch = (128, 4, 1000, 48, 8) if args.quick else (512, 6, 8000, 256, 16)
        model_dir = make_model(tmp / "model", hidden, layers, vocab)
        n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        texts = make_prompts(n)
        lmprobe_extract(model_dir, texts[:batch], batch, tmp / "warm")  # warm-up (imports, allocator)
        t_sorted = min(bare_forward(model_dir, texts, batch, sort=True) for _ in range(2))
        t_naive = min(bare_forward(model_dir, texts, batch, sort=False) for _ in range(2))
        t_ours = min(lmprobe_extract(model_dir, texts, batch, tmp / f"out{i}") for i in range(2))
        print(f"extract, pooled, all {layers} layers: {n_params / 1e6:.1f}M-parameter random Llama, {n} prompts "
              f"(length-skewed), batch {batch}, {torch.get_num_threads()} CPU threads")
        print(f"  bare forward, length-sorted batches   {n / t_sorted:7.1f} prompts/s")
        print(f"  bare forward, input-order batches     {n / t_naive:7.1f} prompts/s")
        print(f"  lmprobe.extract (with storage)        {n / t_ours:7.1f} prompts/s   "
              f"ratio {t_sorted / t_ours:.2f} vs sorted (target >= 0.9), {t_naive / t_ours:.2f} vs input order")
        budget = (2 if args.quick else 24) * 2**20  # about a tenth of what the run writes
        bench_rss(model_dir, tmp, budget, 120 if args.quick else 300, n_params * 4)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
