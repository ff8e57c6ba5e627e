"""Probe methods against their formulas and their peers' code: geometry-of-truth's MMProbe, scikit-learn's LDA and
PCA, CCS on pairs with a known truth direction; every method saved and predicting with numpy alone."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from support.features import gaussian, write

import lmprobe.probe as probe
from lmprobe.probe.methods import Pairs, fit


def cos(a, b):
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


def mmprobe(X, y, iid):
    """geometry-of-truth probes.py MMProbe.from_data and forward, written as they are (torch, pinv atol 1e-3)."""
    acts, labels = torch.tensor(X, dtype=torch.float64), torch.tensor(y)
    pos, neg = acts[labels == 1], acts[labels == 0]
    pos_mean, neg_mean = pos.mean(0), neg.mean(0)
    direction = pos_mean - neg_mean
    centered = torch.cat([pos - pos_mean, neg - neg_mean], 0)
    covariance = centered.t() @ centered / acts.shape[0]
    inv = torch.linalg.pinv(covariance, hermitian=True, atol=1e-3)
    w = inv @ direction if iid else direction
    return w.numpy()


@pytest.mark.parametrize("iid", [False, True])
@pytest.mark.parametrize("n", [400, 12])  # more rows than features, and fewer (the Gram-matrix path)
def test_mass_mean_follows_the_mmprobe_formula(rng, iid, n):
    X, y = gaussian(rng, n=n)
    f = fit(X, y, "mass_mean_iid" if iid else "mass_mean")
    assert cos(f.coef[0], mmprobe(X, y, iid)) >= 0.999
    assert np.isclose(np.linalg.norm(f.coef[0]), 1, atol=1e-5)
    s = X @ f.coef[0] + f.intercept[0]  # the threshold: midway between the projected class means
    assert np.isclose(s[y == 1].mean(), -s[y == 0].mean(), atol=1e-3)


def test_mass_mean_iid_is_the_lda_direction_and_lda_is_scikit_learns(rng):
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

    X, y = gaussian(rng, n=600)
    ref = LinearDiscriminantAnalysis().fit(X, y).coef_[0]
    assert cos(fit(X, y, "mass_mean_iid").coef[0], ref) >= 0.999
    assert cos(fit(X, y, "lda").coef[0], ref) >= 0.999
    plain = fit(X, y, "mass_mean").coef[0]
    assert cos(plain, ref) < 0.99  # correlated noise: the covariance correction matters here


def test_pca_is_scikit_learns_first_component_with_its_sign_from_the_labels(rng):
    from sklearn.decomposition import PCA

    X, y = gaussian(rng, n=300, shift=6.0, correlated=False)
    w = fit(X, y, "pca").coef[0]
    assert abs(cos(w, PCA(n_components=1).fit(X).components_[0])) >= 0.999
    assert (X[y == 1] @ w).mean() > (X[y == 0] @ w).mean()  # sign resolved: the positive class scores higher
    flipped = fit(X, 1 - y, "pca").coef[0]
    assert cos(flipped, w) <= -0.999
    # pair differences: the first component of the randomly signed differences, as RepE computes it
    a, b = np.arange(0, 300, 2), np.arange(1, 300, 2)
    D = X[b] - X[a]  # rows b have label 1
    w = fit(X, y, "pca", pairs=Pairs(a, b)).coef[0]
    assert abs(cos(w, PCA(n_components=1).fit(np.concatenate([D, -D])).components_[0])) >= 0.999


def test_ccs_finds_a_truth_direction_on_contrast_pairs_unsupervised(rng):
    """Statements and their negations (geometry-of-truth's cities / neg_cities): the side offset is removed by
    centring each side; what stays consistent across the pair is the truth direction."""
    n, dim = 200, 12
    truth = rng.normal(size=dim)
    truth /= np.linalg.norm(truth)
    t = rng.integers(0, 2, n)  # is the statement true
    base = rng.normal(size=(n, dim)) * 0.5
    stmt = base + np.where(t[:, None] == 1, 1, -1) * 2 * truth + 5 * rng.normal(size=dim)
    neg = base + np.where(t[:, None] == 1, -1, 1) * 2 * truth - 5 * rng.normal(size=dim)
    X = np.concatenate([stmt, neg]).astype(np.float32)
    y = np.concatenate([t, 1 - t])
    f = fit(X, y, "ccs", pairs=Pairs(np.arange(n), np.arange(n, 2 * n)), seed=0)
    assert cos(f.coef[0], truth) > 0.9  # sign resolved from the labels
    # CCS's own prediction compares the two sides of a pair, each centred: the statement is true when it scores higher
    s = X @ f.coef[0]
    assert np.mean((s[:n] - s[:n].mean() > s[n:] - s[n:].mean()) == (t == 1)) > 0.95


def test_bad_methods_are_one_line_errors_before_reading(rng):
    X, y = gaussian(rng, n=30)
    with pytest.raises(probe.ProbeError, match="method must be one of"):
        fit(X, y, "svm")
    with pytest.raises(probe.ProbeError, match="ccs' is fitted on contrast pairs: pass pairs="):
        fit(X, y, "ccs")
    with pytest.raises(probe.ProbeError, match="labels have 3: use method='logistic'"):
        fit(X, np.arange(30) % 3, "mass_mean")


@pytest.mark.parametrize("method", ["logistic", "ridge", "mass_mean", "mass_mean_iid", "lda", "pca"])
def test_every_method_saves_and_predicts_the_same_with_a_unit_direction(tmp_path, rng, method):
    X, y = gaussian(rng, n=120, dim=8, shift=2.0)
    write(tmp_path / "ds", {0: X}, y)
    p = probe.train_probe(tmp_path / "ds", layer=0, method=method)
    assert np.isclose(np.linalg.norm(p.direction), 1, atol=1e-5)
    assert (X[y == 1] @ p.direction).mean() > (X[y == 0] @ p.direction).mean()  # signed toward label 1
    # pca is unsupervised: on correlated noise its first component is mostly noise, yet still signed and better than chance
    assert p.score(X, y) > (0.55 if method == "pca" else 0.8) and p.settings["method"] == method
    p.save(tmp_path / "p")
    q = probe.LinearProbe.load(tmp_path / "p")
    np.testing.assert_array_equal(q.predict(X), p.predict(X))
    np.testing.assert_allclose(q.direction, p.direction, rtol=1e-6)


def test_direction_methods_run_without_scikit_learn(tmp_path, rng):
    X, y = gaussian(rng, n=80, dim=6, shift=3.0, correlated=False)
    write(tmp_path / "ds", {0: X, 1: X * 2}, y, pair=[int(i) // 2 for i in range(80)])
    code = f"""
import sys; sys.modules['sklearn'] = None
import numpy as np, lmprobe.probe as probe
for m in ['mass_mean', 'mass_mean_iid', 'pca']:
    p = probe.train_probe({str(tmp_path / 'ds')!r}, layer=0, method=m)
    p.save({str(tmp_path)!r} + '/' + m)
    print(m, round(float(probe.LinearProbe.load({str(tmp_path)!r} + '/' + m).score(
        __import__('lmprobe').load({str(tmp_path / 'ds')!r}).hidden(0), np.arange(80) % 2)), 2))
t = probe.sweep({str(tmp_path / 'ds')!r}, method=['mass_mean', 'pca', 'ccs'], pairs='pair', cv=4)
print(len(t), sorted(set(t.method)))
try:
    probe.sweep({str(tmp_path / 'ds')!r}, method='logistic')
except probe.ProbeError as e:
    print('error:', e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[:3]] == ["mass_mean", "mass_mean_iid", "pca"]
    assert all(float(ln.split()[1]) > 0.8 for ln in lines[:3])
    assert lines[3] == "6 ['ccs', 'mass_mean', 'pca']"
    assert lines[4].startswith("error: logistic needs scikit-learn: pip install 'lmprobe[probe]'")


def test_a_tampered_probe_file_is_a_one_line_error(tmp_path, rng):
    X, y = gaussian(rng, n=40, dim=4)
    write(tmp_path / "ds", {0: X}, y)
    probe.train_probe(tmp_path / "ds", layer=0, method="mass_mean").save(tmp_path / "p")
    meta = (tmp_path / "p.json").read_text()
    (tmp_path / "p.json").write_text(meta.replace('"layer": 0', '"layer": "0; rm -rf"'))
    with pytest.raises(probe.ProbeError, match="wrong type"):
        probe.LinearProbe.load(tmp_path / "p")
    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(probe.ProbeError, match="cannot be read as a probe"):
        probe.LinearProbe.load(tmp_path / "p")


def test_mass_mean_accuracy_as_0103_computes_it(tmp_path, rng):
    """0.10.3's MassMeanClassifier (classifiers.py): raw features, unit difference of means, threshold at the
    midpoint; its accuracy on the same split is ours (the reference environment test repeats this with its code)."""
    X, y = gaussian(rng, n=300, dim=10, shift=0.7)
    tr, te = np.arange(200), np.arange(200, 300)
    mp, mn = X[tr][y[tr] == 1].mean(0), X[tr][y[tr] == 0].mean(0)
    coef = (mp - mn) / np.linalg.norm(mp - mn)
    ref = ((X[te] @ coef - (mp @ coef + mn @ coef) / 2) >= 0).astype(int)
    f = fit(X[tr], y[tr], "mass_mean")
    ours = (X[te] @ f.coef[0] + f.intercept[0] > 0).astype(int)
    assert abs(np.mean(ours == y[te]) - np.mean(ref == y[te])) <= 0.01


REF_MASS_MEAN = """
import json, sys
import numpy as np
from lmprobe.classifiers import build_classifier
X, y = np.load(sys.argv[1], allow_pickle=False), np.load(sys.argv[2], allow_pickle=False)
tr, te = np.arange(int(sys.argv[3])), np.arange(int(sys.argv[3]), len(y))
clf = build_classifier("mass_mean").fit(X[tr], y[tr])
print(json.dumps({"accuracy": float(clf.score(X[te], y[te])), "coef": clf.coef_.tolist()}))
"""


@pytest.mark.slow
def test_mass_mean_agrees_with_0103_in_its_own_environment(tmp_path, rng):
    """0.10.3's ``build_classifier("mass_mean")`` run by 0.10.3 itself (tests/reference/envs.py) on the same split."""
    import json
    import os

    from reference.envs import reference_python

    X, y = gaussian(rng, n=400, dim=24, shift=0.5)
    write(tmp_path / "ds", {3: X}, y)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    (tmp_path / "ref.py").write_text(REF_MASS_MEAN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    r = subprocess.run([str(reference_python()), "-I", str(tmp_path / "ref.py"), str(tmp_path / "X.npy"),
                        str(tmp_path / "y.npy"), "300"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads(r.stdout.strip().splitlines()[-1])
    table = probe.sweep(tmp_path / "ds", method="mass_mean", test=np.arange(300, 400), cv=3)
    assert abs(table["test_accuracy"][0] - ref["accuracy"]) <= 0.01
    p = probe.train_probe(tmp_path / "ds", layer=3, method="mass_mean")
    ours = fit(X[:300], y[:300], "mass_mean").coef[0]
    assert cos(ours, np.asarray(ref["coef"])) >= 0.999 and cos(p.direction, ours) > 0.9
