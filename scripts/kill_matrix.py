"""The interrupted-operation matrix of issues 27 and 36: kill -9 each operation at random and phase points, run the
same command again, and compare the result with an uninterrupted run.

    python scripts/kill_matrix.py [--work DIR] [--kills N] [--seed S] [--only push,pull,...] [--out results.json]

Everything runs on 127.0.0.1: a local Hub (tests/support/hub_server.py) and a moto S3 server. Writes a markdown table
(operation | kill points tried | outcome) to stdout and the details as JSON to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
LMPROBE = [PY, "-m", "lmprobe"]
RESULTS: list[dict] = []


# --------------------------------------------------------------------------------------------- helpers
def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def run(cmd, env, timeout=600, cwd=None):
    t = time.time()
    p = subprocess.run(cmd, env=env, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)
    p.wall = time.time() - t
    return p


def kill_after(cmd, env, delay=None, until=None, timeout=300):
    """Start ``cmd``; SIGKILL its process group after ``delay`` s or when ``until()`` is true. Returns
    (killed, seconds)."""
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         start_new_session=True)
    while p.poll() is None:
        el = time.time() - t0
        if (delay is not None and el >= delay) or (until is not None and until()) or el > timeout:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return True, round(el, 2)
        time.sleep(0.01)
    return False, round(time.time() - t0, 2)


def traceback_in(p) -> bool:
    return "Traceback" in (p.stderr or "") or "Traceback" in (p.stdout or "")


def one_line(p) -> str:
    lines = [ln for ln in (p.stderr or "").strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def tree_hashes(root: Path, skip=()) -> dict[str, str]:
    out = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if f.is_file() and not any(re.search(s, rel) for s in skip):
            out[rel] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def diff_trees(a: dict, b: dict) -> str:
    if a == b:
        return ""
    only_a = sorted(set(a) - set(b))
    only_b = sorted(set(b) - set(a))
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    return f"only in reference {only_a[:5]}, only in re-run {only_b[:5]}, differing {differ[:5]}"


def compare_datasets(ref, got, env) -> str:
    """'' when ``got`` validates and holds the same values as ``ref`` (both local folders or URLs)."""
    if not str(got).startswith("s3://"):
        v = run(LMPROBE + ["validate", str(got)], env)
        if v.returncode != 0:
            return f"validate failed: {one_line(v)}"
    code = (
        "import sys, json, numpy as np, lmprobe\n"
        "a, b = lmprobe.load(sys.argv[1]), lmprobe.load(sys.argv[2])\n"
        "errs = []\n"
        "ta, tb = a.table, b.table\n"
        "if ta.column_names != tb.column_names: errs.append(f'columns {ta.column_names} vs {tb.column_names}')\n"
        "else:\n"
        "    for c in ta.column_names:\n"
        "        if not ta.column(c).equals(tb.column(c)): errs.append(f'index column {c} differs')\n"
        "if a.layers != b.layers: errs.append(f'layers {a.layers} vs {b.layers}')\n"
        "for L in b.layers_here() if hasattr(b, 'layers_here') else b.layers:\n"
        "    if a.storage == 'full_sequence':\n"
        "        ia, oa, la = a.shards.token_addresses(); ib, ob, lb = b.shards.token_addresses()\n"
        "        xa = np.asarray(a.shards.read_hidden_rows(L, ia, oa)); xb = np.asarray(b.shards.read_hidden_rows(L, ib, ob))\n"
        "        if not np.array_equal(la, lb): errs.append(f'token lengths differ')\n"
        "    else:\n"
        "        xa, xb = np.asarray(a.hidden(L)), np.asarray(b.hidden(L))\n"
        "    if xa.shape != xb.shape or not np.array_equal(xa, xb): errs.append(f'layer {L} values differ')\n"
        "    if a.storage == 'full_sequence':\n"
        "        for i in (0, a.num_prompts - 1):\n"
        "            if not np.array_equal(np.asarray(a.token_hidden(i, L)), np.asarray(b.token_hidden(i, L))):\n"
        "                errs.append(f'token_hidden({i}, {L}) differs')\n"
        "print(json.dumps(errs))\n"
    )
    p = run([PY, "-c", code, str(ref), str(got)], env)
    if p.returncode != 0:
        return f"compare crashed: {one_line(p)}"
    errs = json.loads(p.stdout.strip().splitlines()[-1])
    return "; ".join(errs)


def record(op, points, outcome, detail=None, failed=False, repro=None):
    RESULTS.append({"operation": op, "kill_points": points, "outcome": outcome, "failed": failed,
                    "detail": detail, "repro": repro})
    log(("FAILED " if failed else "ok ") + op, outcome, detail or "")


def classify_rerun(rerun, diff, killed):
    """outcome text of one kill + re-run"""
    if rerun.returncode != 0:
        if traceback_in(rerun):
            return False, f"FAILED: re-run traceback: {one_line(rerun)}"
        return False, f"refused: {one_line(rerun)}"
    if diff:
        return False, f"FAILED: re-run differs: {diff}"
    return True, "identical"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# --------------------------------------------------------------------------------------------- data
def write_dataset(out: Path, *, dim, layers, n_prompts, tok_range, seed=0, shard_size="64MiB", token_ids=True,
                  model_name="lmprobe-tiny"):
    from lmprobe.format.writer import DatasetWriter

    rng = np.random.default_rng(seed)
    with DatasetWriter(out, layers=list(layers), dim=dim, model_name=model_name, storage="full_sequence",
                       label_type="int", shard_size=shard_size, token_ids=token_ids, overwrite=True) as w:
        for start in range(0, n_prompts, 256):
            b = min(256, n_prompts - start)
            n_tok = rng.integers(tok_range[0], tok_range[1], size=b)
            total = int(n_tok.sum())
            hidden = {L: rng.standard_normal((total, dim), dtype=np.float32) for L in layers}
            ids = [rng.integers(0, 500, size=int(t)).tolist() for t in n_tok]
            w.add_batch(texts=[f"prompt {start + i}" for i in range(b)], labels=rng.integers(0, 2, size=b).tolist(),
                        num_tokens=n_tok, hidden=hidden, token_ids=ids if token_ids else None)
    return out


def write_sparsify_save(folder: Path, n_features, dim, seed=0, k=None):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"expansion_factor": n_features // dim, "normalize_decoder": True, "num_latents": n_features,
           "k": k or 32, "multi_topk": False, "skip_connection": False, "d_in": dim}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file({"encoder.weight": (rng.standard_normal((n_features, dim), dtype=np.float32) / np.sqrt(dim)),
               "encoder.bias": rng.standard_normal(n_features, dtype=np.float32) * 0.1,
               "W_dec": rng.standard_normal((n_features, dim), dtype=np.float32) / np.sqrt(dim),
               "b_dec": rng.standard_normal(dim, dtype=np.float32) * 0.1}, str(folder / "sae.safetensors"))
    return folder


def kill_points(rng, wall, n, lo=0.03, hi=0.97):
    return sorted(round(rng.uniform(lo * wall, hi * wall), 2) for _ in range(n))


# --------------------------------------------------------------------------------------------- matrix cells
def generic_matrix(name, cmd_for, out_for, reset, compare, env, rng, n_kills, phase_preds=(), clean=None):
    """Reference run, then N random kill points + phase kill points; re-run the same command and compare."""
    ref_out = out_for("ref")
    reset(ref_out)
    p = run(cmd_for(ref_out), env)
    if p.returncode != 0:
        record(name, [], f"FAILED: reference run failed: {one_line(p)}", p.stderr[-2000:], failed=True)
        return None
    wall = p.wall
    log(f"{name}: reference {wall:.1f}s")
    points = [("t", d) for d in kill_points(rng, wall, n_kills)] + [("phase", pp) for pp in phase_preds]
    tried, outcomes, fails = [], [], []
    for i, (kind, val) in enumerate(points):
        out = out_for(f"k{i}")
        reset(out)
        cmd = cmd_for(out)
        if kind == "t":
            killed, at = kill_after(cmd, env, delay=val)
            label = f"{val}s"
        else:
            pname, pred = val
            killed, at = kill_after(cmd, env, until=lambda pred=pred, out=out: pred(out))
            label = f"{pname}@{at}s"
        if not killed:
            label += "(finished first)"
        tried.append(label)
        rerun = run(cmd, env)
        diff = compare(ref_out, out) if rerun.returncode == 0 else ""
        ok, text = classify_rerun(rerun, diff, killed)
        outcomes.append(f"{label}: {text}" + (f" (re-run {rerun.wall:.1f}s, reference {wall:.1f}s)"
                                               if rerun.returncode == 0 else ""))
        if not ok and text.startswith("FAILED"):
            fails.append({"kill": label, "cmd": " ".join(map(str, cmd)), "stderr": rerun.stderr[-3000:],
                          "diff": diff})
        if clean:
            clean(out)
    summary = _summarize(outcomes)
    record(name, tried, summary, {"per_kill": outcomes, "failures": fails}, failed=bool(fails))
    return ref_out


def _summarize(outcomes):
    texts = [re.sub(r" \(re-run .*\)$", "", o.split(": ", 1)[1]) for o in outcomes]
    counts = {}
    for t in texts:
        counts[t] = counts.get(t, 0) + 1
    return "; ".join(f"{n}x {t}" for t, n in counts.items())


# ---- export-saev
def cell_export_saev(w: Path, env, rng, n):
    ds = w / "big"
    if not (ds / "index").exists():
        log("writing the export-saev source dataset")
        write_dataset(ds, dim=256, layers=[0, 1], n_prompts=3000, tok_range=(40, 120), shard_size="32MiB")
    for variant, extra, sub in [("plain", [], "dump"), ("compat 2.0", ["--saev-compat"], "saev/shards"),
                                ("compat 2.1", ["--saev-compat", "2.1"], "saev/shards")]:
        def out_for(tag, sub=sub, variant=variant):
            return w / "saev" / variant.replace(" ", "_") / tag / sub

        def cmd_for(out, extra=extra):
            return LMPROBE + ["export-saev", str(ds), "--out", str(out), "--layers", "0,1", "--patches-per-shard",
                              "40000", "--quiet"] + extra

        def reset(out):
            shutil.rmtree(out.parent if out.name == "dump" else out.parent.parent, ignore_errors=True)

        def compare(ref, got):
            return diff_trees(tree_hashes(ref), tree_hashes(got))

        def n_files(k):
            return lambda out: len([f for f in out.rglob("*") if f.is_file()]) >= k if out.exists() else False

        phases = [("first file", n_files(1)), ("3 files", n_files(3)), ("8 files", n_files(8))]
        generic_matrix(f"export-saev ({variant})", cmd_for, out_for, reset, compare, env, rng, n, phases,
                       clean=lambda out: reset(out))


# ---- export-sae
def cell_export_sae(w: Path, env, rng, n):
    save = w / "sparsify-save"
    if not (save / "sae.safetensors").exists():
        write_sparsify_save(save, 16384, 1024)
    for fmt in ("npz", "safetensors"):
        def out_for(tag, fmt=fmt):
            return w / "sae-export" / fmt / tag

        def cmd_for(root, fmt=fmt):
            return LMPROBE + ["export-sae", str(save), "--layer", "3", "--root", str(root), "--dict", "d",
                              "--file-format", fmt]

        def reset(root):
            shutil.rmtree(root, ignore_errors=True)

        def compare(ref, got):
            d = diff_trees(tree_hashes(ref), tree_hashes(got))
            if not d:
                return ""
            # fall back to array equality (the meta may carry a time)
            code = ("import sys, numpy as np\nfrom lmprobe.sae import SAEConfig, load_dictionary\n"
                    "a = load_dictionary(SAEConfig(root_path=sys.argv[1], dictionary_name='d', device='cpu')).get_layer(3)\n"
                    "b = load_dictionary(SAEConfig(root_path=sys.argv[2], dictionary_name='d', device='cpu')).get_layer(3)\n"
                    "import lmprobe.sae.activation as act\n"
                    "from lmprobe.sae import dense_encoder\n"
                    "ok = np.array_equal(dense_encoder(a), dense_encoder(b)) and ((a.bias is None and b.bias is None) or np.array_equal(a.bias, b.bias))\n"
                    "print('same' if ok else 'differ')\n")
            p = run([PY, "-c", code, str(ref), str(got)], env)
            if p.returncode == 0 and p.stdout.strip().endswith("same"):
                return ""
            return d + (f" ; arrays: {p.stdout.strip() or one_line(p)}")

        def any_file(pattern):
            return lambda root: root.exists() and any(f.is_file() for f in root.rglob(pattern))

        phases = [("first file under --root", any_file("*")), ("weights file appeared", any_file(f"*.{fmt}*")),
                  ("meta appeared", any_file("*.json"))]
        generic_matrix(f"export-sae (sparsify 16384x1024, {fmt})", cmd_for, out_for, reset, compare, env, rng, n,
                       phases, clean=reset)


# ---- features
def cell_features(w: Path, env, rng, n):
    ds = w / "feat-ds"
    if not (ds / "index").exists():
        log("writing the features source dataset (>1M tokens so that checkpoints happen)")
        write_dataset(ds, dim=32, layers=[2], n_prompts=12000, tok_range=(100, 300), shard_size="256MiB")
    sae_root = w / "feat-sae"
    if not (sae_root / "d").exists():
        save = write_sparsify_save(w / "feat-save", 256, 32, seed=1, k=8)
        p = run(LMPROBE + ["export-sae", str(save), "--layer", "2", "--root", str(sae_root), "--dict", "d"], env)
        assert p.returncode == 0, p.stderr

    def out_for(tag):
        return w / "features" / tag

    def cmd_for(out):
        return LMPROBE + ["features", str(ds), "--sae", str(sae_root), "--dict", "d", "--layer", "2", "--out",
                          str(out), "--pages", "20", "--quiet", "--tokenizer", "lmprobe-tiny", "--memory", "32MiB"]

    def reset(out):
        shutil.rmtree(out, ignore_errors=True)

    def compare(ref, got):
        from safetensors.numpy import load_file

        a, b = load_file(ref / "features.safetensors"), load_file(got / "features.safetensors")
        errs = [k for k in a if k not in b or a[k].shape != b[k].shape or not np.array_equal(a[k], b[k])]
        ma, mb = json.loads((ref / "manifest.json").read_text()), json.loads((got / "manifest.json").read_text())
        ma.pop("dataset", None), mb.pop("dataset", None)
        if ma != mb:
            errs.append("manifest differs")
        pages = diff_trees(tree_hashes(ref, skip=[r"\.safetensors$", r"manifest\.json"]),
                           tree_hashes(got, skip=[r"\.safetensors$", r"manifest\.json"]))
        if pages:
            errs.append("pages: " + pages)
        return "; ".join(errs)

    def has(name):
        return lambda out: (out / name).exists()

    phases = [("first checkpoint", has(".features-partial.json")), ("cache file written", has("features.safetensors"))]
    ref = generic_matrix("features (checkpoints)", cmd_for, out_for, reset, compare, env, rng, n, phases)
    if ref is None:
        return
    # the partial-state file names, whatever they are called
    from lmprobe.pages import features as F

    partial, partial_state = F._PARTIAL, F._PARTIAL_STATE

    # make a partial state: kill right after the first checkpoint
    part_src = w / "features" / "partial-src"
    reset(part_src)
    kill_after(cmd_for(part_src), env, until=lambda: (part_src / partial_state).exists()
               and (part_src / partial).exists())
    time.sleep(0.2)

    def tampered(name, fn, base="ref"):
        out = w / "features" / f"t-{re.sub(r'[^a-z0-9]+', '-', name)}"
        reset(out)
        shutil.copytree(ref if base == "ref" else part_src, out)
        fn(out)
        p = run(cmd_for(out), env)
        if traceback_in(p):
            return False, f"FAILED: traceback: {one_line(p)}", p
        if p.returncode != 0:
            return True, f"refused: {one_line(p)}", p
        d = compare(ref, out)
        if d:
            return False, f"FAILED: exit 0 but differs from the uninterrupted run: {d}", p
        return True, "clean recompute/identical", p

    from safetensors.numpy import load_file, save_file

    def wrong_shapes(out):
        t = load_file(out / "features.safetensors")
        t = {k: v[: max(1, len(v) // 2)] for k, v in t.items()}
        save_file(t, str(out / "features.safetensors"), metadata={"format": "np"})

    def wrong_dtypes(out):
        t = load_file(out / "features.safetensors")
        t = {k: v.astype(np.float16) if v.dtype.kind == "f" else v.astype(np.int8) for k, v in t.items()}
        save_file(t, str(out / "features.safetensors"), metadata={"format": "np"})

    def truncate(path, keep=0.5):
        def fn(out):
            f = out / path
            data = f.read_bytes()
            f.write_bytes(data[: int(len(data) * keep)])
        return fn

    def write(path, text):
        return lambda out: (out / path).write_text(text)

    def missing_key(out):
        t = load_file(out / "features.safetensors")
        t.pop(sorted(t)[0])
        save_file(t, str(out / "features.safetensors"), metadata={"format": "np"})

    def manifest_edit(**kw):
        def fn(out):
            m = json.loads((out / "manifest.json").read_text())
            m.update(kw)
            (out / "manifest.json").write_text(json.dumps(m))
        return fn

    def state_edit(val):
        def fn(out):
            st = json.loads((out / partial_state).read_text())
            st["next_prompt"] = val
            (out / partial_state).write_text(json.dumps(st))
        return fn

    def partial_shapes(out):
        t = load_file(out / partial)
        t = {k: (v[:3] if v.ndim else v) for k, v in t.items()}
        save_file(t, str(out / partial))

    def partial_dtype(out):
        t = load_file(out / partial)
        t = {k: (v.astype(np.float16) if v.dtype.kind == "f" else v) for k, v in t.items()}
        save_file(t, str(out / partial))

    def partial_tokens_seen(out):
        t = load_file(out / partial)
        t["tokens_seen"] = np.array([-(2 ** 40)], dtype=t["tokens_seen"].dtype)
        save_file(t, str(out / partial))

    cases = [
        ("cache wrong shapes", wrong_shapes, "ref"),
        ("cache wrong dtypes", wrong_dtypes, "ref"),
        ("cache truncated", truncate("features.safetensors"), "ref"),
        ("cache empty", write("features.safetensors", ""), "ref"),
        ("cache missing a tensor", missing_key, "ref"),
        ("cache deleted, manifest kept", lambda out: (out / "features.safetensors").unlink(), "ref"),
        ("manifest truncated", truncate("manifest.json"), "ref"),
        ("manifest a JSON list", write("manifest.json", "[1, 2]"), "ref"),
        ("manifest tokens=-5", manifest_edit(tokens=-5), "ref"),
        ("manifest top=3 (mismatch)", manifest_edit(top=3), "ref"),
        ("partial: state truncated", truncate(partial_state), "part"),
        ("partial: state a JSON list", write(partial_state, "[]"), "part"),
        ("partial: next_prompt='x'", state_edit("x"), "part"),
        ("partial: next_prompt=-5", state_edit(-5), "part"),
        ("partial: next_prompt=10**9", state_edit(10 ** 9), "part"),
        ("partial: next_prompt=2**70", state_edit(2 ** 70), "part"),
        ("partial: next_prompt=null", state_edit(None), "part"),
        ("partial: next_prompt=1.5", state_edit(1.5), "part"),
        ("partial: cache truncated", truncate(partial), "part"),
        ("partial: cache wrong shapes", partial_shapes, "part"),
        ("partial: cache float16", partial_dtype, "part"),
        ("partial: tokens_seen=-2**40", partial_tokens_seen, "part"),
        ("partial: cache deleted, state kept", lambda out: (out / partial).unlink(), "part"),
    ]
    for name, fn, base in cases:
        ok, text, p = tampered(name, fn, base)
        record(f"features, tampered: {name}", ["(tamper, re-run)"], text,
               {"stderr": (p.stderr or "")[-3000:]} if not ok else None, failed=not ok)

    cell_features_rewritten(w, env, ds, sae_root, cmd_for, compare, reset, part_src)


def cell_features_rewritten(w, env, ds, sae_root, cmd_for, compare, reset, part_src):
    # the dataset rewritten in place (same path, same prompt count, other values) between a kill and the re-run
    ds2 = w / "feat-ds-other"
    if not (ds2 / "index").exists():
        write_dataset(ds2, dim=32, layers=[2], n_prompts=12000, tok_range=(100, 300), shard_size="256MiB", seed=5)
    orig = w / "feat-ds-orig"
    ref2 = w / "features" / "ref-other"
    out = w / "features" / "t-dataset-rewritten"
    reset(ref2), reset(out)
    shutil.copytree(part_src, out)
    try:
        ds.rename(orig)
        ds2.rename(ds)
        run(cmd_for(ref2), env)
        p = run(cmd_for(out), env)
    finally:
        ds.rename(ds2)
        orig.rename(ds)
    d = compare(ref2, out) if p.returncode == 0 else ""
    ok, text = classify_rerun(p, d, True)
    record("features: dataset rewritten in place between the kill and the re-run", ["after first checkpoint"], text,
           {"stderr": p.stderr[-3000:], "diff": d} if not ok else None, failed=text.startswith("FAILED"))


def _featrw(w, env):
    """cell_features_rewritten alone (after a features run left feat-ds, feat-sae and features/partial-src)"""
    ds, sae_root, part_src = w / "feat-ds", w / "feat-sae", w / "features" / "partial-src"

    def cmd_for(out):
        return LMPROBE + ["features", str(ds), "--sae", str(sae_root), "--dict", "d", "--layer", "2", "--out",
                          str(out), "--pages", "20", "--quiet", "--tokenizer", "lmprobe-tiny", "--memory", "32MiB"]

    def compare(ref, got):
        from safetensors.numpy import load_file

        a, b = load_file(ref / "features.safetensors"), load_file(got / "features.safetensors")
        errs = [k for k in a if k not in b or a[k].shape != b[k].shape or not np.array_equal(a[k], b[k])]
        pages = diff_trees(tree_hashes(ref, skip=[r"\.safetensors$", r"manifest\.json"]),
                           tree_hashes(got, skip=[r"\.safetensors$", r"manifest\.json"]))
        return "; ".join(errs + (["pages: " + pages] if pages else []))

    cell_features_rewritten(w, env, ds, sae_root, cmd_for, compare, lambda o: shutil.rmtree(o, ignore_errors=True),
                            part_src)


# ---- local Hub: push / pull
class HubServer:
    def __init__(self, w: Path, env):
        self.root = w / "hub-root"
        shutil.rmtree(self.root, ignore_errors=True)
        self.proc = subprocess.Popen([PY, "-m", "tests.support.hub_server", "--port", "0", "--root", str(self.root)],
                                     cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
        for line in self.proc.stdout:
            m = re.search(r"HF_ENDPOINT=(\S+)", line)
            if m:
                self.url = m.group(1)
                break

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def repo_files(env, repo, repo_type="dataset"):
    code = ("import sys, json, hashlib\nfrom huggingface_hub import HfApi, hf_hub_download\n"
            "api = HfApi()\nout = {}\n"
            "for f in sorted(api.list_repo_files(sys.argv[1], repo_type=sys.argv[2])):\n"
            "    p = hf_hub_download(sys.argv[1], f, repo_type=sys.argv[2])\n"
            "    out[f] = hashlib.sha256(open(p,'rb').read().replace(sys.argv[1].encode(), b'REPO')).hexdigest()\n"
            "print(json.dumps(out))\n")
    p = run([PY, "-c", code, repo, repo_type], env)
    if p.returncode != 0:
        return {"error": one_line(p)}
    return json.loads(p.stdout.strip().splitlines()[-1])


def cell_push_pull(w: Path, env0, rng, n):
    env = dict(env0, HF_HOME=str(w / "hf-home"), HF_HUB_DISABLE_XET="1", HF_TOKEN="x")
    hub = HubServer(w, env)
    env["HF_ENDPOINT"] = hub.url
    try:
        ds = w / "push-ds"
        if not (ds / "index").exists():
            # many shard files (several commits of <= 50 files) and some bulk
            write_dataset(ds, dim=64, layers=[0, 1, 2], n_prompts=6000, tok_range=(20, 60), shard_size="1MiB")
        # saev + sae parts beside it
        counter = iter(range(10 ** 6))

        def out_for(tag):
            return f"me/push-{tag}-{next(counter)}"

        def cmd_for(repo):
            return LMPROBE + ["push", str(ds), repo, "--quiet"]

        def compare(ref, got):
            a, b = repo_files(env, ref), repo_files(env, got)
            return diff_trees(a, b)

        generic_matrix("push (LFS objects already on the server)", cmd_for, out_for, lambda r: None, compare, env, rng,
                       n)
        cell_push_fresh(w, env, rng, n, ds, repo_files(env, "me/push-ref-0"))
        # repeated kills on the same repo, then one re-run
        repo = "me/push-repeated"
        pts = kill_points(rng, 6.0, 4)
        for d in pts:
            kill_after(cmd_for(repo), env, delay=d)
        p = run(cmd_for(repo), env)
        ok, text = classify_rerun(p, compare(out_for("ref2") if False else "me/push-ref-0", repo) if p.returncode == 0
                                  else "", True)
        record("push (4 kills in a row on one repo, then re-run)", [f"{d}s" for d in pts], text,
               None if ok else p.stderr[-2000:], failed=text.startswith("FAILED"))

        # an update: push dataset B over a repo holding dataset A (same shard names, other values), killed
        ds_b = w / "push-ds-b"
        if not (ds_b / "index").exists():
            write_dataset(ds_b, dim=64, layers=[0, 1, 2], n_prompts=6000, tok_range=(20, 60), shard_size="1MiB",
                          seed=9)
        ref_b = "me/push-b-ref"
        run(LMPROBE + ["push", str(ds_b), ref_b, "--quiet"], env)
        upd = []
        mixed = False
        for i, d in enumerate(kill_points(rng, 8.0, 4)):
            repo = f"me/push-update-{i}"
            run(cmd_for(repo), env)   # dataset A, complete
            kill_after(LMPROBE + ["push", str(ds_b), repo, "--quiet"], env, delay=d)
            # what a reader sees now: A, B, nothing, or a mix
            mid = w / "pull" / f"mid-{i}"
            shutil.rmtree(mid, ignore_errors=True)
            pm = run(LMPROBE + ["pull", repo, "--out", str(mid), "--quiet"], env)
            if pm.returncode == 0:
                da, db = compare_datasets(ds, mid, env), compare_datasets(ds_b, mid, env)
                seen = "A" if not da else "B" if not db else f"MIXED ({da[:80]} / {db[:80]})"
            else:
                seen = f"unreadable: {one_line(pm)[:100]}"
            mixed |= seen.startswith("MIXED")
            p = run(LMPROBE + ["push", str(ds_b), repo, "--quiet"], env)
            diff = compare(ref_b, repo) if p.returncode == 0 else ""
            ok, text = classify_rerun(p, diff, True)
            mixed |= text.startswith("FAILED")
            upd.append(f"{d}s: reader after the kill sees {seen}; re-run: {text}")
        record("push of dataset B over a repo holding A (update), killed, re-run", [u.split(":")[0] for u in upd],
               _summ(upd), {"per_kill": upd}, failed=mixed)

        # pull
        src = "me/push-ref-0"
        for layers in (None, "1"):
            def pcmd(out, layers=layers):
                # its own Hub cache (HF_HOME), so that the downloads themselves are interrupted
                return ["env", f"HF_HOME={out}.hf-home"] + LMPROBE + ["pull", src, "--out", str(out), "--quiet"] + \
                    (["--layers", layers] if layers else [])

            def pout(tag, layers=layers):
                return w / "pull" / (layers or "all") / tag

            def preset(out):
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(f"{out}.hf-home", ignore_errors=True)

            def pcompare(ref, got, layers=layers):
                d = diff_trees(tree_hashes(ref), tree_hashes(got))
                if d:
                    return "files: " + d
                return compare_datasets(ref, got, env) if layers is None else ""

            def files_at_least(k):
                return lambda out: out.exists() and sum(1 for f in out.rglob("*.safetensors")) >= k

            generic_matrix(f"pull{' --layers ' + layers if layers else ''}", pcmd, pout, preset, pcompare, env, rng, n,
                           [("first shard", files_at_least(1)), ("10 shards", files_at_least(10))], clean=preset)
        # the pushed dataset equals the local one
        out = w / "pull" / "roundtrip"
        shutil.rmtree(out, ignore_errors=True)
        run(LMPROBE + ["pull", src, "--out", str(out), "--quiet"], env)
        d = compare_datasets(ds, out, env)
        record("push+pull round trip (reference)", ["none"], "identical" if not d else f"FAILED: {d}", failed=bool(d))
        # hub corpus sources whose rows change type mid-stream
        if "hubcorpus" in ONLY:
            cell_hub_corpus(w, env, rng)
    finally:
        hub.stop()


def cell_push_fresh(w: Path, env, rng, n, ds, ref_files):
    """push against a fresh server (no LFS object there yet) per kill, so that kills land in uploads and commits;
    also an update push (B over A) killed mid-way, with what a reader sees right after the kill."""
    def lfs_count(hub):
        d = hub.root / "lfs"
        return sum(1 for _ in d.iterdir()) if d.exists() else 0

    outs, fails, tried = [], [], []
    n_files = sum(1 for _ in (ds / "tensors").rglob("*")) if (ds / "tensors").exists() else 180
    # measure the wall time of a push into an empty server
    hub = HubServer(w / "fresh-ref", env)
    e = dict(env, HF_ENDPOINT=hub.url)
    p = run(LMPROBE + ["push", str(ds), "me/fresh", "--quiet"], e)
    wall = p.wall
    hub.stop()
    points = [("t", d) for d in kill_points(rng, wall, n)] + [("phase", k) for k in (1, 20, n_files // 2, n_files - 2)]
    for i, (kind, val) in enumerate(points):
        hub = HubServer(w / f"fresh-{i}", env)
        e = dict(env, HF_ENDPOINT=hub.url)
        cmd = LMPROBE + ["push", str(ds), "me/fresh", "--quiet"]
        try:
            if kind == "t":
                killed, at = kill_after(cmd, e, delay=val)
                label = f"{val}s"
            else:
                killed, at = kill_after(cmd, e, until=lambda hub=hub, val=val: lfs_count(hub) >= val)
                label = f"{val} LFS objects@{at}s"
            if not killed:
                label += "(finished first)"
            mid = repo_files(e, "me/fresh")
            has_index = any(k.startswith("index/") for k in mid)
            missing = [k for k in ref_files if k.startswith("tensors/") and k not in mid]
            midtxt = ("index present with shards missing!" if has_index and missing else
                      "index present (complete)" if has_index else f"no index, {len(mid)} files")
            p = run(cmd, e)
            diff = diff_trees(ref_files, repo_files(e, "me/fresh")) if p.returncode == 0 else ""
            ok, text = classify_rerun(p, diff, killed)
            tried.append(label)
            outs.append(f"{label}: after kill: {midtxt}; re-run: {text}")
            if not ok or (has_index and missing):
                fails.append({"kill": label, "stderr": p.stderr[-2000:], "diff": diff, "mid": midtxt})
        finally:
            hub.stop()
    record("push (fresh server per kill: kills land in LFS uploads and commits)", tried, _summarize(
        [o.split("; re-run: ")[0].split(": ", 1)[0] + ": " + o.split("; re-run: ")[1] for o in outs]),
        {"per_kill": outs, "failures": fails}, failed=bool(fails))


def upload_files(env, repo, files: dict[str, bytes]):
    code = ("import sys, json, base64\nfrom huggingface_hub import HfApi, CommitOperationAdd\n"
            "api = HfApi()\nfiles = json.loads(sys.stdin.read())\n"
            "api.create_repo(sys.argv[1], repo_type='dataset', exist_ok=True)\n"
            "ops = [CommitOperationAdd(k, base64.b64decode(v)) for k, v in files.items()]\n"
            "api.create_commit(sys.argv[1], ops, commit_message='data', repo_type='dataset')\n")
    import base64

    payload = json.dumps({k: base64.b64encode(v).decode() for k, v in files.items()})
    p = subprocess.run([PY, "-c", code, repo], input=payload, env=env, cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def cell_hub_corpus(w: Path, env, rng):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    words = "the cat sat on a mat and the dog ran far away to the big red tree".split()

    def text(i):
        return " ".join(words[(i + j) % len(words)] for j in range(40))

    k = 30
    cases = {}

    def jsonl(rows):
        return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()

    for what, bad in [("int", 7), ("None", None), ("list", ["a", "b"]), ("dict", {"a": 1}), ("bool", True)]:
        rows = [{"text": text(i)} for i in range(k)] + [{"text": bad}] + [{"text": text(i)} for i in range(20)]
        cases[f"jsonl text becomes {what} at row {k}"] = {"data/train.jsonl": jsonl(rows)}
    rows = [{"input_ids": list(range(1, 30))} for _ in range(k)] + [{"input_ids": "now text"}] + \
           [{"input_ids": list(range(1, 30))} for _ in range(10)]
    cases[f"jsonl input_ids becomes text at row {k}"] = {"data/train.jsonl": jsonl(rows)}
    rows = [{"text": text(i)} for i in range(k)] + [{"input_ids": [1, 2, 3]}] + [{"text": text(i)} for i in range(10)]
    cases[f"jsonl text column replaced by input_ids at row {k}"] = {"data/train.jsonl": jsonl(rows)}

    def pq_bytes(table):
        b = io.BytesIO()
        pq.write_table(table, b)
        return b.getvalue()

    cases["parquet: file 1 text strings, file 2 text int64"] = {
        "data/train-00000.parquet": pq_bytes(pa.table({"text": [text(i) for i in range(k)]})),
        "data/train-00001.parquet": pq_bytes(pa.table({"text": pa.array(list(range(20)), pa.int64())})),
    }
    cases["parquet: file 2 text all null"] = {
        "data/train-00000.parquet": pq_bytes(pa.table({"text": [text(i) for i in range(k)]})),
        "data/train-00001.parquet": pq_bytes(pa.table({"text": pa.array([None] * 20, pa.string())})),
    }
    cases["parquet: file 1 input_ids lists, file 2 input_ids strings"] = {
        "data/train-00000.parquet": pq_bytes(pa.table({"input_ids": [list(range(1, 30))] * k})),
        "data/train-00001.parquet": pq_bytes(pa.table({"input_ids": ["x"] * 20})),
    }
    for i, (name, files) in enumerate(cases.items()):
        repo = f"me/corpus-{i}"
        upload_files(env, repo, files)
        out = w / "hub-corpus" / f"c{i}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = LMPROBE + ["extract", "--model", "lmprobe-tiny", "--prompts", f"hf://datasets/{repo}", "--max-tokens",
                         "4000", "--context-len", "32", "--out", str(out), "--quiet", "--storage", "full_sequence",
                         "--batch-size", "4"]
        p1 = run(cmd, env)
        p2 = run(cmd, env)
        lines1 = [ln for ln in p1.stderr.strip().splitlines() if ln.strip()]
        notes = []
        failed = False
        if traceback_in(p1) or traceback_in(p2):
            failed = True
            notes.append("traceback")
        if p1.returncode == 0:
            v = run(LMPROBE + ["validate", str(out)], env)
            info = run(LMPROBE + ["info", str(out)], env)
            tok = re.search(r"prompts\s+(\d+)", info.stdout)
            notes.append(f"exit 0 (accepted): validate rc={v.returncode}, {tok.group(0) if tok else info.stdout[:80]}")
        else:
            notes.append(f"error ({len(lines1)} line(s)): {one_line(p1)}")
            if not re.search(r"\b(row|record|line)\s*\d+", one_line(p1)):
                notes.append("the message names no row")
                failed = True
            if len(lines1) > 1:
                failed = True
                notes.append("more than one line")
        if p2.returncode != p1.returncode or one_line(p1) != one_line(p2):
            notes.append(f"re-run differs: rc {p2.returncode}: {one_line(p2)}")
        # partial output must not read as a dataset
        if p1.returncode != 0 and (out / "index").exists():
            notes.append("a complete-looking index was left")
            failed = True
        record(f"hub corpus: {name}", ["(run, re-run)"], "; ".join(notes),
               {"cmd": " ".join(cmd), "stderr": p1.stderr[-3000:]} if failed else None, failed=failed)


# ---- pretokenized hostile values
def cell_pretokenized(w: Path, env, rng):
    d = w / "pretok"
    d.mkdir(parents=True, exist_ok=True)
    hostile = {
        "negative id": [1, -1, 2], "id == vocab (512)": None, "id 10**9": [1, 10 ** 9],
        "2**63": [1, 2 ** 63], "2**64": [1, 2 ** 64], "-2**63": [-(2 ** 63)],
        "float 1.5": [1, 1.5], "float 2.0": [1, 2.0], "string '5'": [1, "5"], "string": "hello",
        "nested list": [[1, 2], [3]], "empty list": [], "None": None, "bool true": [True, 1],
        "dict": {"a": 1}, "NaN": "NaN_RAW", "Infinity": "INF_RAW", "10**6-long list": [1] * 10 ** 6,
    }
    for name, val in hostile.items():
        f = d / (re.sub(r"[^a-z0-9]+", "-", name.lower()) + ".jsonl")
        good = json.dumps({"input_ids": [1, 2, 3]})
        if name.startswith("id == vocab"):
            bad = json.dumps({"input_ids": [1, "VOCAB"]}).replace('"VOCAB"', str(VOCAB))
        elif val == "NaN_RAW":
            bad = '{"input_ids": [1, NaN]}'
        elif val == "INF_RAW":
            bad = '{"input_ids": [1, Infinity]}'
        else:
            bad = json.dumps({"input_ids": val})
        f.write_text(good + "\n" + bad + "\n" + good + "\n")
        out = d / ("out-" + f.stem)
        shutil.rmtree(out, ignore_errors=True)
        cmd = LMPROBE + ["extract", "--model", "lmprobe-tiny", "--prompts", str(f), "--out", str(out), "--storage",
                         "full_sequence", "--quiet"]
        p = run(cmd, env)
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        failed = traceback_in(p) or p.returncode not in (0, 2) or (p.returncode == 2 and len(lines) != 1)
        if p.returncode == 0:
            text = f"accepted (exit 0), wall {p.wall:.1f}s"
            if name in ("float 2.0", "bool true"):
                text += " (documented?)"
            else:
                failed = True
        else:
            text = f"{'refused' if not failed else 'FAILED'} in {p.wall:.1f}s: {one_line(p)}"
        if (out / "index").exists() and p.returncode != 0:
            failed = True
            text += "; an index was left"
        record(f"pretokenized input_ids: {name}", ["(run)"], text,
               {"cmd": " ".join(cmd), "stderr": p.stderr[-3000:]} if failed else None, failed=failed)


# ---- SAELens caches: export-saelens, import-saelens (issue 36)
def cell_saelens(w: Path, env, rng, n):
    ds = w / "saelens-ds"
    if not (ds / "index").exists():
        log("writing the export-saelens source dataset (every prompt 64 tokens)")
        write_dataset(ds, dim=256, layers=[3], n_prompts=4000, tok_range=(64, 65), shard_size="32MiB")

    def reset(out):
        shutil.rmtree(out, ignore_errors=True)
        partial = out.parent / f".{out.name}.partial"
        if partial.is_symlink() or partial.is_file():
            partial.unlink()
        shutil.rmtree(partial, ignore_errors=True)

    def partial_has(nbytes):
        def pred(out):
            p = out.parent / f".{out.name}.partial"
            return p.is_dir() and sum(f.stat().st_size for f in p.glob("*.arrow")) >= nbytes
        return pred

    ref_cache = generic_matrix(
        "export-saelens (262 MB cache, one data file)",
        lambda out: LMPROBE + ["export-saelens", str(ds), "--out", str(out), "--quiet"],
        lambda tag: w / "saelens-export" / tag, reset,
        lambda ref, got: diff_trees(tree_hashes(ref), tree_hashes(got)), env, rng, n,
        [("partial folder made", partial_has(0)), ("64 MB written", partial_has(64 << 20)),
         ("200 MB written", partial_has(200 << 20))], clean=reset)
    if ref_cache is None:
        return
    # a stale .NAME.partial that is not a folder (a file, a link to the user's folder, a dangling link): the same
    # command must replace it, never follow the link
    stale = []
    for kind in ("file", "symlink", "dangling symlink"):
        out = w / "saelens-export" / f"stale-{kind.replace(' ', '-')}"
        reset(out)
        partial = out.parent / f".{out.name}.partial"
        target = w / "saelens-export" / "users-folder"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        (target / "keep.txt").write_text("mine")
        if kind == "file":
            partial.write_text("junk")
        else:
            partial.symlink_to(target if kind == "symlink" else w / "nowhere")
        p = run(LMPROBE + ["export-saelens", str(ds), "--out", str(out), "--quiet"], env)
        diff = diff_trees(tree_hashes(ref_cache), tree_hashes(out)) if p.returncode == 0 else ""
        ok, text = classify_rerun(p, diff, True)
        if sorted(x.name for x in target.iterdir()) != ["keep.txt"]:
            ok, text = False, "FAILED: the link's target was changed"
        stale.append(ok)
        record(f"export-saelens over a stale .NAME.partial that is a {kind}", ["(stale partial, run)"], text,
               {"stderr": p.stderr[-3000:]} if not ok else None, failed=not ok)
        reset(out)

    def import_cmd(api: bool):
        def cmd(out):
            if not api:
                return LMPROBE + ["import-saelens", str(ref_cache), "--out", str(out), "--quiet"]
            code = ("import sys, lmprobe; lmprobe.import_saelens(sys.argv[1], sys.argv[2], quiet=True, "
                    "checkpoint_interval=0.2, shard_size='16MiB')")
            return [PY, "-c", code, str(ref_cache), str(out)]
        return cmd

    def staged(out):
        return (out / ".lmprobe-staging").is_dir()

    def published(k):
        return lambda out: (out / "tensors").is_dir() and sum(1 for _ in (out / "tensors").iterdir()) >= k

    for api in (False, True):
        generic_matrix(
            "import-saelens" + (" (API, checkpoints every 0.2 s, 16 MiB shards)" if api else " (CLI)"),
            import_cmd(api), lambda tag, api=api: w / "saelens-import" / ("api" if api else "cli") / tag,
            lambda out: shutil.rmtree(out, ignore_errors=True), lambda ref, got: compare_datasets(ref, got, env), env,
            rng, n, [("staging made", staged), ("first shard published", published(1)),
                     ("4 shards published", published(4))],
            clean=lambda out: shutil.rmtree(out, ignore_errors=True))


# ---- pull into an existing copy after the repo was pushed again (issue 36)
def cell_pull_copy(w: Path, env0, rng, n):
    env = dict(env0, HF_HOME=str(w / "hf-home"), HF_HUB_DISABLE_XET="1", HF_TOKEN="x")
    hub = HubServer(w / "pullcopy", env)
    env["HF_ENDPOINT"] = hub.url
    try:
        a, b = w / "pullcopy-a", w / "pullcopy-b"
        for path, seed in ((a, 3), (b, 4)):  # the same shapes and file names, other values
            if not (path / "index").exists():
                write_dataset(path, dim=64, layers=[0, 1], n_prompts=4000, tok_range=(20, 60), shard_size="1MiB",
                              seed=seed)
        repo = "me/pullcopy"
        assert run(LMPROBE + ["push", str(a), repo, "--quiet"], env).returncode == 0
        template = w / "pullcopy-template"  # a copy of version A holding layer 0
        shutil.rmtree(template, ignore_errors=True)
        p = run(["env", f"HF_HOME={template}.hf-home"] + LMPROBE + ["pull", repo, "--layers", "0", "--out",
                                                                     str(template), "--quiet"], env)
        assert p.returncode == 0, p.stderr
        assert run(LMPROBE + ["push", str(b), repo, "--quiet"], env).returncode == 0

        def cmd(out):  # its own Hub cache, so that the downloads themselves are interrupted
            return ["env", f"HF_HOME={out}.hf-home"] + LMPROBE + ["pull", repo, "--layers", "1", "--out", str(out),
                                                                  "--quiet"]

        def out_for(tag):
            return w / "pullcopy-runs" / tag

        def reset(out):
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(f"{out}.hf-home", ignore_errors=True)
            shutil.copytree(template, out)

        def compare(ref, got):
            d = compare_datasets(b, got, env)  # version B whole: both layers, B's values
            files = diff_trees(tree_hashes(ref), tree_hashes(got))
            return "; ".join(x for x in (d, f"files: {files}" if files else "") if x)

        def index_gone(out):
            return not (out / "index" / "train-00000-of-00001.parquet").exists()

        def layer1_shards(k):
            return lambda out: sum(1 for _ in (out / "tensors").glob("hidden_layer001_*")) >= k

        generic_matrix("pull --layers 1 into a copy of layer 0, after the repo was pushed again", cmd, out_for, reset,
                       compare, env, rng, n, [("old index removed", index_gone), ("first layer-1 shard", layer1_shards(1)),
                                              ("20 layer-1 shards", layer1_shards(20))],
                       clean=lambda out: (shutil.rmtree(out, ignore_errors=True),
                                          shutil.rmtree(f"{out}.hf-home", ignore_errors=True)))
        # pulling into a folder that is not a copy of the repo: refused, nothing in it changed
        for what, make in (("the user's own README", lambda d: (d.mkdir(parents=True), (d / "README.md")
                                                                 .write_text("mine\n"))),
                           ("a local extraction", lambda d: shutil.copytree(a, d))):
            d = w / "pullcopy-runs" / f"not-a-copy-{what.split()[-1].lower()}"
            shutil.rmtree(d, ignore_errors=True)
            make(d)
            before = tree_hashes(d)
            p = run(LMPROBE + ["pull", repo, "--out", str(d), "--quiet"], env)
            ok = p.returncode == 2 and not traceback_in(p) and tree_hashes(d) == before
            record(f"pull into a folder holding {what}", ["(run)"],
                   (f"refused, nothing changed: {one_line(p)}" if ok else f"FAILED: rc {p.returncode}: {one_line(p)}"),
                   None if ok else {"stderr": p.stderr[-3000:]}, failed=not ok)
    finally:
        hub.stop()


VOCAB = None
ONLY: set = set()


# ---- S3 (moto)
class MotoServer:
    def __init__(self, w: Path, env):
        self.port = free_port()
        code = ("import sys, time\nfrom moto.server import ThreadedMotoServer\n"
                f"s = ThreadedMotoServer(ip_address='127.0.0.1', port={self.port}, verbose=False)\ns.start()\n"
                "print('up', flush=True)\nwhile True: time.sleep(3600)\n")
        self.proc = subprocess.Popen([PY, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        self.proc.stdout.readline()
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def cell_s3(w: Path, env0, rng, n):
    moto = MotoServer(w, env0)
    env = dict(env0, AWS_ENDPOINT_URL=moto.url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1", LMPROBE_CACHE=str(w / "lmcache-A"))
    try:
        import boto3

        s3 = boto3.client("s3", endpoint_url=moto.url, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
        s3.create_bucket(Bucket="acts")
        prompts = w / "s3-prompts.jsonl"
        base = [json.loads(x) for x in (REPO / "examples/prompts.jsonl").read_text().splitlines() if x.strip()]
        prompts.write_text("".join(json.dumps({**r, "text": f"{r['text']} ({i})"}) + "\n"
                                   for i, r in enumerate(base * 6)))

        def ext(url, *extra):
            return LMPROBE + ["extract", "--model", "lmprobe-tiny", "--prompts", str(prompts), "--out", url,
                              "--storage", "full_sequence", "--shard-size", "64KiB", "--quiet"] + list(extra)

        def list_keys(prefix):
            r = s3.list_objects_v2(Bucket="acts", Prefix=prefix + "/")
            return [o["Key"] for o in r.get("Contents", [])]

        def wipe(prefix):
            for k in list_keys(prefix):
                s3.delete_object(Bucket="acts", Key=k)

        def download(prefix, dst: Path):
            shutil.rmtree(dst, ignore_errors=True)
            for k in list_keys(prefix):
                t = dst / k[len(prefix) + 1:]
                t.parent.mkdir(parents=True, exist_ok=True)
                s3.download_file("acts", k, str(t))
            return dst

        def s3_compare(ref, got):
            a, b = download(ref, w / "s3dl" / "a"), download(got, w / "s3dl" / "b")
            return compare_datasets(a, b, env)

        counter = iter(range(10 ** 6))

        def out_for(tag):
            return f"p{tag}-{next(counter)}"

        uploaded = lambda k: (lambda prefix: len(list_keys(prefix)) >= k)  # noqa: E731
        generic_matrix("S3 extract (kill mid-upload)", lambda pre: ext(f"s3://acts/{pre}"), out_for, wipe, s3_compare,
                       env, rng, n, [("1 object uploaded", uploaded(1)), ("5 objects uploaded", uploaded(5))])
        ref = "pref-0"
        # S3 reference with --layers 0 for overwrite
        run(ext("s3://acts/ovref", "--layers", "0,1"), env)

        # --overwrite interrupted, then the same --overwrite command again
        pts = kill_points(rng, 20, max(3, n // 2))
        outs = []
        for i, d in enumerate(pts + ["old index removed"]):
            pre = f"ow{i}"
            run(ext(f"s3://acts/{pre}"), env)  # an existing dataset with other settings
            cmd = ext(f"s3://acts/{pre}", "--layers", "0,1", "--overwrite")
            if isinstance(d, str):
                kill_after(cmd, env, until=lambda pre=pre: not any(k.endswith(".parquet") for k in list_keys(pre)))
            else:
                kill_after(cmd, env, delay=d)
            # what a reader sees right after the kill: the old dataset whole, nothing, or a mix
            if any(k.endswith(".parquet") for k in list_keys(pre)):
                d_old, d_new = s3_compare(ref, pre), s3_compare("ovref", pre)
                seen = "old dataset, intact" if not d_old else "new dataset" if not d_new else f"MIXED: {d_old[:100]}"
            else:
                seen = "no index (not a dataset)"
            p = run(cmd, env)
            diff = s3_compare("ovref", pre) if p.returncode == 0 else ""
            ok, text = classify_rerun(p, diff, True)
            outs.append(f"{d}: reader right after the kill sees {seen}; re-run: {text}")
        fails = [o for o in outs if "FAILED" in o or "MIXED" in o]
        record("S3 --overwrite interrupted, re-run", [str(x) for x in pts + ["old index removed"]], _summ(outs),
               {"per_kill": outs}, failed=bool(fails))

        # stale local upload cache from another run
        stale_notes = []
        # (a) run with settings A killed; run with settings B (no overwrite) into the same URL
        wipe("stale1")
        kill_after(ext("s3://acts/stale1"), env, until=lambda: len(list_keys("stale1")) >= 3)
        p = run(ext("s3://acts/stale1", "--layers", "0,1"), env)
        stale_notes.append(("A killed, B same URL", p, s3_compare("ovref", "stale1") if p.returncode == 0 else ""))
        # (b) the bucket prefix wiped after a kill (someone else deleted it); the same command again
        wipe("stale2")
        kill_after(ext("s3://acts/stale2"), env, until=lambda: len(list_keys("stale2")) >= 3)
        wipe("stale2")
        p = run(ext("s3://acts/stale2"), env)
        stale_notes.append(("killed, bucket prefix wiped, re-run", p, s3_compare(ref, "stale2") if p.returncode == 0
                            else ""))
        # (c) the bucket completed by another machine (other cache) with other settings; our stale partial cache
        wipe("stale3")
        kill_after(ext("s3://acts/stale3"), env, until=lambda: len(list_keys("stale3")) >= 3)
        envB = dict(env, LMPROBE_CACHE=str(w / "lmcache-B"))
        run(ext("s3://acts/stale3", "--layers", "0,1", "--overwrite"), envB)
        p = run(ext("s3://acts/stale3", "--overwrite"), env)
        stale_notes.append(("partial cache, bucket rewritten elsewhere with other settings, re-run --overwrite", p,
                            s3_compare(ref, "stale3") if p.returncode == 0 else ""))
        # (d) a cache folder from another run with the same settings but a wiped bucket, then finished elsewhere
        wipe("stale4")
        kill_after(ext("s3://acts/stale4"), env, until=lambda: len(list_keys("stale4")) >= 3)
        run(ext("s3://acts/stale4"), envB)   # another machine finishes it
        p = run(ext("s3://acts/stale4"), env)
        stale_notes.append(("partial cache, same run finished elsewhere, re-run", p,
                            s3_compare(ref, "stale4") if p.returncode == 0 else ""))
        # (e) a stale cache folder with garbage in it
        wipe("stale5")
        cd = out_cache(env, "s3://acts/stale5")
        shutil.rmtree(cd, ignore_errors=True)
        (cd / "tensors").mkdir(parents=True)
        (cd / "tensors" / "hidden_L000_S00000.safetensors").write_bytes(b"garbage" * 100)
        (cd / ".lmprobe-staging").mkdir()
        (cd / ".lmprobe-staging" / "state.json").write_text("{not json")
        p = run(ext("s3://acts/stale5"), env)
        stale_notes.append(("garbage cache folder (bad shard + bad state)", p,
                            s3_compare(ref, "stale5") if p.returncode == 0 else ""))
        for what, p, diff in stale_notes:
            ok, text = classify_rerun(p, diff, True)
            record(f"S3 stale local upload cache: {what}", ["(kill at >=3 objects)"], text,
                   {"stderr": p.stderr[-3000:]} if not ok else None, failed=text.startswith("FAILED"))

        # concurrent writers to one prefix
        for label, envs, extras in [
            ("same settings, same machine (shared cache)", (env, env), ([], [])),
            ("same settings, two machines (own caches)", (env, envB), ([], [])),
            ("other settings, two machines", (env, envB), ([], ["--layers", "0,1"])),
            ("other settings, same machine", (env, env), ([], ["--layers", "0,1"])),
        ]:
            pre = "conc-" + re.sub(r"[^a-z]+", "-", label)
            wipe(pre)
            for e in envs:
                shutil.rmtree(out_cache(e, f"s3://acts/{pre}"), ignore_errors=True)
            procs = [subprocess.Popen(ext(f"s3://acts/{pre}", *x), env=e, cwd=REPO, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True) for e, x in zip(envs, extras, strict=True)]
            time.sleep(0.0)
            res = [(q.wait(), q.stderr.read()) for q in procs]
            dl = download(pre, w / "s3dl" / "c")
            v = run(LMPROBE + ["validate", str(dl)], env)
            same_ref = compare_datasets(download(ref, w / "s3dl" / "r"), dl, env) if v.returncode == 0 else "n/a"
            same_ov = compare_datasets(download("ovref", w / "s3dl" / "r2"), dl, env) if v.returncode == 0 else "n/a"
            tb = any("Traceback" in s for _, s in res)
            consistent = v.returncode == 0 and (same_ref == "" or same_ov == "")
            text = (f"exit codes {[r for r, _ in res]}; final prefix validate rc={v.returncode}"
                    f"{'; equals one writer' if consistent else '; MIXED/INVALID'}; messages: "
                    + " | ".join(s.strip().splitlines()[-1][:160] for _, s in res if s.strip()))
            failed = tb or not consistent
            record(f"S3 two concurrent writers: {label}", ["(both started at once)"],
                   ("FAILED: " if failed else "") + text,
                   {"stderr": [s[-2500:] for _, s in res], "validate": v.stdout[-1500:] + v.stderr[-1500:],
                    "vs_ref": same_ref, "vs_other": same_ov} if failed else None, failed=failed)
    finally:
        moto.stop()


def out_cache(env, url):
    """the local upload staging folder of ``url`` (lmprobe/storage/objectstore.py cache_dir) under env's cache"""
    return Path(env["LMPROBE_CACHE"]) / "outputs" / hashlib.sha1(url.encode()).hexdigest()[:16]


def _new_objects(keys):
    return sum(1 for k in keys if "index" not in k and "README" not in k)


def _summ(outs):
    return f"{len(outs)} kills; " + "; ".join(o[:200] for o in outs)


# --------------------------------------------------------------------------------------------- main
def main():
    global VOCAB, ONLY
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/lmprobe-kill-matrix")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--seed", type=int, default=27)
    ap.add_argument("--only", default="saev,sae,features,hub,hubcorpus,pretok,s3,saelens,pullcopy")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    w = Path(args.work)
    w.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HOME=str(w / "hf-home"), LMPROBE_CACHE=str(w / "lmcache-A"), PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="0", TQDM_DISABLE="1")
    env.pop("HF_ENDPOINT", None)
    rng = random.Random(args.seed)
    only = ONLY = set(args.only.split(","))
    VOCAB = json.loads((REPO / "lmprobe/models/tiny/config.json").read_text())["vocab_size"]
    cells = [("saev", lambda: cell_export_saev(w, env, rng, args.kills)),
             ("sae", lambda: cell_export_sae(w, env, rng, args.kills)),
             ("features", lambda: cell_features(w, env, rng, args.kills)),
             ("featrw", lambda: _featrw(w, env)),
             ("hub", lambda: cell_push_pull(w, env, rng, args.kills)),
             ("pretok", lambda: cell_pretokenized(w, env, rng)),
             ("saelens", lambda: cell_saelens(w, env, rng, args.kills)),
             ("pullcopy", lambda: cell_pull_copy(w, env, rng, args.kills)),
             ("s3", lambda: cell_s3(w, env, rng, args.kills))]
    for name, fn in cells:
        if name in only:
            t = time.time()
            try:
                fn()
            except Exception as exc:  # the harness itself: record and go on
                import traceback

                record(f"[harness] {name}", [], f"harness error: {exc!r}", traceback.format_exc(), failed=True)
            log(f"cell {name}: {time.time() - t:.0f}s")
            if args.out:
                Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    print("| operation | kill points tried | outcome |\n|---|---|---|")
    for r in RESULTS:
        print(f"| {r['operation']} | {', '.join(map(str, r['kill_points']))} | {r['outcome']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
