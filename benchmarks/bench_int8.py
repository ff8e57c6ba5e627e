"""int8 storage: SAE quality against bfloat16, bytes per token, writer and reader rates against their floors.

    python benchmarks/bench_int8.py [--quick]

1. Quality. The same corpus is extracted from lmprobe-tiny (layer 3, every token) in float32, bfloat16 and
   int8. The same top-k SAE (a small one, below) is trained on the bfloat16 and the int8 copy with the same
   seed schedule (seeds 0, 1, 2: initialisation and batch order), and every SAE is evaluated on the float32
   copy of held-out prompts: FVU, L0 (= k), dead latents, and the change in the model's next-token loss
   when layer 3's output is replaced by the SAE's reconstruction (splice-in). Acceptance: int8's mean FVU
   within 1% (relative) of bfloat16's, at 0.52x its bytes or less.
2. Bytes per token of each copy's shards (the files on disk, headers included).
3. The writer's rate on int8 against its floor: numpy's encoding of the same float32 rows (absmax, divide,
   round, cast) and one write of the codes and the scales, in the same run.
4. The reader's rate: ShardStream over the int8 layer, float32 and bfloat16 out, against its floor: a read
   of the same bytes, the dequantize with numpy (codes x scale), rows gathered into shuffled batches.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lmprobe  # noqa: E402
from lmprobe.format.safetensors_io import read_header  # noqa: E402
from lmprobe.format.writer import DatasetWriter  # noqa: E402
from lmprobe.stream import ShardStream  # noqa: E402

LAYER = 3
WORDS = ("the cat dog sat ran far over under a an of in on with big small red blue green said went came saw "
         "house tree river city night day was were is are had has old new quick slow happy sad very not").split()


def corpus(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(10, 30)))) for _ in range(n)]


def all_rows(ds) -> np.ndarray:
    """Every stored token of the layer (last tokens and the others), as ``lmprobe.load`` decodes them."""
    ids, offs, _ = ds.shards.token_addresses()
    return np.asarray(ds.shards.read_hidden_rows(LAYER, ids, offs), dtype=np.float32)


def shard_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "tensors").rglob("*.safetensors"))


# ---------------------------------------------------------------- a small top-k SAE (torch, CPU)

def train_sae(x: np.ndarray, *, latents: int, k: int, seed: int, epochs: int, batch: int = 512):
    import torch

    torch.manual_seed(seed)
    d = x.shape[1]
    mean = torch.from_numpy(x.mean(axis=0))
    enc = torch.nn.Linear(d, latents)
    dec = torch.nn.Parameter(enc.weight.detach().clone())  # (latents, d), tied at init
    with torch.no_grad():
        dec /= dec.norm(dim=1, keepdim=True)
        enc.bias.zero_()
    opt = torch.optim.Adam([*enc.parameters(), dec], lr=2e-3)
    data = torch.from_numpy(x)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(data), generator=gen).split(batch):
            xb = data[idx] - mean
            pre = enc(xb)
            top = pre.topk(k, dim=1)
            z = torch.zeros_like(pre).scatter_(1, top.indices, torch.relu(top.values))
            loss = ((z @ dec - xb) ** 2).sum(dim=1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                dec /= dec.norm(dim=1, keepdim=True)
    return enc, dec, mean, k


def sae_apply(sae, x):
    import torch

    enc, dec, mean, k = sae
    with torch.no_grad():
        pre = enc(x - mean)
        top = pre.topk(k, dim=-1)
        z = torch.zeros_like(pre).scatter_(-1, top.indices, torch.relu(top.values))
        return z @ dec + mean, z


def evaluate(sae, x: np.ndarray) -> dict:
    import torch

    t = torch.from_numpy(x)
    rec, z = sae_apply(sae, t)
    fvu = float(((rec - t) ** 2).sum() / ((t - t.mean(0)) ** 2).sum())
    l0 = float((z > 0).sum(dim=1).float().mean())
    dead = int(((z > 0).sum(dim=0) == 0).sum())
    return {"fvu": fvu, "l0": l0, "dead": dead}


def splice_loss(model, tok, texts: list[str], sae=None) -> float:
    """Mean next-token loss of lmprobe-tiny on ``texts``, with layer 3's output replaced by the SAE's
    reconstruction when ``sae`` is given."""
    import torch

    hook = None
    if sae is not None:
        def replace(_module, _inputs, output):
            h = output[0] if isinstance(output, tuple) else output
            rec, _ = sae_apply(sae, h.float())
            return (rec.to(h.dtype), *output[1:]) if isinstance(output, tuple) else rec.to(h.dtype)

        hook = model.model.layers[LAYER].register_forward_hook(replace)
    try:
        losses = []
        with torch.no_grad():
            for text in texts:
                ids = tok(text, return_tensors="pt").input_ids
                losses.append(float(model(ids, labels=ids).loss))
        return float(np.mean(losses))
    finally:
        if hook is not None:
            hook.remove()


def quality(root: Path, n_train: int, n_eval: int, epochs: int) -> dict:
    texts, held = corpus(n_train, 0), corpus(n_eval, 1)
    paths = {}
    for dtype in ("float32", "bfloat16", "int8"):
        paths[dtype] = root / f"train-{dtype}"
        lmprobe.extract("lmprobe-tiny", texts, out=paths[dtype], layers=str(LAYER), storage="full_sequence",
                        dtype=dtype, batch_size=32, quiet=True)
    lmprobe.extract("lmprobe-tiny", held, out=root / "eval", layers=str(LAYER), storage="full_sequence",
                    dtype="float32", batch_size=32, quiet=True)
    x_eval = all_rows(lmprobe.load(root / "eval"))
    rows = {d: all_rows(lmprobe.load(p)) for d, p in paths.items()}
    n_tok = len(rows["float32"])
    per_tok = {d: shard_bytes(p) / n_tok for d, p in paths.items()}
    err = {d: float(((rows[d] - rows["float32"]) ** 2).sum() / (rows["float32"] ** 2).sum()) for d in rows}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    here = Path(lmprobe.__file__).parent / "models" / "tiny"
    model, tok = AutoModelForCausalLM.from_pretrained(here).eval(), AutoTokenizer.from_pretrained(here)
    base_loss = splice_loss(model, tok, held[:64])
    dim = x_eval.shape[1]
    results: dict[str, list[dict]] = {}
    for dtype in ("float32", "bfloat16", "int8"):
        results[dtype] = []
        for seed in (0, 1, 2):
            sae = train_sae(rows[dtype], latents=8 * dim, k=16, seed=seed, epochs=epochs)
            r = evaluate(sae, x_eval)
            r["dloss"] = splice_loss(model, tok, held[:64], sae) - base_loss
            results[dtype].append(r)
    return {"tokens": n_tok, "eval_tokens": len(x_eval), "dim": dim, "per_tok": per_tok, "err": err,
            "results": results, "base_loss": base_loss}


# ---------------------------------------------------------------- rates

def encode_floor(x: np.ndarray, out: Path) -> float:
    """Seconds for numpy to encode ``x`` as int8 codes and per-row scales and write both once."""
    t0 = time.perf_counter()
    for a in range(0, len(x), 8192):
        b = x[a : a + 8192]
        s = np.abs(b).max(axis=1) / np.float32(127)
        q = np.rint(b / np.where(s > 0, s, 1)[:, None]).astype(np.int8)
        with open(out, "ab") as f:
            f.write(q.tobytes())
            f.write(s.astype(np.float32).tobytes())
    return time.perf_counter() - t0


def writer_rate(x: np.ndarray, out: Path, dtype: str) -> float:
    t0 = time.perf_counter()
    with DatasetWriter(out, layers=[0], dim=x.shape[1], model_name="bench", dtype=dtype, checksums=False,
                       statistics=False, shard_size="256MiB") as w:
        for a in range(0, len(x), 8192):
            b = x[a : a + 8192]
            w.add_batch(texts=["x"] * len(b), num_tokens=[1] * len(b), hidden={0: b})
    return time.perf_counter() - t0


def read_floor(path: Path, batch: int, bf16: bool = False) -> float:
    """Seconds to read every byte of the int8 layer, dequantize it with numpy and gather shuffled batches (``bf16``:
    each batch then cast to a bfloat16 tensor by torch, what a bfloat16 batch costs on top)."""
    import torch

    entries = []
    for p in sorted((path / "tensors").rglob("*.safetensors")):
        t = read_header(p).tensors
        entries.append((p, t["hidden.layer_0"], t["hidden.layer_0.scale"]))
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for p, e, s in entries:
        codes = np.fromfile(p, dtype=np.int8, count=e.end - e.start, offset=e.start).reshape(e.shape)
        scales = np.fromfile(p, dtype=np.float32, count=(s.end - s.start) // 4, offset=s.start)
        x = codes.astype(np.float32)
        x *= scales[:, None]
        order = rng.permutation(len(x))
        for i in range(0, len(x), batch):
            b = x[order[i : i + batch]]
            if bf16:
                torch.from_numpy(b).to(torch.bfloat16).sum()
            else:
                b.sum()
    return time.perf_counter() - t0


def stream_rate(path: Path, batch: int, dtype: str) -> float:
    t0 = time.perf_counter()
    for b in ShardStream(path, 0, batch, seed=0, dtype=dtype):
        b.sum()
    return time.perf_counter() - t0


def best(n: int, fn) -> float:
    return min(fn() for _ in range(n))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-quality", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-int8-"))
    try:
        if not args.skip_quality:
            n_train, n_eval, epochs = (150, 40, 2) if args.quick else (1500, 200, 4)
            q = quality(root, n_train, n_eval, epochs)
            print(f"quality: lmprobe-tiny layer {LAYER}, {q['tokens']:,} training tokens, {q['eval_tokens']:,} held out, "
                  f"dim {q['dim']}, top-16 SAE with {8 * q['dim']} latents, seeds 0-2, evaluated on float32")
            for d in ("float32", "bfloat16", "int8"):
                rs = q["results"][d]
                fvu = np.array([r["fvu"] for r in rs])
                print(f"  {d:9s} {q['per_tok'][d]:7.1f} B/token ({q['per_tok'][d] / q['per_tok']['bfloat16']:.3f}x bf16)"
                      f"  storage rel MSE {q['err'][d]:.1e}  FVU {fvu.mean():.4f} (seeds {', '.join(f'{v:.4f}' for v in fvu)})"
                      f"  L0 {np.mean([r['l0'] for r in rs]):.1f}  dead {[r['dead'] for r in rs]}"
                      f"  splice dLoss {np.mean([r['dloss'] for r in rs]):+.4f} (base {q['base_loss']:.3f})")
            f_bf = np.mean([r["fvu"] for r in q["results"]["bfloat16"]])
            f_q = np.mean([r["fvu"] for r in q["results"]["int8"]])
            spread = np.ptp([r["fvu"] for r in q["results"]["bfloat16"]])
            ratio = q["per_tok"]["int8"] / q["per_tok"]["bfloat16"]
            print(f"  int8 FVU / bf16 FVU = {f_q / f_bf:.4f} (seed spread of bf16: {spread:.4f}); "
                  f"bytes {ratio:.3f}x -> {'PASS' if abs(f_q / f_bf - 1) <= 0.01 and ratio <= 0.52 else 'FAIL'}")
        n, dim, batch = (16384, 1024, 1024) if args.quick else (65536, 1024, 4096)
        x = np.random.default_rng(0).standard_normal((n, dim), dtype=np.float32)
        x[:, 7] *= 30  # an outlier dimension
        w_floor = best(3, lambda: encode_floor(x, root / f"floor-{time.perf_counter_ns()}.bin"))
        w_int8 = best(3, lambda: writer_rate(x, root / f"w-{time.perf_counter_ns()}", "int8"))
        w_bf16 = best(3, lambda: writer_rate(x, root / f"w-{time.perf_counter_ns()}", "bfloat16"))
        mb = x.nbytes / 2**20
        print(f"writer, {n:,} rows x {dim} float32 ({mb:.0f} MiB in): int8 {mb / w_int8:.0f} MiB/s, floor (numpy "
              f"encode + write) {mb / w_floor:.0f} MiB/s -> {w_floor / w_int8:.2f}x of floor; bfloat16 writer "
              f"{mb / w_bf16:.0f} MiB/s")
        ds_path = root / "read-int8"
        writer_rate(x, ds_path, "int8")
        read_floor(ds_path, batch)  # warm the page cache for both
        for out in ("float32", "bfloat16"):
            r_floor = best(3, lambda out=out: read_floor(ds_path, batch, bf16=out == "bfloat16"))
            r = best(3, lambda out=out: stream_rate(ds_path, batch, out))
            print(f"reader, ShardStream over the int8 layer, {out} out, batches of {batch}: {n / r:,.0f} rows/s, floor "
                  f"(numpy read + dequantize + shuffled gather{' + cast' if out == 'bfloat16' else ''}) {n / r_floor:,.0f} rows/s -> {r_floor / r:.2f}x of floor")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
