"""Linear probes on stored activations (needs scikit-learn): features, cross-validated sweeps, a saved probe."""

from ..errors import ProbeError
from .linear import LinearProbe, features, labels, layer_features, mean_hidden, plot_sweep, sweep, train_probe

__all__ = ["LinearProbe", "ProbeError", "features", "labels", "layer_features", "mean_hidden", "plot_sweep", "sweep", "train_probe"]
