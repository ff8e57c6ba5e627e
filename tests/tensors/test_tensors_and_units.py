"""Nested tensor dicts in safetensors, and human byte sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmprobe.base.units import format_size, parse_size
from lmprobe.tensors import TensorDictError, flatten, load_file, save_file, unflatten


def test_nested_dict_round_trip_numpy_and_torch(tmp_path):
    tree = {
        "output_head": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)},
        "blocks": [{"w": np.ones(2, dtype=np.float16)}, {"w": np.zeros(2, dtype=np.float16)}],
        "bias": torch.tensor([1.0, 2.0]),
    }
    save_file(tree, tmp_path / "m.safetensors")
    flat = load_file(tmp_path / "m.safetensors", nested=False)
    assert sorted(flat) == ["bias", "blocks.0.w", "blocks.1.w", "output_head.kernel"]
    back = load_file(tmp_path / "m.safetensors")
    np.testing.assert_array_equal(back["output_head"]["kernel"], tree["output_head"]["kernel"])
    assert isinstance(back["blocks"], list) and back["blocks"][1]["w"].dtype == np.float16
    np.testing.assert_array_equal(back["bias"], [1.0, 2.0])
    pt = load_file(tmp_path / "m.safetensors", framework="pt")
    assert isinstance(pt["bias"], torch.Tensor)


def test_bfloat16_through_the_torch_path(tmp_path):
    save_file({"a": {"b": torch.ones(3, dtype=torch.bfloat16)}}, tmp_path / "x.safetensors", framework="pt")
    assert load_file(tmp_path / "x.safetensors", framework="pt")["a"]["b"].dtype == torch.bfloat16


def test_non_array_leaf_names_its_key_path(tmp_path):
    with pytest.raises(TensorDictError, match=r"encoder\.config: expected an array"):
        save_file({"encoder": {"weight": np.ones(2), "config": object()}}, tmp_path / "x.safetensors")
    with pytest.raises(TensorDictError, match=r"a\.b: expected an array.*str"):
        save_file({"a": {"b": "hello"}}, tmp_path / "x.safetensors")
    with pytest.raises(TensorDictError, match="contains '.'"):
        flatten({"a.b": np.ones(1)})
    assert not (tmp_path / "x.safetensors").exists()


def test_unflatten_inverts_flatten():
    tree = {"a": {"b": [1, 2], "c": {"d": 3}}}
    assert unflatten(flatten(tree)) == tree


@pytest.mark.parametrize("text,n", [("512MB", 512_000_000), ("2KB", 2000), ("1GiB", 2**30), ("1.5 KiB", 1536),
                                    (4096, 4096), ("100", 100), ("7b", 7)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "12 parsecs", "-5MB", 0, "MB", True])
def test_parse_size_errors(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size():
    assert format_size(512) == "512 B" and format_size(1536) == "1.5 KiB" and format_size(3 * 2**30) == "3.0 GiB"
