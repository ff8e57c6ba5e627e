"""The probe metrics in numpy against scikit-learn's on random predictions, ties included."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn import metrics as skm

from lmprobe.probe.metrics import auroc, classification_scores, r2, recall_at_fpr


@pytest.mark.parametrize("seed", range(5))
def test_binary_metrics_are_scikit_learns(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 200)
    score = np.round(rng.normal(size=200) + y, 1)  # rounded: ties
    pred = (score > 0.5).astype(int)
    got = classification_scores(y, pred, score, [0, 1])
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    assert got["auroc"] == pytest.approx(skm.roc_auc_score(y, score))
    assert got["f1"] == pytest.approx(skm.f1_score(y, pred))
    assert got["precision"] == pytest.approx(skm.precision_score(y, pred))
    assert got["recall"] == pytest.approx(skm.recall_score(y, pred))


def test_recall_at_one_percent_fpr_lets_through_at_most_one_percent_of_negatives():
    neg = np.arange(1000.0)  # 1% of 1000 negatives: the top 10 may pass
    pos = np.array([985.5, 995.5, 2000.0, 3.0])
    y = np.r_[np.zeros(1000), np.ones(4)].astype(bool)
    s = np.r_[neg, pos]
    assert recall_at_fpr(y, s, 0.01) == 0.5  # threshold 989 (10 negatives above it): 995.5 and 2000 pass
    fpr, tpr, _ = skm.roc_curve(y, s)
    assert recall_at_fpr(y, s, 0.01) <= tpr[fpr <= 0.01].max() + 1e-12


def test_multiclass_is_macro_averaged_and_r2_is_scikit_learns():
    rng = np.random.default_rng(0)
    y, pred = rng.integers(0, 3, 90), rng.integers(0, 3, 90)
    got = classification_scores(y, pred, None, [0, 1, 2])
    assert got["f1"] == pytest.approx(skm.f1_score(y, pred, average="macro"))
    assert got["precision"] == pytest.approx(skm.precision_score(y, pred, average="macro"))
    assert np.isnan(got["auroc"]) and np.isnan(got["recall_at_1fpr"])
    t = rng.normal(size=50)
    p = t + np.random.default_rng(1).normal(size=50) * 0.3
    assert r2(t, p) == pytest.approx(skm.r2_score(t, p))
    assert auroc(np.array([True, False]), np.array([1.0, 1.0])) == 0.5
