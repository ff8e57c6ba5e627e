"""Nested dicts of numpy, torch or JAX arrays in safetensors files (dotted keys).

>>> from lmprobe.tensors import save_file, load_file
"""

from ..errors import TensorDictError
from .nested import flatten, load_file, save_file, unflatten

__all__ = ["TensorDictError", "flatten", "load_file", "save_file", "unflatten"]
