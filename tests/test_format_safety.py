"""Hostile metadata, bad input values, existing outputs: clear errors, nothing opened or lost."""

from __future__ import annotations

import builtins
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import write_dataset

import lmprobe
from lmprobe.errors import ColumnTypeError, OutputExistsError, UnsafePathError
from lmprobe.format.validate import validate
from lmprobe.format.writer import DatasetWriter

INDEX = "index/train-00000-of-00001.parquet"


def _rewrite_tensors(root, edit):
    path = root / INDEX
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    tensors = json.loads(meta[b"lmprobe:tensors"])
    edit(tensors)
    meta[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    pq.write_table(table.replace_schema_metadata(meta), path)


@pytest.mark.parametrize(
    "pattern",
    [
        "../outside/h{layer}_{shard}.safetensors",
        "/etc/h{layer}_{shard}.safetensors",
        "tensors/{layer.__class__}_{shard}.safetensors",
        "tensors/{layer}_{shard[0]}.safetensors",
        "tensors/{layer!r}_{shard}.safetensors",
        "tensors/{layer}_{shard}_{0}.safetensors",
        "tensors/{layer:>{shard}}.safetensors",
        "tensors\\..\\..\\h{layer}{shard}",
    ],
)
def test_hostile_file_pattern_is_refused_before_any_file_opens(tmp_path, rng, monkeypatch, pattern):
    write_dataset(tmp_path / "ds", rng, n=4)
    _rewrite_tensors(tmp_path / "ds", lambda t: t["hidden_layers"].__setitem__("file_pattern", pattern))
    opened = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (opened.append(str(f)), real_open(f, *a, **k))[1])
    with pytest.raises(UnsafePathError):
        lmprobe.load(tmp_path / "ds").hidden(0)
    assert not any("safetensors" in f for f in opened)
    monkeypatch.setattr(builtins, "open", real_open)
    rep = validate(tmp_path / "ds")
    assert not rep.ok and "file_pattern" in rep.errors[0]


def test_hostile_key_pattern_is_refused(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=4)
    _rewrite_tensors(tmp_path / "ds", lambda t: t["hidden_layers"].__setitem__("key_pattern", "{layer.__init__.__globals__}"))
    with pytest.raises(UnsafePathError, match="key_pattern"):
        lmprobe.load(tmp_path / "ds")


def test_logits_file_outside_root_is_refused(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=4, logits_k=2)
    _rewrite_tensors(tmp_path / "ds", lambda t: t["logits_topk"]["shards"][0].__setitem__("file", "../../secret"))
    with pytest.raises(UnsafePathError, match=r"\.\."):
        lmprobe.load(tmp_path / "ds")


def test_symlink_out_of_the_root_is_refused(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=4)
    outside = tmp_path / "elsewhere"
    (tmp_path / "ds/tensors").rename(outside)
    os.symlink(outside, tmp_path / "ds/tensors")
    with pytest.raises(UnsafePathError, match="outside the dataset root"):
        lmprobe.load(tmp_path / "ds").hidden(0)
    assert not validate(tmp_path / "ds").ok


def test_malformed_descriptor_values_are_clear_errors(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=4)
    _rewrite_tensors(tmp_path / "ds", lambda t: t["hidden_layers"]["shards"][0].__setitem__("num_prompts", "many"))
    with pytest.raises(ValueError, match=r"shards\[0\]\.num_prompts"):
        lmprobe.load(tmp_path / "ds")


def test_shard_header_lying_about_its_size_is_refused(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=4)
    p = tmp_path / "ds/tensors/hidden_layer000_shard000.safetensors"
    data = bytearray(p.read_bytes())
    data[0:8] = (10**12).to_bytes(8, "little")
    p.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="header length"):
        lmprobe.load(tmp_path / "ds").hidden(0)


def test_bad_user_column_value_names_row_and_column_and_writes_nothing(tmp_path):
    w = DatasetWriter(tmp_path / "ds", layers=[0], dim=2, model_name="m", columns={"year": "int64"}, label_type="int")
    w.add_batch(texts=["a", "b"], num_tokens=[1, 1], hidden={0: np.zeros((2, 2))}, labels=[0, 1],
                columns={"year": [2020, 2021]})
    with pytest.raises(ColumnTypeError, match=r"row 3, column 'year'.*'twenty'"):
        w.add_batch(texts=["c", "d"], num_tokens=[1, 1], hidden={0: np.ones((2, 2))}, labels=[0, 1],
                    columns={"year": [2022, "twenty"]})
    with pytest.raises(ColumnTypeError, match=r"row 2, column 'label'"):
        w.add_batch(texts=["c"], num_tokens=[1], hidden={0: np.ones((1, 2))}, labels=["pos"], columns={"year": [1]})
    assert w.num_prompts == 2
    w.add_batch(texts=["e"], num_tokens=[1], hidden={0: np.full((1, 2), 7.0)}, labels=[1], columns={"year": [1999]})
    w.close()
    ds = lmprobe.load(tmp_path / "ds")
    assert ds.index["year"].tolist() == [2020, 2021, 1999]
    np.testing.assert_array_equal(ds.hidden(0)[2], [7.0, 7.0])


def test_bad_shapes_and_layers_are_clear_errors(tmp_path):
    w = DatasetWriter(tmp_path / "ds", layers=[0, 1], dim=3, model_name="m")
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        w.add_batch(texts=["a"], num_tokens=[1], hidden={0: np.zeros((1, 3))})
    with pytest.raises(ValueError, match=r"hidden\[1\] has shape \(1, 4\)"):
        w.add_batch(texts=["a"], num_tokens=[1], hidden={0: np.zeros((1, 3)), 1: np.zeros((1, 4))})
    with pytest.raises(ValueError, match="layers must be"):
        DatasetWriter(tmp_path / "x", layers=[-1], dim=3, model_name="m")
    with pytest.raises(ValueError, match="reserved|collides"):
        DatasetWriter(tmp_path / "y", layers=[0], dim=3, model_name="m", columns={"shard_index": "int64"})
    with pytest.raises(ValueError, match="cannot read 'lots' as a size"):
        DatasetWriter(tmp_path / "z", layers=[0], dim=3, model_name="m", shard_size="lots")
    w.abort()


def test_existing_outputs_are_never_clobbered_silently(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=4)
    with pytest.raises(OutputExistsError, match="overwrite"):
        DatasetWriter(tmp_path / "ds", layers=[0], dim=2, model_name="m")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes/thesis.tex").write_text("precious")
    with pytest.raises(OutputExistsError, match="not empty"):
        DatasetWriter(tmp_path / "notes", layers=[0], dim=2, model_name="m", overwrite=True)
    assert (tmp_path / "notes/thesis.tex").read_text() == "precious"
    # overwrite replaces what lmprobe wrote and keeps what it did not
    (tmp_path / "ds/saev").mkdir()
    (tmp_path / "ds/saev/keep.txt").write_text("mine")
    with DatasetWriter(tmp_path / "ds", layers=[9], dim=2, model_name="m", overwrite=True) as w:
        w.add_batch(texts=["z"], num_tokens=[1], hidden={9: np.zeros((1, 2))})
    assert lmprobe.load(tmp_path / "ds").layers == [9]
    assert not list((tmp_path / "ds/tensors").glob("hidden_layer000*"))
    assert (tmp_path / "ds/saev/keep.txt").read_text() == "mine"


def test_unknown_column_and_unlabeled_label(tmp_path):
    w = DatasetWriter(tmp_path / "ds", layers=[0], dim=2, model_name="m")
    with pytest.raises(ColumnTypeError, match="unknown user column"):
        w.add_batch(texts=["a"], num_tokens=[1], hidden={0: np.zeros((1, 2))}, columns={"x": [1]})
    w.add_batch(texts=["a"], num_tokens=[1], hidden={0: np.zeros((1, 2))})
    w.close()
    assert lmprobe.load(tmp_path / "ds").labels is None
