"""Linear probes on stored activations: methods from logistic regression to mass-mean and CCS, honest evaluation
(folds, groups, held-out sets, baselines, intervals), saved probes that predict with numpy alone.

scikit-learn is needed for logistic, ridge and lda and for the text baselines (``pip install lmprobe[probe]``);
mass_mean, mass_mean_iid, pca and ccs run on numpy alone. docs/probing.md is the guide.
"""

from ..errors import ProbeError
from .baselines import BASELINES
from .ensemble import ProbeEnsemble
from .evaluate import baselines, plot_sweep, sweep, train_probe, transfer
from .linear import LinearProbe, features, labels, layer_features, mean_hidden
from .methods import METHODS, has_sklearn
from .steer import steer

__all__ = ["BASELINES", "METHODS", "LinearProbe", "ProbeEnsemble", "ProbeError", "baselines", "features", "has_sklearn", "labels", "layer_features", "mean_hidden",
           "plot_sweep", "steer", "sweep", "train_probe", "transfer"]
