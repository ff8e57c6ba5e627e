"""Extraction benchmarks: throughput against a bare forward pass, corpus windows, and peak memory.

    python benchmarks/bench_extract.py            # full run (~15 min on 2 CPU cores)
    python benchmarks/bench_extract.py --quick    # smoke run

Every timing runs in a fresh process with torch, transformers and lmprobe imported before the
clock starts, and counts everything after that: reading the config, tokenizer and weights,
tokenizing, the forward passes and (for lmprobe) writing the dataset. Runs of the baseline and
of lmprobe alternate, and the best of each is compared. Baselines, on the same model, inputs
and batch size:
- prompts: a bare length-sorted forward script (the model's decoder stack, no head, no hooks,
  no storage) over the batches lmprobe forms, longest first; a small job (384 prompts) and a
  long one (4x) for the steady state;
- corpus: the same windows (documents tokenized once, cut into windows of T tokens with BOS
  inside) run through the bare decoder stack in batches, against ``lmprobe.extract`` with
  ``context_len``/``max_tokens`` storing every token of one layer (an SAE dataset).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

WORDS = ("the cat sat on a mat while researchers study activations of language models every day with "
         "probes and sparse autoencoders in notebooks").split()


def make_model(out: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from support.tiny_models import train_tokenizer
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
    return [" ".join(rng.choice(WORDS, size=int(k))) for k in rng.integers(5, 200, size=n)]


def make_corpus(path: Path, n_docs: int, seed: int = 1) -> Path:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=5.5, sigma=1.0, size=n_docs), 20, 4000).astype(int)  # words
    with open(path, "w") as f:
        for k in lengths:
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS, size=int(k)))}) + "\n")
    return path


def bare_forward(model_dir: Path, texts: list[str], batch: int, sort: bool) -> None:
    """The baseline script: load, tokenize, forward the decoder stack batch by batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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


def bare_windows(model_dir: Path, corpus: Path, context_len: int, max_tokens: int, batch: int) -> None:
    """The corpus baseline: the same windows lmprobe runs (BOS + T-1 content tokens), forward only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = model.model
    per = context_len - 1
    windows, total = [], 0
    with open(corpus) as f:
        for line in f:
            ids = tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            for a in range(0, len(ids), per):
                w = [tok.bos_token_id, *ids[a : a + per]][: max_tokens - total]
                windows.append(w)
                total += len(w)
                if total >= max_tokens:
                    break
            if total >= max_tokens:
                break
    with torch.inference_mode():
        for s in range(0, len(windows), batch):
            chunk = windows[s : s + batch]
            width = max(len(w) for w in chunk)
            ids = torch.full((len(chunk), width), tok.pad_token_id)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, w in enumerate(chunk):
                ids[r, width - len(w):] = torch.tensor(w)
                mask[r, width - len(w):] = 1
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)


_TIMED_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/benchmarks"); sys.path.insert(0, sys.argv[1] + "/tests")
import numpy as np, torch, transformers, lmprobe  # imports before the clock
from transformers import AutoModelForCausalLM, AutoTokenizer
import bench_extract as b
job = json.loads(sys.argv[2])
texts = b.make_prompts(job["n"]) if "n" in job else None
t = time.perf_counter()
if job["what"] == "bare":
    b.bare_forward(job["model"], texts, job["batch"], sort=True)
elif job["what"] == "extract":
    lmprobe.extract(job["model"], texts, out=job["out"], layers="all", batch_size=job["batch"], quiet=True,
                    overwrite=True)
elif job["what"] == "bare_windows":
    b.bare_windows(job["model"], job["corpus"], job["context_len"], job["max_tokens"], job["batch"])
else:
    lmprobe.extract(job["model"], job["corpus"], out=job["out"], layers=str(job["layer"]), storage="full_sequence",
                    context_len=job["context_len"], max_tokens=job["max_tokens"], batch_size=job["batch"], quiet=True,
                    overwrite=True, dtype=job.get("dtype", "float32"))
print(json.dumps(time.perf_counter() - t))
"""


def timed(job: dict) -> float:
    r = subprocess.run([sys.executable, "-c", _TIMED_CHILD, str(ROOT), json.dumps(job)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def compare(base: dict, ours: dict, runs: int) -> tuple[list[float], list[float]]:
    """Alternating fresh-process runs of the baseline and lmprobe."""
    tb, to = [], []
    for _ in range(runs):
        tb.append(timed(base))
        to.append(timed(ours))
    return tb, to


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


def bench_rss(model_dir: Path, tmp: Path, budget: int, n: int, model_bytes: int, runs: int) -> None:
    """Peak RSS growth in fresh processes; allocator timing makes single runs vary, so several are reported."""
    growths, written = [], 0
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(ROOT), str(model_dir), str(tmp / "rss"), str(budget),
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


def _line(label: str, tb: list[float], to: list[float], unit_count: float, unit: str, target: str) -> None:
    print(f"  bare {min(tb):6.2f} s (runs {', '.join(f'{x:.2f}' for x in tb)})")
    print(f"  lmprobe {min(to):6.2f} s (runs {', '.join(f'{x:.2f}' for x in to)}): {unit_count / min(to):,.0f} {unit}/s")
    print(f"  {label}: ratio {min(tb) / min(to):.2f} best-of, {np.median(tb) / np.median(to):.2f} median ({target})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["prompts", "corpus", "wide", "rss"], default=None, help="run one part")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix="lmprobe-bench-"))
    try:
        runs = 2 if args.quick else 3
        hidden, layers, vocab = (128, 4, 1000) if args.quick else (384, 6, 8000)
        model_dir = str(make_model(tmp / "model", hidden, layers, vocab))
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        print(f"{n_params / 1e6:.1f}M-parameter random Llama (hidden {hidden}, {layers} layers), "
              f"{torch.get_num_threads()} CPU threads, fresh process per run")
        jobs = ((48, "small job"), (96, "longer job")) if args.quick else ((384, "small job"), (1536, "steady state"))
        for n, label in jobs if args.only in (None, "prompts") else ():
            tb, to = compare({"what": "bare", "model": model_dir, "n": n, "batch": 16},
                             {"what": "extract", "model": model_dir, "n": n, "batch": 16, "out": str(tmp / "out")},
                             runs)
            print(f"prompts, pooled, all layers: {n} prompts of 5-200 words, batch 16")
            _line(label, tb, to, n, "prompts", ">= 0.9" if n <= 384 else ">= 0.97")
        if args.only in (None, "corpus"):
            bench_corpus(model_dir, tmp, layers, args.quick, runs)
        if args.only in (None, "wide"):
            bench_wide(tmp, args.quick, runs)
        if args.only in (None, "rss"):
            budget = (2 if args.quick else 24) * 2**20  # about a tenth of what the run writes
            rss_model = make_model(tmp / "rss-model", 512, 6, 8000)
            rss_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(rss_model).parameters())
            bench_rss(rss_model, tmp, budget, 120 if args.quick else 300, rss_params * 4, runs=3 if args.quick else 6)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_corpus(model_dir: str, tmp: Path, layers: int, quick: bool, runs: int) -> None:
    corpus = make_corpus(tmp / "corpus.jsonl", 300 if quick else 2000)
    T, N = (64, 20_000) if quick else (256, 400_000)
    layer = layers - 1  # the whole stack runs on both sides (lmprobe stops after the last needed block)
    job = {"model": model_dir, "corpus": str(corpus), "context_len": T, "max_tokens": N, "batch": 16}
    tb, to = compare({"what": "bare_windows", **job},
                     {"what": "corpus", "layer": layer, "out": str(tmp / "corpus-out"), **job}, runs)
    print(f"corpus, windows of {T} tokens, budget {N:,} tokens, full_sequence layer {layer}, batch 16")
    _line("corpus extraction", tb, to, N, "tokens", "reported")



def bench_wide(tmp: Path, quick: bool, runs: int) -> None:
    """The SAE-dataset case at the data path's rate: every token of every layer of a wider model, f32 and bf16.

    A 4-layer Llama of width 512 (its forward dominates, as a GPU model's does), 1024-token corpus
    windows, all four layers stored full_sequence with statistics and checksums on (the defaults),
    against a bare forward loop over the same windows.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = str(make_model(tmp / "wide-model", 512, 4, 8000))
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    corpus = make_corpus(tmp / "wide-corpus.jsonl", 300 if quick else 2000)
    T, N = (1024, 8192) if quick else (1024, 65536)
    job = {"model": model_dir, "corpus": str(corpus), "context_len": T, "max_tokens": N, "batch": 4}
    for dtype in ("float32", "bfloat16"):
        tb, to = compare({"what": "bare_windows", **job},
                         {"what": "corpus", "layer": "all", "dtype": dtype, "out": str(tmp / "wide-out"), **job}, runs)
        stored = N * 4 * 512 * (4 if dtype == "float32" else 2)
        print(f"wide corpus: {n_params / 1e6:.1f}M-parameter Llama (width 512, 4 layers), {torch.get_num_threads()} "
              f"threads, windows of {T}, {N:,} tokens, all 4 layers full_sequence in {dtype} "
              f"({stored / 1e9:.2f} GB), statistics and checksums on, batch 4")
        _line("extraction / bare forward", tb, to, N, "tokens", "target >= 0.95")
        ratios = sorted(b / o for b, o in zip(tb, to, strict=True))
        print(f"  per-run ratios (interleaved pairs) min / median / max: {ratios[0]:.2f} / "
              f"{float(np.median(ratios)):.2f} / {ratios[-1]:.2f}")


if __name__ == "__main__":
    main()
