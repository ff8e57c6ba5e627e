"""SAE dictionaries: export, validation, loading (with and without numpy), projection, CLI, Hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from lmprobe.cli import main as cli_main
from lmprobe.errors import DictionaryError
from lmprobe.sae import SAEConfig, load_dictionary, project_topk, project_topk_batch, validate_dictionary
from lmprobe.sae.export import export_sae


def make_encoder(rng, d_in=24, d_sae=40):
    W = rng.normal(size=(d_in, d_sae)).astype(np.float32)  # SAELens orientation
    b = rng.normal(size=d_sae).astype(np.float32) * 0.1
    return W, b


def reference_topk(W_feat, b, x, k):
    scores = W_feat.astype(np.float32) @ x.astype(np.float32) + (b if b is not None else 0)
    order = np.lexsort((np.arange(len(scores)), -scores))[:k]
    return order.tolist(), scores[order]


def test_export_from_arrays_and_project(tmp_path, rng):
    W, b = make_encoder(rng)
    rep = export_sae(layer=3, root=tmp_path, dictionary="d", W_enc=W, b_enc=b, topk_per_feature=8)
    assert rep.features == 40 and rep.hidden_dim == 24 and rep.nnz == 40 * 8
    absw = np.abs(W.T)
    want_mass = np.sort(absw, axis=1)[:, -8:].sum() / absw.sum()
    assert rep.mass_kept == pytest.approx(want_mass, rel=1e-6)
    dct = load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d"))
    assert dct.device == "cpu" and dct.layers == [3]
    layer = dct.get_layer(3)
    assert layer.data.dtype == np.float16 and layer.indices.dtype == np.int32 and layer.indptr.dtype == np.int32
    # reference: the same sparsified matrix, dense, in float16 as stored
    Wf = np.zeros((40, 24), np.float32)
    for i in range(40):
        top = np.argsort(-absw[i])[:8]
        Wf[i, top] = W.T[i, top].astype(np.float16)
    x = rng.normal(size=24).astype(np.float32)
    got = project_topk(layer, x, k=5)
    idx, scores = reference_topk(Wf, b.astype(np.float16).astype(np.float32), x, 5)
    assert [i for i, _ in got] == idx
    np.testing.assert_allclose([s for _, s in got], scores, rtol=1e-5, atol=1e-5)
    assert [s for _, s in got] == sorted([s for _, s in got], reverse=True)
    batch = project_topk_batch(layer, np.stack([x, -x]), k=5)
    assert [i for i, _ in batch[0]] == idx
    assert [i for i, _ in batch[1]] == [i for i, _ in project_topk(layer, -x, k=5)]
    with pytest.raises(ValueError, match="length 23.*hidden_dim 24"):
        project_topk(layer, x[:23])


def test_saelens_folder_threshold_and_several_layers(tmp_path, rng):
    from safetensors.numpy import save_file

    for L in (2, 7):
        W, b = make_encoder(rng, d_in=16, d_sae=32 + L)
        src = tmp_path / f"saelens-{L}"
        src.mkdir()
        b_dec = rng.normal(size=16).astype(np.float32)
        save_file({"W_enc": W, "b_enc": b, "W_dec": W.T.copy(), "b_dec": b_dec}, str(src / "sae_weights.safetensors"))
        (src / "cfg.json").write_text(json.dumps({"d_in": 16, "d_sae": 32 + L, "hook_layer": L}))
        rep = export_sae(src, layer=L, root=tmp_path / "root", dictionary="s", threshold=0.5,
                         model_revision="abc123")
        assert rep.nnz == int((np.abs(W) >= 0.5).sum())
    meta = json.loads((tmp_path / "root/s/meta.json").read_text())
    assert meta["layer_ranges"] == {"2": [0, 34], "7": [34, 73]} and meta["feature_count"] == 73
    assert meta["model_hash"] == "abc123" and meta["version"] == "1.0.0" and meta["format"] == "csr.npz"
    # replacing a layer keeps the metadata consistent
    W, b = make_encoder(rng, d_in=16, d_sae=10)
    export_sae(layer=2, root=tmp_path / "root", dictionary="s", W_enc=W, b_enc=b)
    meta = json.loads((tmp_path / "root/s/meta.json").read_text())
    assert meta["layer_ranges"] == {"2": [0, 10], "7": [10, 49]} and meta["feature_count"] == 49
    assert validate_dictionary(tmp_path / "root", "s") == []
    assert not [p for p in (tmp_path / "root/s").iterdir() if p.name.startswith(".")]


def test_lru_cache_of_hot_layers(tmp_path, rng):
    for L in range(4):
        W, b = make_encoder(rng, d_in=8, d_sae=9 + L)
        export_sae(layer=L, root=tmp_path, dictionary="d", W_enc=W, b_enc=b)
    dct = load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d", cache_layers=2))
    dct.get_layer(0)
    dct.get_layer(1)
    dct.get_layer(0)
    dct.get_layer(2)
    assert dct.cached_layers() == [0, 2]
    with pytest.raises(ValueError, match="layer 9 is not in dictionary"):
        dct.get_layer(9)


def test_safetensors_variant(tmp_path, rng):
    W, b = make_encoder(rng)
    export_sae(layer=0, root=tmp_path, dictionary="st", W_enc=W, b_enc=b, file_format="safetensors", threshold=0.3)
    export_sae(layer=0, root=tmp_path, dictionary="np", W_enc=W, b_enc=b, threshold=0.3)
    x = rng.normal(size=24)
    a = project_topk(load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="st")).get_layer(0), x, k=7)
    c = project_topk(load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="np")).get_layer(0), x, k=7)
    assert a == c


HIDDEN_NUMPY = r"""
import json, sys
sys.modules["numpy"] = None            # numpy cannot be imported in this process
from lmprobe.sae import SAEConfig, load_dictionary, project_topk
root, name, layer, vec, k = json.loads(sys.argv[1])
layer_w = load_dictionary(SAEConfig(root_path=root, dictionary_name=name, device="cpu")).get_layer(layer)
assert isinstance(layer_w.data, list)
print(json.dumps(project_topk(layer_w, vec, k=k)))
"""


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_pure_python_fallback_gives_the_same_answer(tmp_path, rng, fmt):
    W, b = make_encoder(rng, d_in=32, d_sae=64)
    export_sae(layer=1, root=tmp_path, dictionary="d", W_enc=W, b_enc=b, topk_per_feature=10, file_format=fmt)
    x = rng.normal(size=32).tolist()
    r = subprocess.run([sys.executable, "-c", HIDDEN_NUMPY, json.dumps([str(tmp_path), "d", 1, x, 12])],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pure = json.loads(r.stdout)
    fast = project_topk(load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d")).get_layer(1), x, k=12)
    assert [i for i, _ in pure] == [i for i, _ in fast]
    np.testing.assert_allclose([s for _, s in pure], [s for _, s in fast], rtol=1e-5, atol=1e-6)


def test_validation_errors_name_the_file(tmp_path, rng):
    W, b = make_encoder(rng)
    export_sae(layer=0, root=tmp_path, dictionary="d", W_enc=W, b_enc=b)
    meta_path = tmp_path / "d/meta.json"
    good = json.loads(meta_path.read_text())
    for broken, msg in [({**good, "version": "one"}, "not semver"), ({k: v for k, v in good.items() if k != "dtype"},
                        "missing required field 'dtype'"), ({**good, "feature_count": "40"}, "must be a int")]:
        meta_path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=f"meta.json.*{msg}"):
            load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d"))
    meta_path.write_text(json.dumps(good))
    np.save(tmp_path / "d/layer_0/bias.npy", np.zeros(3, np.float16))
    with pytest.raises(ValueError, match=r"encoder.npz: bias has 3 entries, expected one per feature \(40\)"):
        load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d")).get_layer(0)
    with np.load(tmp_path / "d/layer_0/encoder.npz") as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(tmp_path / "d/layer_0/encoder.npz", **{**arrays, "indptr": arrays["indptr"][:-2]})
    with pytest.raises(ValueError, match=r"encoder.npz: indptr has 39 entries"):
        load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d")).get_layer(0)
    np.savez(tmp_path / "d/layer_0/encoder.npz", data=arrays["data"])
    with pytest.raises(ValueError, match=r"encoder.npz: encoder is missing key\(s\) \['indices', 'indptr', 'shape'\]"):
        load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d")).get_layer(0)
    (tmp_path / "d/layer_0/encoder.npz").unlink()
    assert "encoder.npz is missing" in " ".join(validate_dictionary(tmp_path, "d"))
    with pytest.raises(ValueError, match="plain folder name"):
        SAEConfig(root_path=tmp_path, dictionary_name="../etc")


def test_export_errors(tmp_path, rng):
    W, b = make_encoder(rng)
    with pytest.raises(ValueError, match="either threshold or topk_per_feature"):
        export_sae(layer=0, root=tmp_path, dictionary="d", W_enc=W, b_enc=b, threshold=0.1, topk_per_feature=3)
    with pytest.raises(ValueError, match="cannot tell which axis"):
        export_sae(layer=0, root=tmp_path, dictionary="d", W_enc=W)
    with pytest.raises(ValueError, match="float16"):
        export_sae(layer=0, root=tmp_path, dictionary="d", W_enc=W * 1e6, b_enc=b)


def test_cli_export_and_topk(tmp_path, rng, capsys, llama_dir):
    from safetensors.numpy import save_file

    import lmprobe

    ds = lmprobe.extract(str(llama_dir), ["The cat sat.", "A dog ran far away."], out=tmp_path / "ds", layers="2",
                         quiet=True)
    W = rng.normal(size=(32, 64)).astype(np.float32)
    save_file({"enc.weight": W.T.copy(), "enc.bias": np.zeros(64, np.float32)}, str(tmp_path / "sae.safetensors"))
    assert cli_main(["export-sae", str(tmp_path / "sae.safetensors"), "--layer", "2", "--root", str(tmp_path / "r"),
                     "--dict", "tiny", "--weight-key", "enc.weight", "--bias-key", "enc.bias",
                     "--topk-per-feature", "16"]) == 0
    assert "activation relu; 1024 encoder weights kept (50.0% of the weight matrix" in capsys.readouterr().out
    assert cli_main(["sae-topk", "--root", str(tmp_path / "r"), "--dict", "tiny", "--layer", "2", "--topk", "3",
                     "--dataset", str(tmp_path / "ds"), "--prompt", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("feat_") == 3 and "prompt 1" in out
    x = ds.hidden(2)[1]
    want = project_topk(load_dictionary(SAEConfig(root_path=tmp_path / "r", dictionary_name="tiny")).get_layer(2), x, 3)
    assert [f"feat_{i}" for i, _ in want] == [line.split()[0] for line in out.splitlines() if "feat_" in line]
    r = subprocess.run([sys.executable, "-m", "lmprobe.sae", "--root", str(tmp_path / "r"), "--dict", "tiny",
                        "--layer", "2", "--topk", "4"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count("feat_") == 4
    assert cli_main(["sae-topk", "--root", str(tmp_path / "r"), "--dict", "tiny", "--layer", "5"]) == 2
    assert "layer 5 is not in dictionary" in capsys.readouterr().err
    # -1 is the last layer here too: the dictionary's, and the dataset's
    assert cli_main(["sae-topk", "--root", str(tmp_path / "r"), "--dict", "tiny", "--layer", "-1", "--topk", "3",
                     "--dataset", str(tmp_path / "ds"), "--prompt", "1"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines() if "feat_" in line] == \
        [f"feat_{i}" for i, _ in want]


def test_dictionary_push_and_load_from_the_hub(hub, tmp_path, rng, fresh_hf_cache):
    from lmprobe.publish.dictionary import push_dictionary

    for L in (0, 4):
        W, b = make_encoder(rng)
        export_sae(layer=L, root=tmp_path, dictionary="hubdict", W_enc=W, b_enc=b, threshold=0.2)
    repo = f"tester/sae-{uuid.uuid4().hex[:8]}"
    push_dictionary(tmp_path, "hubdict", repo, quiet=True)
    assert "hubdict/meta.json" in hub.files(repo, repo_type="model")
    start = len(hub.log)
    dct = load_dictionary(SAEConfig(root_path=f"hf://{repo}", dictionary_name="hubdict"))
    x = rng.normal(size=24)
    local = load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="hubdict"))
    assert project_topk(dct.get_layer(4), x, 6) == project_topk(local.get_layer(4), x, 6)
    fetched = [p for m, p in hub.log[start:] if m == "GET" and "/resolve/" in p]
    assert not any("layer_0" in p for p in fetched)  # only what the call touched


def test_dtype_setting_decides_how_weights_are_held(tmp_path, rng):
    W, b = make_encoder(rng)
    export_sae(layer=0, root=tmp_path, dictionary="d", W_enc=W, b_enc=b, threshold=0.1)
    half = load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d")).get_layer(0)
    full = load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d", dtype="fp32")).get_layer(0)
    assert half.data.dtype == np.float16 and half.bias.dtype == np.float16
    assert full.data.dtype == np.float32 and full.bias.dtype == np.float32
    x = rng.normal(size=24)
    assert project_topk(half, x, 5) == project_topk(full, x, 5)
    with pytest.raises(ValueError, match="dtype must be"):
        SAEConfig(root_path=tmp_path, dictionary_name="d", dtype="int8")


def test_device_setting_is_checked_and_used(tmp_path, rng):
    import torch

    W, b = make_encoder(rng)
    export_sae(layer=0, root=tmp_path, dictionary="d", W_enc=W, b_enc=b, threshold=0.1)
    dct = load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d", device="auto"))
    assert dct.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert dct.get_layer(0).device == dct.device
    with pytest.raises(ValueError, match="device must be"):
        SAEConfig(root_path=tmp_path, dictionary_name="d", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            SAEConfig(root_path=tmp_path, dictionary_name="d", device="cuda")


# ---------------------------------------------------------------------------------------------- hostile dictionaries


def run_cli(capsys, argv):
    """(exit code, stderr) of one command; a refusal must be one line."""
    rc = cli_main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc != 2 or (len(err.splitlines()) == 1 and "Traceback" not in err), err
    return rc, err


def tamper_npz(path, **changes):
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(path, **{**arrays, **changes})


def huge_npy() -> bytes:
    """A .npy whose header declares 2^34 float16 values and whose data is 16 bytes."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f2", "fortran_order": False, "shape": (2**34,)})
    return buf.getvalue() + bytes(16)


def huge_npz(path) -> None:
    import zipfile

    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(path, **{k: v for k, v in arrays.items() if k != "data"})
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as z:
        z.writestr("data.npy", huge_npy())


def test_a_dictionary_with_nan_or_inf_is_refused_before_features_run(tmp_path, rng, capsys):
    """A dictionary with NaN or inf thresholds or weights is refused before `features` runs (never "0 fired" and
    exit 0)."""
    import shutil

    from safetensors.numpy import save_file
    from support.datasets import write_dataset

    write_dataset(tmp_path / "ds", rng, n=6, layers=(1,), dim=24, storage="full_sequence")
    src = tmp_path / "saelens"
    src.mkdir()
    W, b = make_encoder(rng)
    save_file({"W_enc": W, "b_enc": b, "W_dec": W.T.copy(), "b_dec": np.zeros(24, np.float32),
               "threshold": np.full(40, 0.1, np.float32)}, str(src / "sae_weights.safetensors"))
    (src / "cfg.json").write_text(json.dumps({"d_in": 24, "d_sae": 40, "architecture": "jumprelu"}))
    export_sae(src, layer=1, root=tmp_path / "good", dictionary="d")
    layer_dir = "d/layer_1"
    assert (tmp_path / "good" / layer_dir / "threshold.npy").exists()

    def features(root):
        return run_cli(capsys, ["features", tmp_path / "ds", "--sae", root, "--dict", "d", "--layer", 1, "--out",
                                tmp_path / f"out-{root.name}", "--quiet", "--tokenizer", "lmprobe-tiny"])

    assert features(tmp_path / "good")[0] == 0
    nan16 = np.float16("nan")
    cases = {
        "threshold": lambda d: np.save(d / "threshold.npy", np.full(40, np.nan, np.float32)),
        "weights": lambda d: tamper_npz(d / "encoder.npz", data=np.full(40 * 24, nan16)),
        "bias": lambda d: np.save(d / "bias.npy", np.full(40, np.inf, np.float16)),
    }
    for name, tamper in cases.items():
        root = tmp_path / name
        shutil.copytree(tmp_path / "good", root)
        tamper(root / layer_dir)
        rc, err = features(root)
        assert rc == 2 and "not finite" in err and name.rstrip("s") in err, (name, err)
        assert not (tmp_path / f"out-{name}").exists()  # refused before anything is written
        with pytest.raises(ValueError, match="not finite"):
            load_dictionary(SAEConfig(root_path=root, dictionary_name="d")).get_layer(1)


def test_damaged_shapes_and_huge_requests_are_one_line_errors(tmp_path, rng, capsys, monkeypatch):
    """Damaged shapes (a 2-D bias or shape) and huge requests (a dense expansion past the memory, --top 10^9,
    --prompt -99999) are one-line errors."""
    import shutil

    from support.datasets import write_dataset

    import lmprobe.base.allocator

    write_dataset(tmp_path / "ds", rng, n=6, layers=(0,), dim=24, storage="full_sequence")
    W, b = make_encoder(rng)
    export_sae(layer=0, root=tmp_path / "good", dictionary="d", W_enc=W, b_enc=b)
    enc = "d/layer_0/encoder.npz"
    cases = {
        "bias-2d": (lambda r: np.save(r / "d/layer_0/bias.npy", np.zeros((40, 1), np.float16)), "bias must be a 1-D"),
        "shape-2d": (lambda r: tamper_npz(r / enc, shape=np.array([[40, 24]])), "shape must be [features, hidden_dim]"),
        "indptr-2d": (lambda r: tamper_npz(r / enc, indptr=np.zeros((41, 1), np.int32)), "indptr must be a 1-D"),
        # a header declaring 2^34 values over 16 bytes: numpy would allocate 32 GiB before reading
        "bias-header": (lambda r: (r / "d/layer_0/bias.npy").write_bytes(huge_npy()), "header declares 34359738368"),
        "encoder-header": (lambda r: huge_npz(r / enc), "header declares 34359738368"),
    }
    for name, (tamper, message) in cases.items():
        shutil.copytree(tmp_path / "good", tmp_path / name)
        tamper(tmp_path / name)
        rc, err = run_cli(capsys, ["sae-topk", "--root", tmp_path / name, "--dict", "d", "--layer", 0])
        assert rc == 2 and message in err, (name, err)
    # 20,000 features of one weight each: expanding them densely takes 1.8 MiB, refused before allocating on a
    # machine with 1 MiB free (2^24 empty features in a 66 KB file: test_a_small_file_declaring_2_24_features...)
    (tmp_path / "huge/d/layer_0").mkdir(parents=True)
    n = 20_000
    meta = json.loads((tmp_path / "good/d/meta.json").read_text())
    meta.update(feature_count=n, layer_ranges={"0": [0, n]})
    (tmp_path / "huge/d/meta.json").write_text(json.dumps(meta))
    np.savez(tmp_path / "huge" / enc, data=np.ones(n, np.float16), indices=np.zeros(n, np.int32),
             indptr=np.arange(n + 1, dtype=np.int32), shape=np.array([n, 24]))
    monkeypatch.setattr(lmprobe.base.allocator, "available_memory", lambda: 2**20)  # a machine with 1 MiB free
    rc, err = run_cli(capsys, ["features", tmp_path / "ds", "--sae", tmp_path / "huge", "--dict", "d", "--layer", 0,
                               "--out", tmp_path / "f1", "--quiet"])
    assert rc == 2 and "20000 x 24" in err and "1.8 MiB" in err and "1.0 MiB available" in err, err
    monkeypatch.undo()
    rc, err = run_cli(capsys, ["features", tmp_path / "ds", "--sae", tmp_path / "good", "--dict", "d", "--layer", 0,
                               "--out", tmp_path / "f2", "--quiet", "--top", 10**9])
    assert rc == 2 and "--top" in err, err
    assert not (tmp_path / "f1").exists() and not (tmp_path / "f2").exists()
    for prompt in (-99999, 6):
        rc, err = run_cli(capsys, ["sae-topk", "--root", tmp_path / "good", "--dict", "d", "--layer", 0, "--dataset",
                                   tmp_path / "ds", "--prompt", prompt])
        assert rc == 2 and f"prompt {prompt} is not in" in err and "0..5" in err, err


_LIMITED = """
import resource, sys
import lmprobe.cli, lmprobe.sae.features, lmprobe.pages.features, pyarrow.parquet  # what `features` imports
def vm():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
limit = vm() + (1536 << 20)  # 1.5 GiB of address space left: a container's or `ulimit -v`'s limit
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
sys.exit(lmprobe.cli.main(sys.argv[1:]))
"""


def _features_limited(tmp_path, root):
    """`lmprobe features` in a process with 1.5 GiB of address space left, as under a container's limit."""
    r = subprocess.run([sys.executable, "-c", _LIMITED, "features", str(tmp_path / "ds"), "--sae", str(root),
                        "--dict", "d", "--layer", "0", "--out", str(tmp_path / f"out-{root.name}"), "--quiet"],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return r.returncode, r.stderr.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status")
def test_a_small_file_declaring_2_24_features_is_refused_by_its_declared_sizes(tmp_path, rng):
    """A 66 KB dictionary declaring 2^24 features died with numpy's _ArrayMemoryError
    traceback where memory is limited (MemAvailable said there was room). The declared sizes are checked against
    the file: a few KB cannot hold 2^24 features' weights."""
    from support.datasets import write_dataset

    write_dataset(tmp_path / "ds", rng, n=6, layers=(0,), dim=24, storage="full_sequence")
    W, b = make_encoder(rng)
    export_sae(layer=0, root=tmp_path / "good", dictionary="d", W_enc=W, b_enc=b)
    (tmp_path / "huge/d/layer_0").mkdir(parents=True)
    meta = json.loads((tmp_path / "good/d/meta.json").read_text())
    meta.update(feature_count=2**24, layer_ranges={"0": [0, 2**24]})
    (tmp_path / "huge/d/meta.json").write_text(json.dumps(meta))
    enc = tmp_path / "huge/d/layer_0/encoder.npz"
    np.savez_compressed(enc, data=np.zeros(0, np.float16), indices=np.zeros(0, np.int32),
                        indptr=np.zeros(2**24 + 1, np.int32), shape=np.array([2**24, 24]))
    assert enc.stat().st_size < 100_000
    rc, err = _features_limited(tmp_path, tmp_path / "huge")
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "encoder.npz" in err and "arrays declare" in err and "export it again" in err, err
    assert not (tmp_path / "out-huge").exists()
    with pytest.raises(DictionaryError, match="arrays declare"):
        load_dictionary(SAEConfig(root_path=tmp_path / "huge", dictionary_name="d")).get_layer(0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status")
def test_a_dense_expansion_past_the_process_limit_is_one_line(tmp_path, rng):
    """R31: an honest sparse dictionary (200,000 features of one weight each over 4,096 dims: 2.4 MB on disk) whose
    dense expansion (3.1 GiB) may pass MemAvailable but not the process's own limit: one line, before allocating."""
    from support.datasets import write_dataset

    dim, n = 4096, 200_000
    write_dataset(tmp_path / "ds", rng, n=3, layers=(0,), dim=dim, storage="full_sequence")
    (tmp_path / "sparse/d/layer_0").mkdir(parents=True)
    W, b = make_encoder(rng)
    export_sae(layer=0, root=tmp_path / "good", dictionary="d", W_enc=W, b_enc=b)
    meta = json.loads((tmp_path / "good/d/meta.json").read_text())
    meta.update(feature_count=n, layer_ranges={"0": [0, n]})
    (tmp_path / "sparse/d/meta.json").write_text(json.dumps(meta))
    np.savez(tmp_path / "sparse/d/layer_0/encoder.npz", data=rng.normal(size=n).astype(np.float16),
             indices=rng.integers(0, dim, n).astype(np.int32), indptr=np.arange(n + 1, dtype=np.int32),
             shape=np.array([n, dim]))
    rc, err = _features_limited(tmp_path, tmp_path / "sparse")
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{n} x {dim}" in err and "available here" in err, err  # counted before allocating


def test_auto_device_on_a_machine_without_a_gpu_does_not_import_torch():
    """device "auto" on a machine without a GPU does not import torch (~1 s on every `sae-topk` call)."""
    code = ("import sys; from lmprobe.sae.loader import detect_device; print(detect_device('auto'), "
            "'torch' in sys.modules)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, as on this machine and CI
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["cpu", "False"], r.stdout + r.stderr


def test_info_and_validate_describe_an_sae_dictionary(tmp_path, rng, capsys):
    """`info` and `validate` describe an SAE dictionary instead of refusing it."""
    from safetensors.numpy import save_file

    W = rng.normal(size=(8, 16)).astype(np.float32)
    save_file({"enc.weight": W.T.copy(), "enc.bias": np.zeros(16, np.float32)}, str(tmp_path / "sae.safetensors"))
    for layer in ("2", "5"):
        assert cli_main(["export-sae", str(tmp_path / "sae.safetensors"), "--layer", layer, "--root",
                         str(tmp_path / "r"), "--dict", "tiny", "--weight-key", "enc.weight", "--orientation",
                         "out_in"]) == 0
    capsys.readouterr()
    folder = tmp_path / "r" / "tiny"
    assert cli_main(["info", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"SAE dictionary {folder}", out
    assert "layers       [2, 5] (16 features x 8 dims each, activation relu)" in out, out
    assert cli_main(["validate", str(folder)]) == 0
    assert capsys.readouterr().out.strip() == f"{folder}: SAE dictionary OK (0 problem(s))"
    (folder / "layer_5" / "encoder.npz").write_bytes(b"not a zip")
    assert cli_main(["validate", str(folder)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{folder}: SAE dictionary INVALID (1 problem(s))") and "layer_5" in out, out


def test_a_dictionary_declaring_a_huge_hidden_dim_is_refused(tmp_path, rng):
    from lmprobe.sae import SAEConfig, load_dictionary, validate_dictionary
    from lmprobe.sae.export import export_sae

    W = rng.normal(size=(8, 12)).astype(np.float32)
    export_sae(layer=0, root=tmp_path, dictionary="d", W_enc=W, b_enc=np.zeros(12, np.float32))
    enc = tmp_path / "d/layer_0/encoder.npz"
    with np.load(enc) as z:
        arrays = dict(z)
    arrays["shape"] = np.array([12, 10**9], dtype=np.int64)
    with open(enc, "wb") as f:
        np.savez(f, **arrays)
    problems = validate_dictionary(tmp_path, "d")
    assert problems and "hidden_dim" in problems[0]
    with pytest.raises(ValueError, match="hidden_dim"):
        load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d")).get_layer(0)


def test_the_python_api_validates_and_describes_an_sae_dictionary(tmp_path, rng):
    """lmprobe.validate and lmprobe.info take a dictionary folder as the command line does."""
    import lmprobe
    from lmprobe.sae.export import export_sae

    export_sae(layer=0, root=tmp_path, dictionary="d", W_enc=rng.normal(size=(8, 12)).astype(np.float32),
               b_enc=np.zeros(12, np.float32))
    report = lmprobe.validate(tmp_path / "d")
    assert report.ok and str(report) == f"{tmp_path / 'd'}: SAE dictionary OK (0 problem(s))"
    assert lmprobe.info(tmp_path / "d").splitlines()[0] == f"SAE dictionary {tmp_path / 'd'}"
    (tmp_path / "d" / "layer_0" / "encoder.npz").write_bytes(b"not a zip")
    report = lmprobe.validate(tmp_path / "d")
    assert not report.ok and len(report.errors) == 1
    with pytest.raises(lmprobe.LmprobeError):
        report.raise_for_errors()
