"""lmprobe-tiny extracted on CUDA and on the CPU with the defaults, stored in float32, bfloat16 and int8: every
stored vector compared, each CUDA dataset validated.

    PYTHONPATH=. python benchmarks/gpu_dtypes.py     # on a GPU machine (a minute)

The exit status is 1 when a layer differs by more than rounding (1e-4 of the largest value in float32, 2e-2 in
bfloat16 and int8)."""
import sys
import tempfile
import time

import numpy as np
import torch

import lmprobe

texts = [f"The {w} was {a} and the night was long number {i}." for i, (w, a) in
         enumerate((w, a) for w in ("film", "hotel", "trip", "game", "book", "coffee", "city", "song")
                   for a in ("great", "terrible", "fine", "odd"))]
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
bad = 0
with tempfile.TemporaryDirectory() as d:
    for dtype in ("float32", "bfloat16", "int8"):
        got = {}
        for device in ("cpu", "cuda"):
            t = time.perf_counter()
            ds = lmprobe.extract("lmprobe-tiny", texts, out=f"{d}/{dtype}-{device}", layers="0,-1",
                                 storage="full_sequence", dtype=dtype, device=device, logits_topk=5,
                                 quiet=True)
            got[device] = ds
            print(f"{dtype} {device}: {ds.num_prompts} prompts in {time.perf_counter() - t:.1f} s")
        a, b = got["cpu"], got["cuda"]
        for layer in a.layers:
            x, y = a.hidden(layer).astype(np.float32), b.hidden(layer).astype(np.float32)
            scale = float(np.abs(x).max())
            diff = float(np.abs(x - y).max())
            tol = {"float32": 1e-4, "bfloat16": 2e-2, "int8": 2e-2}[dtype] * max(scale, 1.0)
            ok = diff <= tol
            bad += not ok
            print(f"  layer {layer}: max |cpu - cuda| {diff:.3g} (scale {scale:.3g}) {'ok' if ok else 'DIFFERS'}")
        print("  validate cuda:", "ok" if lmprobe.validate(f"{d}/{dtype}-cuda").ok else "FAILED")
sys.exit(1 if bad else 0)
