"""How a linear probe is fitted: one function per method, each returning a ``Fit`` in activation space.

Every method ends as the same thing, ``score(x) = ((x - mean) / scale) @ coef.T + intercept``, so
that a saved probe predicts with numpy alone whatever fitted it. Methods:

=============== ================================================================= ============
method          direction                                                         needs
=============== ================================================================= ============
logistic        L2 logistic regression on standardised features                   scikit-learn
ridge           ridge classifier (regression: ridge regression), standardised     scikit-learn
mass_mean       mean(class 1) - mean(class 0): geometry-of-truth's MMProbe,        numpy
                0.10.3's ``mass_mean``, steering-vectors' ``mean_aggregator``
mass_mean_iid   inverse within-class covariance x the mass-mean direction          numpy
                (MMProbe ``iid=True``: pinv of the pooled covariance, atol 1e-3)
lda             scikit-learn's LinearDiscriminantAnalysis                          scikit-learn
pca             first principal component of pair differences (RepE, repeng        numpy
                ``pca_diff``) or, without pairs, of the centred features
ccs             Contrast-Consistent Search (Burns et al.; elk, geometry-of-truth)   numpy
                on contrast pairs, each side centred
=============== ================================================================= ============

The direction methods (mass_mean, mass_mean_iid, pca, ccs) see the activations unscaled (one
layer) or with each layer's block centred and divided by one number (several layers concatenated),
so their direction is the formula's. Unsupervised directions (pca, ccs) get their sign from the
labels: the positive class projects higher. Their threshold is the midpoint of the two class means'
projections, as 0.10.3's ``mass_mean`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ProbeError

METHODS = ("logistic", "ridge", "mass_mean", "mass_mean_iid", "lda", "pca", "ccs")
NEEDS_SKLEARN = ("logistic", "ridge", "lda")
DIRECTION_METHODS = ("mass_mean", "mass_mean_iid", "pca", "ccs")  # numpy only
REGRESSION_METHODS = ("ridge", "mass_mean", "pca")


@dataclass
class Fit:
    """A fitted linear map: ``((X - mean) / scale) @ coef.T + intercept``; coef (k, dim), k = 1 for two classes."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: np.ndarray
    classes: list


@dataclass(frozen=True)
class Pairs:
    """Contrast pairs as row numbers of the training features: side ``a[i]`` pairs with side ``b[i]``."""

    a: np.ndarray
    b: np.ndarray


def method_name(method: Any) -> str:
    return method if isinstance(method, str) else type(method).__name__


def check_method(method: Any, *, task: str = "classification", n_classes: int = 2, pairs: Pairs | None = None) -> None:
    """A one-line error for a method that cannot run on this input, before any feature is read."""
    if not isinstance(method, str):
        if not (hasattr(method, "fit") and hasattr(method, "get_params")):
            raise ProbeError(f"method must be one of {', '.join(METHODS)} or a scikit-learn estimator, got {method!r}")
        return
    if method not in METHODS:
        raise ProbeError(f"method must be one of {', '.join(METHODS)} or a scikit-learn estimator, got {method!r}")
    if method in NEEDS_SKLEARN:
        require_sklearn(method)
    if task == "regression" and method not in REGRESSION_METHODS:
        raise ProbeError(f"method {method!r} classifies; task='regression' takes {', '.join(REGRESSION_METHODS)} "
                         "or a scikit-learn regressor")
    if task == "classification" and n_classes > 2 and method not in ("logistic", "ridge", "lda"):
        raise ProbeError(f"method {method!r} finds one direction between two classes; the labels have {n_classes}: "
                         "use method='logistic', 'ridge' or 'lda'")
    if method == "ccs" and pairs is None:
        raise ProbeError("method 'ccs' is fitted on contrast pairs: pass pairs= (a column pairing rows, or two row "
                         "sets / datasets)")


def has_sklearn() -> bool:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return False
    return True


def require_sklearn(what: str) -> None:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise ProbeError(f"{what} needs scikit-learn: pip install 'lmprobe[probe]' (mass_mean, mass_mean_iid, pca "
                         "and ccs run without it)") from None


def preprocessing(X: np.ndarray, method: Any, blocks: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(mean, scale) applied before the method: per-feature standardisation for the fitted classifiers;
    nothing for a direction method on one layer; each layer's block centred and scaled by one number when
    several layers are concatenated (per-layer standardisation: no layer dominates by its norm)."""
    dim = X.shape[1]
    if not isinstance(method, str) or method in ("logistic", "ridge"):
        mean = X.mean(axis=0, dtype=np.float64)
        scale = X.std(axis=0, dtype=np.float64)
        scale[scale == 0] = 1.0
        return mean.astype(np.float32), scale.astype(np.float32)
    if blocks is None or len(blocks) <= 1:
        return np.zeros(dim, np.float32), np.ones(dim, np.float32)
    mean = X.mean(axis=0, dtype=np.float64)
    scale = np.empty(dim)
    start = 0
    for width in blocks:
        part = slice(start, start + width)
        s = float(np.sqrt(((X[:, part] - mean[part]) ** 2).mean()))
        scale[part] = s if s > 0 else 1.0
        start += width
    return mean.astype(np.float32), scale.astype(np.float32)


def fit(X: np.ndarray, y: np.ndarray, method: Any = "logistic", *, task: str = "classification",
        pairs: Pairs | None = None, blocks: Sequence[int] | None = None, seed: int = 0, C: float = 1.0) -> Fit:
    """Fit ``method`` on features ``X`` (N, dim) and labels or targets ``y`` (N,)."""
    X = np.asarray(X, dtype=np.float32)
    y = np.asarray(y)
    classes = [] if task == "regression" else np.unique(y).tolist()
    check_method(method, task=task, n_classes=len(classes), pairs=pairs)
    mean, scale = preprocessing(X, method, blocks)
    Z = (X - mean) / scale  # (N, dim)
    if task == "regression":
        coef, intercept = _regression(Z, y.astype(np.float64), method, seed)
    elif not isinstance(method, str) or method in ("logistic", "ridge", "lda"):
        coef, intercept = _sklearn_classifier(Z, y, method, seed, C)
    else:
        pos = y == classes[1]
        w = {"mass_mean": lambda: mass_mean_direction(Z, pos),
             "mass_mean_iid": lambda: mass_mean_iid_direction(Z, pos),
             "pca": lambda: pca_direction(Z, pairs, pos),
             "ccs": lambda: ccs_direction(Z, pairs, seed=seed)}[method]()
        w, b = resolve_sign(Z, pos, w)
        coef, intercept = w[None], np.array([b])
    return Fit(mean, scale, np.asarray(coef, np.float32), np.asarray(intercept, np.float32).reshape(-1), classes)


# ---------------------------------------------------------------------------------------- directions

def unit(w: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(w))
    if not np.isfinite(n) or n == 0:
        raise ProbeError("the direction is zero: the two classes have the same mean activation")
    return w / n


def mass_mean_direction(Z: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Unit mean(Z[pos]) - mean(Z[~pos])."""
    return unit(Z[pos].mean(axis=0, dtype=np.float64) - Z[~pos].mean(axis=0, dtype=np.float64))


def mass_mean_iid_direction(Z: np.ndarray, pos: np.ndarray, *, atol: float = 1e-3) -> np.ndarray:
    """Unit pinv(Sigma) @ (mu1 - mu0), Sigma the pooled within-class covariance (centred rows / N), eigenvalues
    at or below ``atol`` dropped: geometry-of-truth's ``MMProbe.from_data`` and ``forward(iid=True)``."""
    mu1, mu0 = Z[pos].mean(axis=0, dtype=np.float64), Z[~pos].mean(axis=0, dtype=np.float64)
    A = np.where(pos[:, None], Z - mu1, Z - mu0)  # (N, dim), each row centred on its class mean
    n, dim = A.shape
    d = mu1 - mu0
    if dim <= n:  # eigh of the (dim, dim) covariance
        vals, vecs = np.linalg.eigh(A.T @ A / n)
    else:  # fewer rows than features: the same eigenpairs from the (N, N) Gram matrix
        g_vals, g_vecs = np.linalg.eigh(A @ A.T / n)
        keep = g_vals > atol
        vals = g_vals[keep]
        vecs = (A.T @ g_vecs[:, keep]) / np.sqrt(vals * n)
    keep = vals > atol
    vals, vecs = vals[keep], vecs[:, keep]
    return unit(vecs @ ((vecs.T @ d) / vals))


def pca_direction(Z: np.ndarray, pairs: Pairs | None, pos: np.ndarray) -> np.ndarray:
    """First principal component: of the pair differences (uncentred: the contrast is the direction, as RepE's
    randomly signed differences and repeng's ``pca_diff``), else of the centred features."""
    if pairs is not None:
        a, b = Z[pairs.a].astype(np.float64), Z[pairs.b].astype(np.float64)
        swap = (~pos[pairs.a]) & pos[pairs.b]  # orient each difference from its label-1 side where labels differ
        D = np.where(swap[:, None], b - a, a - b)
    else:
        D = Z - Z.mean(axis=0, dtype=np.float64)
    return unit(_top_singular_vector(D))


def _top_singular_vector(D: np.ndarray) -> np.ndarray:
    n, dim = D.shape
    if dim <= n:
        _, vecs = np.linalg.eigh(D.T @ D)
        return vecs[:, -1]
    _, vecs = np.linalg.eigh(D @ D.T)
    return D.T @ vecs[:, -1]


def ccs_direction(Z: np.ndarray, pairs: Pairs, *, seed: int = 0, epochs: int = 1000, tries: int = 4,
                  lr: float = 1e-2, weight_decay: float = 0.01) -> np.ndarray:
    """Contrast-Consistent Search: p = sigmoid(w . x) on each side of a pair, each side centred (and scaled) on its
    own; loss mean((p_a - (1 - p_b))^2) + mean(min(p_a, p_b)^2), full-batch Adam, the best of ``tries`` starts."""
    if pairs is None or len(pairs.a) < 2:
        raise ProbeError("method 'ccs' needs at least two contrast pairs")
    A = Z[pairs.a].astype(np.float64)
    B = Z[pairs.b].astype(np.float64)
    A = (A - A.mean(0)) / (A.std() or 1.0)
    B = (B - B.mean(0)) / (B.std() or 1.0)
    rng = np.random.default_rng(seed)
    best, best_loss = None, np.inf
    for _ in range(tries):
        w = rng.normal(size=A.shape[1]) / np.sqrt(A.shape[1])
        m, v = np.zeros_like(w), np.zeros_like(w)
        for t in range(1, epochs + 1):
            pa, pb = _sigmoid(A @ w), _sigmoid(B @ w)
            cons = pa - (1 - pb)
            low_a = pa < pb
            low = np.where(low_a, pa, pb)
            # d/dw of mean(cons^2) + mean(low^2), through sigmoid' = p (1 - p)
            ga = 2 * cons + 2 * low * low_a
            gb = 2 * cons + 2 * low * ~low_a
            grad = (A.T @ (ga * pa * (1 - pa)) + B.T @ (gb * pb * (1 - pb))) / len(A) + weight_decay * w
            m = 0.9 * m + 0.1 * grad
            v = 0.999 * v + 0.001 * grad**2
            w -= lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
        pa, pb = _sigmoid(A @ w), _sigmoid(B @ w)
        loss = float(np.mean((pa - (1 - pb)) ** 2) + np.mean(np.minimum(pa, pb) ** 2))
        if loss < best_loss:
            best, best_loss = w, loss
    return unit(best)


def _sigmoid(s: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * s))


def resolve_sign(Z: np.ndarray, pos: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float]:
    """Orient ``w`` so that the positive class projects higher; threshold at the midpoint of the class means."""
    s = Z @ w
    hi, lo = float(s[pos].mean()), float(s[~pos].mean())
    if hi < lo:
        w, hi, lo = -w, -hi, -lo
    return w, -(hi + lo) / 2


def resolve_sign_regression(Z: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float]:
    """Orient ``w`` with the target and map the projection to it by least squares: score = a (w . z) + b."""
    s = Z @ w
    a, b = np.polyfit(s, y, 1) if np.ptp(s) > 0 else (0.0, float(y.mean()))
    return w * a, float(b)


# ---------------------------------------------------------------------------------------- fitted models

def _sklearn_classifier(Z: np.ndarray, y: np.ndarray, method: Any, seed: int, C: float):
    from sklearn.base import clone

    if method == "logistic":
        from sklearn.linear_model import LogisticRegression

        est = LogisticRegression(C=C, max_iter=5000, random_state=seed)
    elif method == "ridge":
        from sklearn.linear_model import RidgeClassifier

        est = RidgeClassifier()
    elif method == "lda":
        from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

        est = LinearDiscriminantAnalysis()
    else:
        est = clone(method)
    est.fit(Z, y)
    return _linear_parts(est, len(np.unique(y)))


def _linear_parts(est: Any, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    coef = getattr(est, "coef_", None)
    if coef is None:
        raise ProbeError(f"{type(est).__name__} has no coef_: a LinearProbe needs a linear scikit-learn estimator")
    coef = np.atleast_2d(np.asarray(coef, dtype=np.float64))
    intercept = np.atleast_1d(np.asarray(getattr(est, "intercept_", np.zeros(len(coef))), dtype=np.float64))
    if n_classes == 2 and len(coef) == 1:  # a unit direction, the same decisions
        n = float(np.linalg.norm(coef))
        if n > 0:
            coef, intercept = coef / n, intercept / n
    return coef, intercept


def _regression(Z: np.ndarray, y: np.ndarray, method: Any, seed: int):
    if method == "ridge":
        require_sklearn("ridge")
        from sklearn.linear_model import Ridge

        est = Ridge(alpha=1.0).fit(Z, y)
        return _linear_parts(est, 0)
    if not isinstance(method, str):
        from sklearn.base import clone

        return _linear_parts(clone(method).fit(Z, y), 0)
    hi = y > np.median(y)
    if hi.all() or not hi.any():
        raise ProbeError("the regression target is constant")
    w = mass_mean_direction(Z, hi) if method == "mass_mean" else pca_direction(Z, None, hi)
    w, b = resolve_sign_regression(Z, y, w)
    return w[None], np.array([b])
