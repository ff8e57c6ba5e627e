"""The data path at GPU rate: writer, training reader, bulk reads and export, as ratios to their floors.

    python benchmarks/bench_datapath.py                  # everything (~10 min on 2 cores, ~7 GB of temporary files)
    python benchmarks/bench_datapath.py --quick          # small sizes, a smoke run
    python benchmarks/bench_datapath.py --only writer    # stages | writer | stream | read | saev

Every figure is a ratio to a floor measured in the same process on the same bytes, in interleaved
repetitions (floor, then each lmprobe variant, repeated), printed as min / median / max over the
repetitions. lmprobe runs with its defaults on: statistics and sha256 checksums.

Floors:
- writer: ``tofile`` of the same bytes to the same disk in files of the shard size, each file
  hashed (sha256) on a second thread as it closes (the least work a checksummed writer does); plain
  ``tofile`` without hashing is printed beside it, and is the floor for the checksums-off writer.
  "tofile" is ``f.write`` of each array's buffer: numpy's own ``ndarray.tofile`` ran 2-3x slower
  than that on this machine, and a floor must be the fastest plain write.
- training reader: every shard's tensor bytes read (``readinto``) into one buffer allocated before the
  clock, then every row gathered into batches by a random permutation and converted to float32 at
  memory speed into a reused batch (bfloat16: torch's cast into the numpy batch). The reader does
  more than this floor: it yields a new batch each time (the caller keeps it).
- bulk reads (``ds.hidden`` / ``ds.token_hidden``): ``readinto`` of the tensor bytes into a new
  array, then the same conversion into a new float32 array (the allocations a reader's result needs):
  for ``ds.hidden`` the whole layer at once; for ``ds.token_hidden`` each prompt's rows into arrays of
  the prompt's size (what a per-prompt result needs), and, reported beside it, the same share of the
  whole-layer floor (one large allocation: the bound for reading prompt by prompt).
- export-saev: ``cp`` of a file of the output's size (the kernel copies it: copy_file_range); beside it,
  ``f.write`` of the output's bytes from one reused 64 MiB block, which on this VM's page cache
  sometimes stalls where ``cp`` does not (reported).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import lmprobe  # noqa: E402
from lmprobe.format.statistics import batch_statistics  # noqa: E402
from lmprobe.format.values import bfloat16_bits_to_float32  # noqa: E402
from lmprobe.format.writer import DatasetWriter  # noqa: E402
from lmprobe.saev import export_saev  # noqa: E402
from lmprobe.stream import ShardStream  # noqa: E402

GiB = 1 << 30


def spread(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{xs[0]:.2f} / {float(np.median(xs)):.2f} / {xs[-1]:.2f}"


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def drop(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ writer


def tofile_floor(out: Path, batches: list[list[np.ndarray]], n_batches: int, shard_bytes: int, *, hash_: bool) -> None:
    """Each layer's bytes into files of at most ``shard_bytes``; each closed file hashed on one thread."""
    out.mkdir(parents=True)
    layers = len(batches[0])
    hasher = ThreadPoolExecutor(1)
    futures = []
    files = [None] * layers
    sizes = [0] * layers
    counts = [0] * layers

    def close(i: int) -> None:
        files[i].close()
        if hash_:
            futures.append(hasher.submit(sha256_file, Path(files[i].name)))
        files[i] = None

    for b in range(n_batches):
        for i, a in enumerate(batches[b % len(batches)]):
            if files[i] is not None and sizes[i] + a.nbytes > shard_bytes:
                close(i)
            if files[i] is None:
                files[i] = open(out / f"l{i}-{counts[i]}.bin", "wb")
                sizes[i], counts[i] = 0, counts[i] + 1
            files[i].write(memoryview(a).cast("B"))  # numpy's tofile is 2-3x slower than this here
            sizes[i] += a.nbytes
    for i in range(layers):
        close(i)
    for f in futures:
        f.result()
    hasher.shutdown()


def run_writer(out: Path, batches, parts, n_batches: int, dtype: str, tokens: int, *, checksums: bool,
               device_stats: bool) -> None:
    layers = len(batches[0])
    with DatasetWriter(out, layers=list(range(layers)), dim=batches[0][0].shape[1], model_name="bench",
                       storage="full_sequence", dtype=dtype, statistics=True, checksums=checksums) as w:
        n_prompts = batches[0][0].shape[0] // tokens
        for b in range(n_batches):
            k = b % len(batches)
            w.add_batch(texts=[""] * n_prompts, num_tokens=[tokens] * n_prompts,
                        hidden={i: a for i, a in enumerate(batches[k])},
                        statistics={i: p for i, p in enumerate(parts[k])} if device_stats else None)


def bench_writer(tmp: Path, dtype: str, layers: int, total_bytes: int, reps: int, dim: int, tokens: int,
                 prompts: int) -> None:
    rng = np.random.default_rng(0)
    rows = prompts * tokens
    # what a backend hands the writer: CPU tensors in the storage dtype (numpy for float32)
    batches = []
    for _ in range(2):
        per_layer = []
        for _ in range(layers):
            x = torch.from_numpy(rng.standard_normal((rows, dim), dtype=np.float32) + 1.0)
            per_layer.append(x.to(torch.bfloat16) if dtype == "bfloat16" else x.numpy())
        batches.append(per_layer)
    raw = [[(a.view(torch.int16).numpy() if isinstance(a, torch.Tensor) else a) for a in per] for per in batches]
    # the partial statistics a GPU computes next to the forward pass (prepared outside the clock, as
    # the activations themselves are)
    parts = [[batch_statistics(a) for a in per] for per in batches]
    batch_bytes = raw[0][0].nbytes * layers
    n_batches = max(1, total_bytes // batch_bytes)
    written = n_batches * batch_bytes
    from lmprobe.format.spec import DEFAULT_SHARD_SIZE

    print(f"writer: {dtype}, {layers} layer(s) x dim {dim}, full_sequence, {prompts} windows of {tokens} tokens a "
          f"batch, {written / 1e9:.2f} GB, shards of {DEFAULT_SHARD_SIZE / GiB:.0f} GiB, {reps} interleaved runs")
    variants = {
        "tofile": lambda d: tofile_floor(d, raw, n_batches, DEFAULT_SHARD_SIZE, hash_=False),
        "tofile+sha256": lambda d: tofile_floor(d, raw, n_batches, DEFAULT_SHARD_SIZE, hash_=True),
        "defaults, device stats": lambda d: run_writer(d, batches, parts, n_batches, dtype, tokens,
                                                        checksums=True, device_stats=True),
        "defaults, host stats": lambda d: run_writer(d, batches, parts, n_batches, dtype, tokens,
                                                      checksums=True, device_stats=False),
        "no checksums, device stats": lambda d: run_writer(d, batches, parts, n_batches, dtype, tokens,
                                                            checksums=False, device_stats=True),
        "no checksums, host stats": lambda d: run_writer(d, batches, parts, n_batches, dtype, tokens,
                                                          checksums=False, device_stats=False),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            d = tmp / "w"
            times[name].append(timed(lambda fn=fn, d=d: fn(d)))
            drop(d)
    floor = times["tofile+sha256"]
    plain = times["tofile"]
    for name, ts in times.items():
        gbs = [written / t / 1e9 for t in ts]
        line = f"  {name:28s} {spread(gbs)} GB/s"
        if name.startswith("defaults"):
            line += f"   ratio to tofile+sha256 {spread([f / t for f, t in zip(floor, ts, strict=True)])}"
            line += " (target >= 0.9)" if "device" in name else " (reported)"
        elif name.startswith("no checksums"):
            line += f"   ratio to tofile {spread([f / t for f, t in zip(plain, ts, strict=True)])}"
            line += " (target >= 0.9)" if "device" in name else " (reported)"
        print(line, flush=True)


# ------------------------------------------------------------------------------------------ readers


def make_dataset(out: Path, dtype: str, n_vectors: int, dim: int, shard: str, storage: str = "pooled",
                 tokens: int = 1) -> None:
    rng = np.random.default_rng(1)
    step = 8192
    with DatasetWriter(out, layers=[0], dim=dim, model_name="bench", dtype=dtype, shard_size=shard,
                       storage=storage, overwrite=True, statistics=True) as w:
        for a in range(0, n_vectors, step):
            x = rng.standard_normal((min(step, n_vectors - a), dim), dtype=np.float32)
            t = torch.from_numpy(x).to(torch.bfloat16) if dtype == "bfloat16" else x
            w.add_batch(texts=[""] * (len(x) // tokens), num_tokens=[tokens] * (len(x) // tokens), hidden={0: t})


def read_all(files: list, out: np.ndarray) -> None:
    """Every shard's tensor bytes, one after the other, into ``out`` with ``readinto`` (the floors' read)."""
    at = 0
    for path, entry in files:
        with open(path, "rb", buffering=0) as f:
            f.seek(entry.start)
            view = memoryview(out[at : at + entry.shape[0]]).cast("B")
            got = 0
            while got < len(view):
                got += f.readinto(view[got:])
        at += entry.shape[0]


def convert_into(src: np.ndarray, out: np.ndarray) -> None:
    if src.dtype == np.uint16:
        torch.from_numpy(out).copy_(torch.from_numpy(src.view(np.int16)).view(torch.bfloat16))
    else:
        np.copyto(out, src)


def bench_stream(tmp: Path, reps: int, n_vectors: int, dim: int, batch: int) -> None:
    for dtype in ("bfloat16", "float32"):
        d = tmp / f"stream-{dtype}"
        make_dataset(d, dtype, n_vectors, dim, "64MiB")

        ds = lmprobe.load(d)
        files = [ds.shards.hidden_shard(0, s) for s in range(len(ds.hidden_desc().shards))]
        storage = np.uint16 if dtype == "bfloat16" else np.float32
        whole = np.ones((n_vectors, dim), dtype=storage)  # allocated and faulted in before the clock
        out = np.ones((batch, dim), dtype=np.float32)

        def floor(files=files, whole=whole, out=out, storage=storage):
            """The least work: every byte read once into memory, every row gathered once and converted."""
            read_all(files, whole)
            perm = np.random.default_rng(0).permutation(len(whole))
            raw = np.empty((batch, dim), dtype=storage)
            for a in range(0, len(perm), batch):
                k = min(batch, len(perm) - a)
                np.take(whole, perm[a : a + k], axis=0, out=raw[:k], mode="clip")
                convert_into(raw[:k], out[:k])

        def ours(d=d):
            for _ in ShardStream(d, 0, batch, seed=0, memory="256MiB"):
                pass

        def ours_b16(d=d):
            for _ in ShardStream(d, 0, batch, seed=0, memory="256MiB", dtype="bfloat16"):
                pass

        os.sync()  # the new dataset's dirty pages go to disk now, not during the timed runs
        floor()
        ours()  # warm-up: page cache, allocator, the converter thread
        tf, to, tb = [], [], []
        for _ in range(reps):
            tf.append(timed(floor))
            to.append(timed(ours))
            tb.append(timed(ours_b16))
        gb = n_vectors * dim * (2 if dtype == "bfloat16" else 4) / 1e9
        print(f"ShardStream: {dtype} dataset, {n_vectors:,} vectors x {dim} ({gb:.2f} GB in 64 MiB shards), batch "
              f"{batch}, memory 256MiB, {reps} interleaved runs")
        print(f"  floor (fromfile + gather + convert) {spread([n_vectors / t / 1e6 for t in tf])} M vectors/s")
        print(f"  float32 batches  {spread([n_vectors / t / 1e6 for t in to])} M vectors/s   ratio "
              f"{spread([f / t for f, t in zip(tf, to, strict=True)])} (target >= 0.9)")
        print(f"  dtype='bfloat16' {spread([n_vectors / t / 1e6 for t in tb])} M vectors/s   ratio "
              f"{spread([f / t for f, t in zip(tf, tb, strict=True)])} (reported)", flush=True)
        drop(d)


def bench_read(tmp: Path, reps: int, n_vectors: int, dim: int, tokens: int) -> None:
    pooled = tmp / "read-pooled"
    seq = tmp / "read-seq"
    make_dataset(pooled, "bfloat16", n_vectors, dim, "1GiB")
    make_dataset(seq, "bfloat16", n_vectors, dim, "1GiB", storage="full_sequence", tokens=tokens)

    def floor(d: Path):
        """Read every shard's tensor bytes (readinto) into a new array, convert them into a new float32 array."""
        ds = lmprobe.load(d)
        files = [ds.shards.hidden_shard(0, s) for s in range(len(ds.hidden_desc().shards))]

        def run():
            n = sum(e.shape[0] for _, e in files)
            raw = np.empty((n, dim), dtype=np.uint16)
            read_all(files, raw)
            convert_into(raw, np.empty((n, dim), dtype=np.float32))
        return run

    os.sync()
    ds_p = lmprobe.load(pooled)
    ds_s = lmprobe.load(seq)
    floor(pooled)()
    ds_p.hidden(0)  # warm-up
    n_prompts = ds_s.num_prompts
    prompts_per_read = max(1, n_prompts // 8)  # token_hidden reads a prompt at a time: read many
    runs = prompt_runs(ds_s, prompts_per_read)

    def prompt_floor():
        """Each prompt's rows read (readinto) into a new array of its size and converted into a new float32 one
        (kept, as the caller of token_hidden keeps its results)."""
        kept = []
        for n_rows, pieces in runs:
            raw = np.empty((n_rows, dim), dtype=np.uint16)
            for path, at, row, k in pieces:
                with open(path, "rb", buffering=0) as f:
                    f.seek(at)
                    f.readinto(memoryview(raw[row : row + k]).cast("B"))
            kept.append(np.empty((n_rows, dim), dtype=np.float32))
            convert_into(raw, kept[-1])
        return kept

    tp, fp, ts, fs, fpp = [], [], [], [], []
    for _ in range(reps):
        fp.append(timed(floor(pooled)))
        tp.append(timed(lambda: ds_p.hidden(0)))
        fs.append(timed(floor(seq)))
        fpp.append(timed(prompt_floor))
        ts.append(timed(lambda: [ds_s.token_hidden(i, 0) for i in range(prompts_per_read)]))
    gb = n_vectors * dim * 2 / 1e9
    frac = prompts_per_read / n_prompts
    print(f"bulk reads of bfloat16, {n_vectors:,} vectors x {dim} ({gb:.2f} GB stored, float32 out), {reps} runs")
    print(f"  ds.hidden(0), pooled: ratio to fromfile + conversion {spread([f / t for f, t in zip(fp, tp, strict=True)])}"
          f" ({spread([gb * 2 / t for t in tp])} GB/s out; target >= 0.8)")
    print(f"  ds.token_hidden, {prompts_per_read} prompts of {tokens} tokens: ratio to fromfile + conversion of each "
          f"prompt {spread([f / t for f, t in zip(fpp, ts, strict=True)])} (target >= 0.8); to the same share of "
          f"the whole layer's {spread([f * frac / t for f, t in zip(fs, ts, strict=True)])} (reported)", flush=True)
    drop(pooled)
    drop(seq)


def prompt_runs(ds, n: int) -> list[tuple[int, list[tuple[str, int, int, int]]]]:
    """Prompts 0..n-1 of a full_sequence dataset: (rows, [(shard file, byte offset, first row, rows)]) each."""
    out = []
    for i in range(n):
        ids, offs, _ = ds.shards.token_addresses([i])
        cut = np.flatnonzero((np.diff(ids) != 0) | (np.diff(offs) != 1)) + 1
        pieces = []
        for a, b in zip(np.r_[0, cut].tolist(), np.r_[cut, len(ids)].tolist(), strict=True):
            path, entry = ds.shards.hidden_shard(0, int(ids[a]))
            row_bytes = (entry.end - entry.start) // entry.shape[0]
            pieces.append((str(path), entry.start + int(offs[a]) * row_bytes, a, b - a))
        out.append((len(ids), pieces))
    return out


def bench_saev(tmp: Path, reps: int, n_vectors: int, dim: int, tokens: int) -> None:
    for dtype in ("float32", "bfloat16"):
        src = tmp / f"saev-src-{dtype}"
        make_dataset(src, dtype, n_vectors, dim, "256MiB", storage="full_sequence", tokens=tokens)
        out = tmp / "saev-out"

        def export(src=src, out=out):
            export_saev(src, out, layers=[0], context_len=tokens, quiet=True)

        os.sync()
        export()  # a warm-up, and the output's size for the floor
        out_bytes = sum(p.stat().st_size for p in out.rglob("acts*.bin"))
        drop(out)
        blob = tmp / "blob"
        np.ones(out_bytes // 4, dtype=np.float32).tofile(blob)
        block = np.ones(16 << 20, dtype=np.float32)  # 64 MiB, export-saev's chunk

        def write_out(block=block, out_bytes=out_bytes):
            """The output's bytes written from one reused block: what any exporter's writes cost, at least."""
            with open(tmp / "blob3", "wb") as f:
                for a in range(0, out_bytes, block.nbytes):
                    f.write(memoryview(block).cast("B")[: min(block.nbytes, out_bytes - a)])

        t_cp, t_wr, t_ex = [], [], []
        for _ in range(reps):
            t_cp.append(timed(lambda blob=blob: subprocess.run(["cp", str(blob), str(tmp / "blob2")], check=True)))
            (tmp / "blob2").unlink()
            t_wr.append(timed(write_out))
            (tmp / "blob3").unlink()
            t_ex.append(timed(export))
            drop(out)
        blob.unlink()
        print(f"export-saev from {dtype}: {n_vectors:,} vectors x {dim}, windows of {tokens}, output "
              f"{out_bytes / 1e9:.2f} GB float32, {reps} runs")
        print(f"  ratio to cp of an output-sized file {spread([c / t for c, t in zip(t_cp, t_ex, strict=True)])} "
              f"({spread([out_bytes / t / 1e9 for t in t_ex])} GB/s; target >= 0.8); cp "
              f"{spread([out_bytes / t / 1e9 for t in t_cp])} GB/s", flush=True)
        print(f"  ratio to writing the output's bytes from memory {spread([w / t for w, t in zip(t_wr, t_ex, strict=True)])}"
              f" (writes {spread([out_bytes / t / 1e9 for t in t_wr])} GB/s; reported)", flush=True)
        drop(src)


def bench_stages(tmp: Path, quick: bool) -> None:
    """What each stage of the data path sustains on one core here (GB/s of the bytes it handles)."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    n = (1 << 24) if quick else (1 << 27)  # values: 32 / 256 MB of bfloat16
    x32 = rng.standard_normal(n, dtype=np.float32)
    bits = torch.from_numpy(x32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    out = np.empty(n, dtype=np.float32)
    path = tmp / "stage.bin"
    rates = {}

    def best(fn, nbytes, reps=3):
        return max(nbytes / timed(fn) / 1e9 for _ in range(reps))

    def write():
        with open(path, "wb") as f:
            f.write(memoryview(bits).cast("B"))

    rates["page-cache write (f.write)"] = best(write, bits.nbytes)
    rates["sha256 (hashlib, page cache)"] = best(lambda: sha256_file(path), bits.nbytes)
    path.unlink()
    # the conversion's cast on this thread (torch: one thread); bfloat16_bits_to_float32 splits a read this
    # large between two converter threads, which is two cores
    src, dst = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), torch.from_numpy(out)
    rates["bfloat16 -> float32 (GB/s of float32 out)"] = best(lambda: dst.copy_(src), out.nbytes)
    rates["bfloat16 -> float32, two converter threads"] = best(lambda: bfloat16_bits_to_float32(bits, out=out),
                                                              out.nbytes)
    b2 = bits.reshape(-1, 2048)
    rates["statistics on the host, bfloat16 (GB/s in)"] = best(lambda: batch_statistics(b2, bfloat16_bits=True),
                                                               bits.nbytes)
    rates["statistics on the host, float32 (GB/s in)"] = best(lambda: batch_statistics(x32.reshape(-1, 2048)),
                                                              x32.nbytes)
    tokens = (1 << 20) if quick else (1 << 22)

    def index_only():  # dim 1: what is left is the per-token bookkeeping and the parquet index
        with DatasetWriter(tmp / "idx", layers=[0], dim=1, model_name="bench", storage="full_sequence",
                           overwrite=True) as w:
            for _ in range(tokens // 8192):
                w.add_batch(texts=[""] * 8, num_tokens=[1024] * 8, hidden={0: np.zeros((8192, 1), np.float32)})

    per_token = min(timed(index_only) for _ in range(2)) / tokens
    drop(tmp / "idx")
    torch.set_num_threads(os.cpu_count() or 1)
    print("stages, one core each:")
    for k, v in rates.items():
        print(f"  {k:45s} {v:6.2f} GB/s")
    print(f"  {'index and per-token bookkeeping':45s} {1 / per_token / 1e6:6.2f} M tokens/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["stages", "writer", "stream", "read", "saev"], default=None)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    load = os.getloadavg()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with "
          f"{torch.get_num_threads()} threads; load average before {load[0]:.2f}")
    tmp = Path(tempfile.mkdtemp(prefix="lmprobe-datapath-"))
    q = args.quick
    try:
        if args.only in (None, "stages"):
            bench_stages(tmp, q)
        if args.only in (None, "writer"):
            for dtype, layers, total in (("bfloat16", 1, 3 * GiB), ("bfloat16", 4, 6 * GiB), ("float32", 1, 3 * GiB)):
                bench_writer(tmp, dtype, layers, total // 16 if q else total, args.reps, dim=2048, tokens=1024,
                             prompts=2 if q else 8)
        if args.only in (None, "stream"):
            bench_stream(tmp, args.reps, 32768 if q else 262144, 1024, 4096)
        if args.only in (None, "read"):
            bench_read(tmp, args.reps, 32768 if q else 262144, 2048, 1024)
        if args.only in (None, "saev"):
            bench_saev(tmp, args.reps, 32768 if q else 262144, 1024, 128)
    finally:
        drop(tmp)
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
