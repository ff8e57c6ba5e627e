"""Honest evaluation: every metric with its spread, groups, held-out sets, duplicates, baselines, bootstrap,
poolings, contrast pairs, regression, concatenated layers, the transfer matrix."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from support.datasets import write_dataset
from support.features import write

import lmprobe
import lmprobe.probe as probe
from lmprobe.probe.folds import make_folds
from lmprobe.probe.inputs import probe_data

METRICS = ["accuracy", "auroc", "f1", "precision", "recall", "recall_at_1fpr"]


def signal(rng, n=120, dim=8, strength=(0.0, 1.0, 3.0)):
    y = np.arange(n) % 2
    d = rng.normal(size=dim)
    return {layer: rng.normal(size=(n, dim)) + s * np.outer(y, d) for layer, s in enumerate(strength)}, y


def test_sweep_reports_every_metric_with_its_spread_for_every_method_on_the_same_folds(tmp_path, rng):
    X, y = signal(rng)
    write(tmp_path / "ds", X, y)
    t = probe.sweep(tmp_path / "ds", method=["logistic", "mass_mean", "lda"], cv=4, seed=3)
    assert len(t) == 9 and list(t.columns[:4]) == ["layer", "accuracy", "accuracy_std", "auroc"]
    for m in METRICS:
        assert t[m].notna().all() and t[f"{m}_std"].notna().all()
    best = t[t.layer == 2]
    assert (best.accuracy > 0.9).all() and (t[t.layer == 0].accuracy < 0.7).all()
    # mass_mean on the same folds as scikit-learn-free code: the same numbers again
    again = probe.sweep(tmp_path / "ds", method="mass_mean", cv=4, seed=3)
    np.testing.assert_allclose(again.accuracy, t[t.method == "mass_mean"].accuracy)


def test_group_folds_never_split_a_group_and_expose_memorisation(tmp_path, rng):
    """Four paraphrases per item share an item-specific vector and label: folds that split items let the probe
    recognise the item (high accuracy); group folds show there is nothing to learn about the label."""
    items = 40
    item_vec = rng.normal(size=(items, 32))
    item_label = rng.integers(0, 2, items)
    item = np.repeat(np.arange(items), 4)
    X = item_vec[item] + 0.05 * rng.normal(size=(len(item), 32))
    write(tmp_path / "ds", {0: X}, item_label[item], item=[int(i) for i in item])
    folds = make_folds(item_label[item], 5, seed=0, groups=item)
    for train, test in folds:
        assert not set(item[train]) & set(item[test])
    leaky = probe.sweep(tmp_path / "ds", method="mass_mean_iid", cv=5)
    honest = probe.sweep(tmp_path / "ds", method="mass_mean_iid", cv=5, groups="item")
    assert leaky.accuracy[0] > 0.9 and honest.accuracy[0] < 0.7


def test_duplicate_texts_across_folds_are_one_warning_line_with_their_count(tmp_path, rng, caplog):
    X, y = signal(rng, n=40)
    texts = [f"t{i % 30}" for i in range(40)]  # 10 texts twice
    write(tmp_path / "ds", X, y, texts=texts)
    with caplog.at_level(logging.WARNING, logger="lmprobe"):
        probe.sweep(tmp_path / "ds", layers=[2], cv=4, method="mass_mean")
    lines = [r.getMessage() for r in caplog.records if "duplicated" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    n = int(lines[0].split()[0])
    assert 1 <= n <= 10 and "groups='text'" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmprobe"):
        probe.sweep(tmp_path / "ds", layers=[2], cv=4, method="mass_mean", groups="text")
    assert not [r for r in caplog.records if "duplicated" in r.getMessage()]


def test_held_out_rows_column_value_and_another_dataset(tmp_path, rng):
    X, y = signal(rng, n=100)
    split = ["test" if i >= 80 else "train" for i in range(100)]
    write(tmp_path / "ds", X, y, split=split)
    by_value = probe.sweep(tmp_path / "ds", layers=[2], method="mass_mean", test=("split", "test"), cv=4)
    by_rows = probe.sweep(tmp_path / "ds", layers=[2], method="mass_mean", test=np.arange(80, 100), cv=4)
    assert by_value.n_samples[0] == 80
    for m in METRICS:
        assert by_value[f"test_{m}"][0] == by_rows[f"test_{m}"][0]
    # the same held-out rows as a dataset of their own
    write(tmp_path / "held", {k: v[80:] for k, v in X.items()}, y[80:])
    write(tmp_path / "train", {k: v[:80] for k, v in X.items()}, y[:80])
    other = probe.sweep(tmp_path / "train", layers=[2], method="mass_mean", test=tmp_path / "held", cv=4)
    assert other.test_accuracy[0] == by_value.test_accuracy[0] > 0.9
    with pytest.raises(probe.ProbeError, match="selects no row"):
        probe.sweep(tmp_path / "ds", test=("split", "dev"))


def test_a_probe_that_beats_no_baseline_is_visibly_so(tmp_path, rng):
    """Labels that only the text length carries: the activations are noise, and the table says so."""
    n = 80
    y = np.arange(n) % 2
    texts = [("a much longer prompt about nothing at all " if v else "short ") + str(i) for i, v in enumerate(y)]
    X = {0: rng.normal(size=(n, 8)), 1: rng.normal(size=(n, 8))}
    write(tmp_path / "ds", X, y, texts=texts)
    t = probe.sweep(tmp_path / "ds", cv=4, method="logistic", baselines=True)
    assert not t.beats_baselines.any() and (t.over_baseline < 0).all()
    assert set(t.best_baseline) <= {"text_length", "bag_of_words"}
    b = t.attrs["baselines"]
    assert list(b.baseline) == list(probe.BASELINES)
    assert b.set_index("baseline").loc["majority", "accuracy"] == pytest.approx(0.5, abs=0.1)
    assert "--perplexity" in b.set_index("baseline").loc["perplexity", "note"]
    # and with a real signal the probe beats them all (in 64 dimensions a random direction is nearly orthogonal to it)
    X2, y2 = signal(rng, n=80, dim=64, strength=(0.0, 0.5, 1.0))
    write(tmp_path / "sig", X2, y2)
    t2 = probe.sweep(tmp_path / "sig", cv=4, method="mass_mean", baselines=True)
    assert t2.beats_baselines.iloc[-1] and t2.over_baseline.iloc[-1] > 0.3
    one = probe.baselines(tmp_path / "sig", layer=2, method="mass_mean", cv=4)
    assert one.baseline[0] == "probe" and one.accuracy[0] == pytest.approx(t2.accuracy.iloc[-1])
    assert probe.plot_sweep(t2, tmp_path / "p.png").stat().st_size > 5000


def test_bootstrap_intervals_bracket_the_score(tmp_path, rng):
    X, y = signal(rng, strength=(0.5, 0.8, 1.0))
    write(tmp_path / "ds", X, y)
    t = probe.sweep(tmp_path / "ds", method="mass_mean", cv=4, bootstrap=200)
    for m in METRICS:
        assert (t[f"{m}_lo"] <= t[f"{m}_hi"]).all()
    assert ((t.accuracy_lo < t.accuracy) & (t.accuracy < t.accuracy_hi)).all()
    assert (t.accuracy_hi - t.accuracy_lo).max() < 0.4


def test_poolings_match_the_stored_tokens(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=9, layers=(0, 3), dim=4, storage="full_sequence", min_tokens=2)
    ds = lmprobe.load(tmp_path / "ds")
    H, start = src["hidden"][3], src["tok_start"]
    per = [H[start[i]:start[i + 1]] for i in range(9)]
    np.testing.assert_allclose(probe.features(ds, 3, pooling="first"), [p[0] for p in per])
    np.testing.assert_allclose(probe.features(ds, 3, pooling=-2), [p[-2] for p in per])
    np.testing.assert_allclose(probe.features(ds, 3, pooling="max"), [p.max(0) for p in per])
    np.testing.assert_allclose(probe.features(ds, 3, pooling="min"), [p.min(0) for p in per])
    np.testing.assert_allclose(probe.features(ds, 3, pooling="tokens"), H)
    with pytest.raises(probe.ProbeError, match="token position 50 is past the end of 9 prompt"):
        probe.features(ds, 3, pooling=50)
    with pytest.raises(probe.ProbeError, match="extract with --storage full_sequence"):
        write_dataset(tmp_path / "pooled", rng, n=5)
        probe.sweep(tmp_path / "pooled", pooling="max")


def test_token_rows_fold_by_prompt(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=30, layers=(0,), dim=4, storage="full_sequence", min_tokens=2)
    t = probe.sweep(tmp_path / "ds", method="logistic", pooling="tokens", cv=3)
    ds = lmprobe.load(tmp_path / "ds")
    assert t.n_samples[0] == int(ds.token_lengths().sum())
    data = probe_data(ds, pooling="tokens")
    folds = make_folds(data.y, 3, groups=data.groups)
    prompt = np.repeat(np.arange(30), ds.token_lengths())
    for train, test in folds:
        assert not set(prompt[train]) & set(prompt[test])


def test_contrast_pairs_by_column_and_by_two_datasets(tmp_path, rng):
    n, dim = 60, 8
    d = rng.normal(size=dim)
    base = rng.normal(size=(n, dim)) * 3
    pos, neg = base + d, base - d  # each pair differs only along d
    write(tmp_path / "pos", {0: pos}, np.ones(n, int))
    write(tmp_path / "neg", {0: neg}, np.zeros(n, int))
    X = np.empty((2 * n, dim))
    X[0::2], X[1::2] = pos, neg
    y = np.tile([1, 0], n)
    write(tmp_path / "both", {0: X}, y, pair=[int(i) // 2 for i in range(2 * n)])
    p = probe.train_probe(None, layer=0, method="pca", pairs=(tmp_path / "pos", tmp_path / "neg"))
    q = probe.train_probe(tmp_path / "both", layer=0, method="pca", pairs="pair")
    r = probe.train_probe(tmp_path / "both", layer=0, method="pca", pairs=(np.arange(0, 2 * n, 2), np.arange(1, 2 * n, 2)))
    assert abs(np.dot(p.direction, d / np.linalg.norm(d))) > 0.999 and np.dot(q.direction, p.direction) > 0.999
    assert np.dot(r.direction, p.direction) > 0.999
    t = probe.sweep(tmp_path / "both", method=["pca", "mass_mean"], pairs="pair", cv=4)
    assert (t.accuracy > 0.55).all()
    with pytest.raises(probe.ProbeError, match="exactly two rows"):
        probe.sweep(tmp_path / "both", pairs="label")


def test_regression_reports_r2(tmp_path, rng):
    n, dim = 100, 6
    X = rng.normal(size=(n, dim))
    w = rng.normal(size=dim)
    target = X @ w + 0.1 * rng.normal(size=n)
    from lmprobe.format.writer import DatasetWriter

    with DatasetWriter(tmp_path / "ds", layers=[0], dim=dim, model_name="m", columns={"score": "float64"}) as wr:
        wr.add_batch(texts=[f"t{i}" for i in range(n)], num_tokens=np.ones(n, int), columns={"score": target.tolist()},
                     hidden={0: X.astype(np.float32)})
    t = probe.sweep(tmp_path / "ds", task="regression", method="ridge", cv=4, baselines=True, label_column="score")
    assert t.r2[0] > 0.95 and "r2_std" in t and "accuracy" not in t and t.beats_baselines[0]
    p = probe.train_probe(tmp_path / "ds", layer=0, task="regression", method="ridge", label_column="score")
    assert p.score(X, target) > 0.95 and np.dot(p.direction, w / np.linalg.norm(w)) > 0.99
    with pytest.raises(probe.ProbeError, match="task='regression' takes"):
        probe.sweep(tmp_path / "ds", task="regression", method="logistic", label_column="score")


def test_concatenated_layers_are_standardised_per_layer(tmp_path, rng):
    X, y = signal(rng, strength=(0.0, 2.0, 0.0))
    X[2] = X[2] * 1000  # a loud layer with no signal must not drown the quiet one
    write(tmp_path / "ds", X, y)
    p = probe.train_probe(tmp_path / "ds", layer=[1, 2], method="mass_mean")
    assert p.layer == [1, 2] and p.coef.shape == (1, 16)
    Xc = np.concatenate([X[1], X[2]], axis=1)
    assert p.score(Xc, y) > 0.9
    t = probe.sweep(tmp_path / "ds", layers=[2, [1, 2]], method="mass_mean", cv=4)
    assert t.layer.tolist() == [2, "1+2"] and t.accuracy[1] > 0.9 and t.n_features[1] == 16
    p.save(tmp_path / "p")
    assert probe.LinearProbe.load(tmp_path / "p").layer == [1, 2]


def test_transfer_matrix(tmp_path, rng):
    d = rng.normal(size=8)
    for name, flip in (("a", 1), ("b", 1), ("c", -1)):  # c's labels run against the direction
        y = np.arange(60) % 2
        write(tmp_path / name, {0: rng.normal(size=(60, 8)) + 1.5 * flip * np.outer(2 * y - 1, d)}, y)
    m = probe.transfer({k: tmp_path / k for k in "abc"}, layer=0, method="mass_mean", cv=3)
    assert list(m.index) == list(m.columns) == ["a", "b", "c"]
    assert m.loc["a", "a"] > 0.9 and m.loc["a", "b"] > 0.9 and m.loc["a", "c"] < 0.2


def test_negative_layers_are_named_as_the_layers_they_are(tmp_path, rng):
    X, y = signal(rng)
    write(tmp_path / "ds", X, y)
    t = probe.sweep(tmp_path / "ds", layers=[-1, [0, -1]], method="mass_mean", cv=3)
    assert t.layer.tolist() == [2, "0+2"]
