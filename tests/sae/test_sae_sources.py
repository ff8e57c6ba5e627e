"""export-sae from SAELens and sparsify saves: the dictionary's scores are the SAE's own pre-activations.

Two kinds of check: against each library's documented encode formula, on folders laid out as the
libraries save them (always); and against the libraries' own ``encode``, run in a second virtual
environment holding ``sae-lens`` and ``eai-sparsify`` (slow; .ci/run makes that environment).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from reference.envs import interop_python
from safetensors.numpy import load_file, save_file
from support.paths import REFERENCE

from lmprobe.cli import main as cli_main
from lmprobe.sae import SAEConfig, load_dictionary
from lmprobe.sae.export import export_sae
from lmprobe.sae.loader import batch_scores, encode, encode_topk

D_IN, D_SAE = 16, 40


def scores(root: Path, name: str, layer: int, X: np.ndarray) -> np.ndarray:
    return batch_scores(load_dictionary(SAEConfig(root_path=root, dictionary_name=name)).get_layer(layer), X)


def saelens_folder(path: Path, rng, *, cfg: dict, extra: dict | None = None, bf16: bool = False) -> dict:
    t = {"W_enc": rng.normal(size=(D_IN, D_SAE)) * 0.3, "b_enc": rng.normal(size=D_SAE) * 0.3,
         "W_dec": rng.normal(size=(D_SAE, D_IN)) * 0.3, "b_dec": rng.normal(size=D_IN)}
    t.update(extra or {})
    path.mkdir(parents=True)
    arrays = {k: v.astype(np.float32) for k, v in t.items()}
    if bf16:
        import torch
        from safetensors.torch import save_file as save_pt

        save_pt({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in arrays.items()}, str(path / "sae_weights.safetensors"))
        arrays = {k: torch.from_numpy(v).to(torch.bfloat16).float().numpy() for k, v in arrays.items()}
    else:
        save_file(arrays, str(path / "sae_weights.safetensors"))
    (path / "cfg.json").write_text(json.dumps(cfg))
    return {k: v.astype(np.float64) for k, v in arrays.items()}


def sparsify_folder(path: Path, rng, *, cfg: dict) -> dict:
    t = {"encoder.weight": rng.normal(size=(D_SAE, D_IN)) * 0.3, "encoder.bias": rng.normal(size=D_SAE) * 0.3,
         "W_dec": rng.normal(size=(D_SAE, D_IN)) * 0.3, "b_dec": rng.normal(size=D_IN)}
    path.mkdir(parents=True)
    save_file({k: v.astype(np.float32) for k, v in t.items()}, str(path / "sae.safetensors"))
    (path / "cfg.json").write_text(json.dumps({"d_in": D_IN, "num_latents": D_SAE, "expansion_factor": 32, **cfg}))
    return {k: v.astype(np.float32).astype(np.float64) for k, v in t.items()}


def layer_of(root: Path, name: str, layer: int):
    return load_dictionary(SAEConfig(root_path=root, dictionary_name=name)).get_layer(layer)


def agree_on_firing(got: np.ndarray, want: np.ndarray) -> None:
    """The same features fire (up to float16 near-ties), with the same activations where both fire."""
    overlap = [len(set(np.flatnonzero(a)) & set(np.flatnonzero(b))) / max(np.count_nonzero(b), 1)
               for a, b in zip(got, want, strict=True)]
    assert np.mean(overlap) > 0.97, np.mean(overlap)
    both = (got > 0) & (want > 0)
    close(got[both], want[both])


def close(got: np.ndarray, want: np.ndarray) -> None:
    # dictionaries hold float16 weights and bias
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("version", ["v6", "v5"])
def test_saelens_standard_subtracts_b_dec_by_default(tmp_path, rng, version):
    cfg = ({"d_in": D_IN, "d_sae": D_SAE, "architecture": "standard", "apply_b_dec_to_input": True,
            "normalize_activations": "none", "metadata": {"sae_lens_version": "6.54.12",
                                                          "hook_name": "blocks.3.hook_resid_post"}}
           if version == "v6" else {"d_in": D_IN, "d_sae": D_SAE, "hook_name": "blocks.3.hook_resid_post",
                                    "hook_layer": 3, "activation_fn_str": "relu", "normalize_activations": False})
    t = saelens_folder(tmp_path / "sae", rng, cfg=cfg)
    X = rng.normal(size=(200, D_IN))
    export_sae(tmp_path / "sae", layer=3, root=tmp_path / "root", dictionary="d")
    want = (X - t["b_dec"]) @ t["W_enc"] + t["b_enc"]
    got = scores(tmp_path / "root", "d", 3, X)
    close(got, want)
    # the SAE's top-10 features, as its encoder ranks them, are the dictionary's
    top = lambda s: np.argsort(-s, axis=1)[:, :10]  # noqa: E731
    agree = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top(got), top(want), strict=True)])
    assert agree > 0.97
    dropped = X @ t["W_enc"] + t["b_enc"]  # what the exporter computed before it folded b_dec
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top(dropped), top(want), strict=True)]) < agree
    meta = json.loads((tmp_path / "root/d/meta.json").read_text())
    src = meta["layer_sources"]["3"]
    assert src["source"] == "saelens" and src["b_dec_folded"] is True
    assert src["hook_name"] == "blocks.3.hook_resid_post"


def test_saelens_without_b_dec_on_the_input(tmp_path, rng):
    t = saelens_folder(tmp_path / "sae", rng, cfg={"d_in": D_IN, "d_sae": D_SAE, "apply_b_dec_to_input": False})
    X = rng.normal(size=(50, D_IN))
    export_sae(tmp_path / "sae", layer=0, root=tmp_path / "root", dictionary="d")
    close(scores(tmp_path / "root", "d", 0, X), X @ t["W_enc"] + t["b_enc"])
    assert json.loads((tmp_path / "root/d/meta.json").read_text())["layer_sources"]["0"]["b_dec_folded"] is False


def test_saelens_jumprelu_fires_exactly_where_its_score_is_positive(tmp_path, rng):
    theta = np.abs(rng.normal(size=D_SAE)) * 0.5
    t = saelens_folder(tmp_path / "sae", rng, cfg={"d_in": D_IN, "d_sae": D_SAE, "architecture": "jumprelu"},
                       extra={"threshold": theta})
    X = rng.normal(size=(100, D_IN))
    export_sae(tmp_path / "sae", layer=1, root=tmp_path / "root", dictionary="d")
    pre = (X - t["b_dec"]) @ t["W_enc"] + t["b_enc"]
    got = scores(tmp_path / "root", "d", 1, X)
    close(got, pre - t["threshold"])
    margin = np.abs(pre - t["threshold"]) > 0.05  # away from float16 rounding at the threshold
    np.testing.assert_array_equal((got > 0)[margin], (pre > t["threshold"])[margin])


def test_saelens_gated_uses_the_gate(tmp_path, rng):
    t = saelens_folder(tmp_path / "sae", rng, cfg={"d_in": D_IN, "d_sae": D_SAE, "architecture": "gated"},
                       extra={"b_gate": rng.normal(size=D_SAE), "b_mag": rng.normal(size=D_SAE),
                              "r_mag": rng.normal(size=D_SAE) * 0.1})
    X = rng.normal(size=(50, D_IN))
    export_sae(tmp_path / "sae", layer=0, root=tmp_path / "root", dictionary="d")
    close(scores(tmp_path / "root", "d", 0, X), (X - t["b_dec"]) @ t["W_enc"] + t["b_gate"])


def test_saelens_topk_with_decoder_norm_rescaling(tmp_path, rng):
    t = saelens_folder(tmp_path / "sae", rng, cfg={"d_in": D_IN, "d_sae": D_SAE, "architecture": "topk", "k": 5,
                                                   "rescale_acts_by_decoder_norm": True})
    X = rng.normal(size=(50, D_IN))
    export_sae(tmp_path / "sae", layer=0, root=tmp_path / "root", dictionary="d")
    want = ((X - t["b_dec"]) @ t["W_enc"] + t["b_enc"]) * np.linalg.norm(t["W_dec"], axis=1)
    close(scores(tmp_path / "root", "d", 0, X), want)


def test_saelens_unfolded_scaling_factor_and_refused_normalisations(tmp_path, rng):
    t = saelens_folder(tmp_path / "ckpt", rng, cfg={"d_in": D_IN, "d_sae": D_SAE,
                                                    "normalize_activations": "expected_average_only_in"})
    (tmp_path / "ckpt/activation_scaler.json").write_text(json.dumps({"scaling_factor": 0.25}))
    X = rng.normal(size=(50, D_IN))
    export_sae(tmp_path / "ckpt", layer=0, root=tmp_path / "root", dictionary="d")
    close(scores(tmp_path / "root", "d", 0, X), (0.25 * X - t["b_dec"]) @ t["W_enc"] + t["b_enc"])
    (tmp_path / "ckpt/activation_scaler.json").unlink()
    with pytest.raises(ValueError, match="no scaling factor"):
        export_sae(tmp_path / "ckpt", layer=0, root=tmp_path / "root", dictionary="e")
    saelens_folder(tmp_path / "ln", rng, cfg={"d_in": D_IN, "d_sae": D_SAE, "normalize_activations": "layer_norm"})
    with pytest.raises(ValueError, match="not an affine"):
        export_sae(tmp_path / "ln", layer=0, root=tmp_path / "root", dictionary="f")


def test_saelens_bfloat16_weights(tmp_path, rng):
    t = saelens_folder(tmp_path / "sae", rng, cfg={"d_in": D_IN, "d_sae": D_SAE, "dtype": "bfloat16"}, bf16=True)
    X = rng.normal(size=(50, D_IN))
    export_sae(tmp_path / "sae", layer=0, root=tmp_path / "root", dictionary="d")
    close(scores(tmp_path / "root", "d", 0, X), (X - t["b_dec"]) @ t["W_enc"] + t["b_enc"])


def test_sparsify_save_as_it_is(tmp_path, rng):
    t = sparsify_folder(tmp_path / "layers.6", rng, cfg={"k": 8, "activation": "topk"})
    X = rng.normal(size=(50, D_IN))
    assert cli_main(["export-sae", str(tmp_path / "layers.6"), "--layer", "6", "--root", str(tmp_path / "root"),
                     "--dict", "s"]) == 0
    want = (X - t["b_dec"]) @ t["encoder.weight"].T + t["encoder.bias"]
    close(scores(tmp_path / "root", "s", 6, X), want)
    src = json.loads((tmp_path / "root/s/meta.json").read_text())["layer_sources"]["6"]
    assert src == {"source": "sparsify", "architecture": "sae", "b_dec_folded": True,
                   "activation": {"rule": "topk", "k": 8}, "hookpoint": "layers.6"}


def test_sparsify_transcoder_keeps_its_bias(tmp_path, rng):
    t = sparsify_folder(tmp_path / "layers.2.mlp", rng, cfg={"k": 8, "transcode": True})
    X = rng.normal(size=(50, D_IN))
    export_sae(tmp_path / "layers.2.mlp", layer=2, root=tmp_path / "root", dictionary="t")
    close(scores(tmp_path / "root", "t", 2, X), X @ t["encoder.weight"].T + t["encoder.bias"])


def test_a_folder_of_several_hookpoints(tmp_path, rng, capsys):
    run = tmp_path / "run"
    wants = {name: sparsify_folder(run / name, rng, cfg={"k": 4}) for name in ("layers.10", "layers.2", "layers.3.mlp")}
    (run / "config.json").write_text("{}")  # sparsify's run config sits beside the hookpoints
    args = ["export-sae", str(run), "--layer", "2", "--root", str(tmp_path / "root"), "--dict", "s"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "several hookpoints (layers.2, layers.3.mlp, layers.10)" in err and "--hookpoint" in err
    assert cli_main([*args, "--hookpoint", "layers.9"]) == 2
    assert "no SAE for hookpoint 'layers.9'" in capsys.readouterr().err
    assert cli_main([*args, "--hookpoint", "layers.2"]) == 0
    X = rng.normal(size=(20, D_IN))
    t = wants["layers.2"]
    close(scores(tmp_path / "root", "s", 2, X), (X - t["b_dec"]) @ t["encoder.weight"].T + t["encoder.bias"])


def test_a_single_file_with_a_decoder_bias_key(tmp_path, rng):
    W, b, b_dec = rng.normal(size=(D_SAE, D_IN)), rng.normal(size=D_SAE), rng.normal(size=D_IN)
    save_file({"enc.w": W.astype(np.float32), "enc.b": b.astype(np.float32), "dec.b": b_dec.astype(np.float32)},
              str(tmp_path / "w.safetensors"))
    export_sae(tmp_path / "w.safetensors", layer=0, root=tmp_path / "root", dictionary="d", weight_key="enc.w",
               bias_key="enc.b", b_dec_key="dec.b", orientation="out_in")
    X = rng.normal(size=(30, D_IN))
    close(scores(tmp_path / "root", "d", 0, X), (X - b_dec) @ W.T + b)


# ---------------------------------------------------------------------------------------------- the libraries

@pytest.fixture(scope="session")
def library_saes(tmp_path_factory) -> Path:
    """SAEs saved, and inputs encoded, by SAELens and sparsify themselves (in their own environment)."""
    python = interop_python()
    out = tmp_path_factory.mktemp("libraries")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    r = subprocess.run([str(python), "-I", str(REFERENCE / "sae_libraries.py"), str(out)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["standard", "standard_no_bdec", "topk", "topk_rescaled", "jumprelu", "gated"])
def test_saelens_own_encode_agrees(library_saes, tmp_path, name):
    enc = load_file(str(library_saes / "encoded.safetensors"))
    X, acts = enc["x"].astype(np.float64), enc[f"saelens/{name}"]
    export_sae(library_saes / "saelens" / name, layer=2, root=tmp_path, dictionary="d")
    s = scores(tmp_path, "d", 2, X)
    fires = acts > 0
    margin = np.abs(s) > 0.05  # away from float16 rounding at the firing boundary
    if name.startswith("topk"):
        k = int(fires.sum(axis=1).max())
        ours = np.argsort(-s, axis=1)[:, :k]
        theirs = [set(np.flatnonzero(row)) for row in fires]
        agree = np.mean([len(set(o) & t) / max(len(t), 1) for o, t in zip(ours, theirs, strict=True)])
        assert agree > 0.97
    elif name == "gated":
        # the score is the gate: a feature that fires has an open gate (its magnitude path can still
        # give zero, which the dictionary does not store)
        assert np.all((s > 0)[margin & fires])
        assert np.mean((s > 0)[margin] == fires[margin]) > 0.5
    else:
        np.testing.assert_array_equal((s > 0)[margin], fires[margin])
    if name.startswith("standard"):
        close(np.maximum(s, 0), acts)
    # the recorded rule gives the library's own activations: k at most per token for top-k
    a = encode(layer_of(tmp_path, "d", 2), X)
    if name.startswith("topk"):
        assert (np.count_nonzero(a, axis=1) <= 6).all() and np.count_nonzero(a, axis=1).mean() > 5
    if name != "gated":  # the gated magnitude path is not stored (docs/sae.md)
        agree_on_firing(a, acts)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["layers.2", "layers.3.mlp"])
def test_sparsify_own_encode_agrees(library_saes, tmp_path, name):
    enc = load_file(str(library_saes / "encoded.safetensors"))
    X, pre = enc["x"].astype(np.float64), enc[f"sparsify/{name}/pre_acts"]
    export_sae(library_saes / "sparsify", layer=3, root=tmp_path, dictionary="d", hookpoint=name)
    s = scores(tmp_path, "d", 3, X)
    close(np.maximum(s, 0), pre)
    top = np.argsort(-s, axis=1)[:, :6]
    theirs = enc[f"sparsify/{name}/top_indices"]
    agree = np.mean([len(set(a) & set(b)) / 6 for a, b in zip(top, theirs, strict=True)])
    assert agree > 0.97
    # sparsify's encode: its top-k activations, every other latent zero
    want = np.zeros_like(s)
    np.put_along_axis(want, theirs.astype(np.int64), enc[f"sparsify/{name}/top_acts"], axis=1)
    agree_on_firing(encode(layer_of(tmp_path, "d", 3), X), want)


# ---------------------------------------------------------------------------------------------- activation rules


def test_a_topk_sae_fires_k_features_per_token_in_features_and_sae_topk(tmp_path, rng, capsys):
    """A top-k SAE fires its k largest features, never as a dense one (every feature with W x + b > 0)."""
    from support.datasets import write_dataset

    import lmprobe
    from lmprobe.pages.features import features

    ds = tmp_path / "ds"
    write_dataset(ds, rng, n=12, layers=(0,), dim=D_IN, storage="full_sequence", shard_size="1KB")
    t = sparsify_folder(tmp_path / "layers.0", rng, cfg={"k": 8, "activation": "topk"})
    t["encoder.bias"] += 5.0  # every score positive: a relu rule would fire all 40
    save_file({k: v.astype(np.float32) for k, v in t.items()}, str(tmp_path / "layers.0" / "sae.safetensors"))
    export_sae(tmp_path / "layers.0", layer=0, root=tmp_path / "root", dictionary="k8")
    out = features(ds, tmp_path / "root", "k8", 0, tmp_path / "feat", quiet=True)
    freq = load_file(str(out / "features.safetensors"))["frequency"]
    np.testing.assert_allclose(freq.sum(), 8.0)  # k firing features per token, not 40
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["activation"] == {"rule": "topk", "k": 8} and "topk (k=8)" in manifest["score"]
    # the top activations equal the SAE's own encode on the same vectors
    X = np.concatenate([lmprobe.load(ds).token_hidden(i, 0) for i in range(lmprobe.load(ds).num_prompts)])
    pre = np.maximum((X - t["b_dec"]) @ t["encoder.weight"].T + t["encoder.bias"], 0)
    want = np.where(pre >= np.sort(pre, axis=1)[:, -8:-7], pre, 0)
    top = load_file(str(out / "features.safetensors"))["top_values"]
    for f in range(D_SAE):
        col = np.sort(want[:, f])[::-1][: top.shape[1]]
        close(top[f][: np.count_nonzero(col)], col[: np.count_nonzero(col)])
    # sae-topk prints at most k firing features, and the raw scores with --scores
    args = ["sae-topk", "--root", str(tmp_path / "root"), "--dict", "k8", "--layer", "0", "--topk", "20"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert printed.count("feat_") == 8 and "activation topk (k=8)" in printed
    assert cli_main([*args, "--scores"]) == 0
    assert capsys.readouterr().out.count("feat_") == 20


def test_jumprelu_activations_are_the_pre_activations_above_the_threshold(tmp_path, rng):
    theta = np.abs(rng.normal(size=D_SAE)) * 0.5
    t = saelens_folder(tmp_path / "sae", rng, cfg={"d_in": D_IN, "d_sae": D_SAE, "architecture": "jumprelu"},
                       extra={"threshold": theta})
    X = rng.normal(size=(100, D_IN))
    for fmt in ("npz", "safetensors"):
        export_sae(tmp_path / "sae", layer=1, root=tmp_path / fmt, dictionary="d", file_format=fmt)
        pre = (X - t["b_dec"]) @ t["W_enc"] + t["b_enc"]
        want = np.where(pre > t["threshold"], np.maximum(pre, 0), 0)  # SAELens' JumpReLU encode
        layer = layer_of(tmp_path / fmt, "d", 1)
        assert layer.activation == {"rule": "jumprelu"} and layer.threshold is not None
        agree_on_firing(encode(layer, X), want)
        best = encode_topk(layer, X[0], k=3)
        np.testing.assert_allclose([a for _, a in best], np.sort(want[0])[::-1][:3], rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize(("rule", "fires"), [("relu", None), ("topk:3", 3), ("groupmax:4", 4), ("batchtopk:0.5", None)])
def test_rules_given_for_plain_arrays_and_their_pure_python_path(tmp_path, rng, rule, fires, monkeypatch):
    W = rng.normal(size=(D_SAE, D_IN)).astype(np.float32)
    b = (rng.normal(size=D_SAE) + 2).astype(np.float32)
    export_sae(layer=0, root=tmp_path, dictionary="d", W_enc=W, b_enc=b, orientation="out_in", activation=rule)
    layer = layer_of(tmp_path, "d", 0)
    X = rng.normal(size=(30, D_IN)).astype(np.float32)
    a = encode(layer, X)
    s = batch_scores(layer, X)
    if fires:
        assert (np.count_nonzero(a, axis=1) == fires).all()
    if rule == "batchtopk:0.5":
        np.testing.assert_array_equal(a > 0, s > 0.5)
    if rule == "groupmax:4":  # one per group of 10 features
        assert (np.count_nonzero(a.reshape(30, 4, 10), axis=2) == 1).all()
    want = encode_topk(layer, X[0], k=5)
    import lmprobe.sae.loader as loader

    monkeypatch.setattr(loader, "_numpy", lambda: None)
    plain = load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d")).get_layer(0)
    got = encode_topk(plain, X[0].tolist(), k=5)
    assert [i for i, _ in got] == [i for i, _ in want]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("rule", "message"), [
    ("topk:0", "k in 1..40"), ("topk:x", "use relu, topk:K"), ("groupmax:3", "divisible"), ("softmax", "use relu"),
])
def test_a_bad_rule_is_a_one_line_error(tmp_path, rng, rule, message, capsys):
    W = rng.normal(size=(D_IN, D_SAE)).astype(np.float32)
    save_file({"w": W}, str(tmp_path / "sae.safetensors"))
    assert cli_main(["export-sae", str(tmp_path / "sae.safetensors"), "--layer", "0", "--root", str(tmp_path / "r"),
                     "--dict", "d", "--weight-key", "w", "--orientation", "in_out", "--activation", rule]) == 2
    err = capsys.readouterr().err
    assert message in err and "\\n" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r" / "d").exists()


def test_a_tampered_rule_in_meta_json_is_refused(tmp_path, rng):
    from lmprobe.errors import DictionaryError

    W = rng.normal(size=(D_SAE, D_IN)).astype(np.float32)
    export_sae(layer=0, root=tmp_path, dictionary="d", W_enc=W, orientation="out_in", activation="topk:4")
    meta_path = tmp_path / "d" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["layer_sources"]["0"]["activation"] = {"rule": "topk", "k": 10**9}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DictionaryError, match="k in 1..40"):
        layer_of(tmp_path, "d", 0)


def test_dictionaries_exported_before_the_one_spelling_keep_their_rule(tmp_path, rng):
    W = rng.normal(size=(D_SAE, D_IN)).astype(np.float32)
    export_sae(layer=0, root=tmp_path, dictionary="d", W_enc=W, orientation="out_in")
    meta_path = tmp_path / "d" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for old, want in [({"activation": "topk", "k": 5}, {"rule": "topk", "k": 5}),
                      ({"architecture": "topk", "k": 6}, {"rule": "topk", "k": 6}),
                      ({"threshold_folded": True}, {"rule": "jumprelu"}), ({}, {"rule": "relu"})]:
        meta["layer_sources"]["0"] = {"source": "old", **old}
        meta_path.write_text(json.dumps(meta))
        assert layer_of(tmp_path, "d", 0).activation == want
