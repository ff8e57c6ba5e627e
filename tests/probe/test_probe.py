"""Notebook probing: features per layer, sweeps, saved probes, the CLI, the examples."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from support.datasets import write_dataset
from support.paths import ROOT

import lmprobe
import lmprobe.probe as probe
from lmprobe.cli import main as cli_main
from lmprobe.format.writer import DatasetWriter


def separable(out, rng, *, n=60, dim=8, layers=(0, 1, 2), classes=2, storage="pooled"):
    """Layer i carries the label with strength i: later layers probe better."""
    y = np.arange(n) % classes
    direction = rng.normal(size=(classes, dim))
    n_tok = rng.integers(1, 5, size=n) if storage == "full_sequence" else np.ones(n, dtype=int)
    with DatasetWriter(out, layers=list(layers), dim=dim, model_name="m", label_type="int", storage=storage) as w:
        hidden = {}
        for layer in layers:
            rows = rng.normal(size=(int(n_tok.sum()), dim)).astype(np.float32)
            ends = np.cumsum(n_tok) - 1
            rows[ends] += 1.5 * layer * direction[y]
            hidden[layer] = rows
        w.add_batch(texts=[f"t{i}" for i in range(n)], num_tokens=n_tok, labels=y.tolist(), hidden=hidden)
    return y


def test_sweep_table_is_deterministic_and_finds_the_signal(tmp_path, rng):
    separable(tmp_path / "ds", rng)
    table = probe.sweep(tmp_path / "ds", cv=5, seed=1)
    assert list(table.columns[:4]) == ["layer", "accuracy", "accuracy_std", "auroc"]
    assert table["layer"].tolist() == [0, 1, 2]
    assert table["accuracy"][0] < 0.75 and table["accuracy"][2] > 0.95 and table["auroc"][2] > 0.95
    again = probe.sweep(tmp_path / "ds", cv=5, seed=1)
    assert table.equals(again)
    ridge = probe.sweep(tmp_path / "ds", cv=3, classifier="ridge", layers=[2])
    assert len(ridge) == 1 and ridge["accuracy"][0] > 0.9


def test_multiclass_has_no_auroc(tmp_path, rng):
    separable(tmp_path / "ds", rng, classes=3)
    table = probe.sweep(tmp_path / "ds", cv=3)
    assert table["auroc"].isna().all() and table["accuracy"].iloc[-1] > 0.9


def test_features_and_mean_pooling(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=9, layers=(0, 3), dim=4, storage="full_sequence")
    ds = lmprobe.load(tmp_path / "ds")
    X = probe.mean_hidden(ds, 3, chunk_bytes=64)  # tiny chunks: several passes
    for i in range(9):
        a, b = src["tok_start"][i], src["tok_start"][i + 1]
        np.testing.assert_allclose(X[i], src["hidden"][3][a:b].mean(axis=0), rtol=1e-6, atol=1e-6)
    feats, y = probe.layer_features(ds, pooling="mean")
    assert sorted(feats) == [0, 3] and feats[0].shape == (9, 4) and len(y) == 9
    np.testing.assert_array_equal(probe.features(ds, 0), ds.hidden(0))


def test_probe_errors(tmp_path, rng):
    write_dataset(tmp_path / "p", rng, n=10)
    with pytest.raises(probe.ProbeError, match="--storage full_sequence"):
        probe.features(tmp_path / "p", 0, pooling="mean")
    with pytest.raises(probe.ProbeError, match="no 'sentiment' column"):
        probe.sweep(tmp_path / "p", label_column="sentiment")
    with pytest.raises(probe.ProbeError, match="cv=50 folds"):
        probe.sweep(tmp_path / "p", cv=50)


def test_saved_probe_loads_without_pickle_and_predicts_the_same(tmp_path, rng):
    y = separable(tmp_path / "ds", rng, classes=3)
    ds = lmprobe.load(tmp_path / "ds")
    p = probe.train_probe(ds, layer=2)
    weights, meta = p.save(tmp_path / "probe")
    assert weights.suffix == ".safetensors" and json.loads(meta.read_text())["layer"] == 2
    assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith("probe")) == ["probe.json", "probe.safetensors"]
    q = probe.LinearProbe.load(tmp_path / "probe")
    X = ds.hidden(2)
    np.testing.assert_array_equal(q.predict(X), p.predict(X))
    np.testing.assert_allclose(q.predict_proba(X).sum(axis=1), 1, rtol=1e-6)
    assert q.score(X, y) > 0.95
    # the same predictions as scikit-learn's own model on the same standardised data
    from sklearn.linear_model import LogisticRegression

    Z = (X - X.mean(0)) / X.std(0)
    ref = LogisticRegression(max_iter=5000, random_state=0).fit(Z, y)
    np.testing.assert_array_equal(q.predict(X), ref.predict(Z))
    with pytest.raises(probe.ProbeError, match="takes 8-dim"):
        q.predict(np.zeros((1, 5)))


def test_cli_probe_table_and_plot(tmp_path, rng, capsys):
    separable(tmp_path / "ds", rng)
    assert cli_main(["probe", str(tmp_path / "ds"), "--cv", "4", "--plot", str(tmp_path / "acc.png")]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "best layer" in out and "n_features" in out
    png = (tmp_path / "acc.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_the_probe_command_saves_nothing_unasked_once_nnsight_is_imported(tmp_path, rng, capsys):
    """nnsight, once imported (an nnsight extraction earlier in the same process), gives every object a `save` method,
    argparse.Namespace too; `lmprobe probe` without --save must still not try to save (it tried to save to that
    method: a TypeError)."""
    import nnsight  # noqa: F401

    separable(tmp_path / "ds", rng)
    assert cli_main(["probe", str(tmp_path / "ds"), "--cv", "2"]) == 0
    assert "wrote" not in capsys.readouterr().out
    assert cli_main(["probe", str(tmp_path / "ds"), "--cv", "2", "--save", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_example_notebook_runs_offline(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    shutil.copy(ROOT / "examples/probing.ipynb", tmp_path)
    shutil.copy(ROOT / "examples/prompts.jsonl", tmp_path)
    nb = nbformat.read(tmp_path / "probing.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    # no warnings in the notebook (tqdm's "IProgress not found" when ipywidgets is missing: the notebook extra)
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "Warning" not in stderr, stderr
    assert (tmp_path / "out/sweep.png").exists() and (tmp_path / "out/sentiment-probe.safetensors").exists()
    scored = nb.cells[-2].outputs[-1]["data"]["text/plain"]
    assert "The pizza was wonderful." in scored and "The service was awful." in scored
    # plain values, a probe in one line, and a word on the sentence it gets wrong
    plain = [o["data"]["text/plain"] for o in outputs if "text/plain" in o.get("data", {})]
    assert not [t for t in plain if "np.int64" in t or "np.float" in t], plain
    shown = [t for t in plain if t.startswith("<LinearProbe")]
    assert len(shown) == 1 and "\n" not in shown[0] and "train accuracy" in shown[0], shown
    assert 'Why "The service was awful." comes out positive' in "".join(nb.cells[-1].source)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_third_party_reader_script_needs_no_lmprobe(tmp_path, rng, dtype):
    """The example reads every stored dtype, bfloat16 (which numpy lacks) without torch too."""
    write_dataset(tmp_path / "ds", rng, n=12, layers=(0, 7), dim=5, shard_size="100B", dtype=dtype)
    code = ("import runpy, sys; sys.modules['lmprobe'] = None; sys.modules['torch'] = None; sys.argv = sys.argv[1:];"
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "examples/read_without_lmprobe.py"), str(tmp_path / "ds"),
                        "7"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "12 prompts, layer 7: X (12, 5)" in r.stdout
    X = lmprobe.load(tmp_path / "ds").hidden(7)  # lmprobe's reader: the stored values as float32
    assert f"|x| = {np.linalg.norm(X[0]):.4f}" in r.stdout


def test_probe_without_a_label_column_names_the_columns_and_the_option(tmp_path, capsys):
    """Without a label column, the error names the columns there are and the option that picks one."""
    f = tmp_path / "p.csv"
    f.write_text("Text,Label,topic\n" + "".join(f"prompt number {i},{i % 2},t{i % 3}\n" for i in range(12)))
    lmprobe.extract("lmprobe-tiny", f, out=tmp_path / "ds", layers="-1", text_column="Text", quiet=True)
    assert "pass --label-column Label" in capsys.readouterr().err  # said at extraction already
    assert cli_main(["probe", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("lmprobe probe: error: the dataset has no 'label' column; its own columns are ['Label', 'topic']: "
                   "pass --label-column NAME (label_column= in Python); did you mean --label-column Label?"), err
    assert cli_main(["probe", str(tmp_path / "ds"), "--label-column", "Label", "--cv", "2"]) == 0


def test_cli_probe_methods_baselines_and_save(tmp_path, rng, capsys):
    separable(tmp_path / "ds", rng, dim=48)
    assert cli_main(["probe", str(tmp_path / "ds"), "--method", "mass_mean,pca", "--cv", "4", "--baselines",
                     "--bootstrap", "50", "--save", str(tmp_path / "best")]) == 0
    out = capsys.readouterr().out
    assert "mass_mean" in out and "pca" in out and "accuracy_lo" in out and "baselines (same folds):" in out
    assert "best baseline" in out and "beaten" in out
    p = probe.LinearProbe.load(tmp_path / "best")
    assert p.layer in (1, 2) and p.settings["method"] in ("mass_mean", "pca")  # the best row (both score 1.0)
    assert cli_main(["probe", str(tmp_path / "ds"), "--method", "svm"]) == 2
    assert "method must be one of logistic, ridge, mass_mean" in capsys.readouterr().err
    assert cli_main(["probe", str(tmp_path / "ds"), "--layers", "1,2", "--concat", "--method", "mass_mean",
                     "--cv", "3"]) == 0
    assert "1+2" in capsys.readouterr().out


def test_a_probe_shows_itself_in_one_line(tmp_path, rng):
    """repr(LinearProbe) is one line, not hundreds of lines of arrays, with plain values, not np.int64(1)."""
    separable(tmp_path / "ds", rng, dim=48)
    p = probe.train_probe(tmp_path / "ds", layer=2, method="mass_mean")
    text = repr(p)
    assert "\n" not in text and len(text) < 300, text
    assert text.startswith("<LinearProbe mass_mean, layer 2, resid_post, last_token pooling, 48 dims, classes [0, 1]")
    assert "train accuracy 1.0" in text and "np." not in text, text
    loaded_path = tmp_path / "p"
    p.save(loaded_path)
    assert repr(probe.LinearProbe.load(loaded_path)) == text  # the score is kept with the probe
    assert all(type(c) is int for c in p.classes)
