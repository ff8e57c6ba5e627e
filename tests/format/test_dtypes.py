"""lmprobe/format/dtypes.py: every storage dtype as a behaviour (encode, decode, bytes per row), and int8 datasets
read back through every reader of the format layer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors import safe_open
from support.datasets import write_dataset
from support.paths import ROOT

import lmprobe
from lmprobe.errors import ExtractionError, FormatError, InvalidArgumentError
from lmprobe.format.dtypes import COMPUTE_DTYPES, DTYPES, HIDDEN_DTYPES
from lmprobe.format.validate import validate
from lmprobe.format.writer import DatasetWriter

finite = st.floats(float(np.float32(-1e30)), float(np.float32(1e30)), allow_nan=False, allow_infinity=False, width=32)


def test_storage_and_compute_dtypes_are_separate_lists():
    assert "int8" in HIDDEN_DTYPES and "int8" not in COMPUTE_DTYPES
    assert set(COMPUTE_DTYPES) < set(HIDDEN_DTYPES)
    with pytest.raises(ExtractionError, match="compute_dtype"):
        from lmprobe.extraction.config import ExtractionConfig

        ExtractionConfig(model="m", prompts=["a"], out="o", compute_dtype="int8")


def test_bytes_per_row_include_the_scale():
    assert DTYPES["int8"].row_bytes(4096) == 4096 + 4  # 0.5x bfloat16's 8192, plus a float32 scale
    assert DTYPES["bfloat16"].row_bytes(4096) == 8192
    assert DTYPES["float32"].row_bytes(10) == 40


@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=9), elements=finite))
@example(np.zeros((3, 5), np.float32))  # rows of zeros: scale 0, decoded to exact zeros
@example(np.array([[0.0, 1e-3, 3e4, -2.0]], np.float32))  # one huge value in a row
@example(np.array([[-1e30, 1e30]], np.float32))
@example(np.array([[1e-40, -3e-39]], np.float32))  # subnormal values: a subnormal scale
def test_int8_round_trip_is_within_half_a_step_of_each_rows_absmax(x):
    kind = DTYPES["int8"]
    codes, scales = kind.encode(x)
    assert codes.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == x.shape[:1]
    assert np.all(np.abs(codes.astype(np.int32)) <= 127)
    y = kind.decode(codes, scales)
    assert y.dtype == np.float32 and y.shape == x.shape
    step = np.abs(x).max(axis=1, initial=0) / 127
    # half a step of rounding, and float32's relative rounding of the product and the scale
    assert np.all(np.abs(y - x) <= step[:, None] * (0.5 + 1e-5) + 1e-6 * np.abs(x) + 1e-42)
    assert np.array_equal(y[np.all(x == 0, axis=1)], x[np.all(x == 0, axis=1)])
    big = np.argmax(np.abs(x), axis=1) if x.shape[1] else []
    for i, j in enumerate(big):  # each row's largest value is exact up to its scale's rounding
        assert abs(y[i, j] - x[i, j]) <= 1e-6 * abs(x[i, j]) + 1e-42  # (a subnormal scale has fewer digits)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@given(x=hnp.arrays(np.float32, (3, 4), elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False)))
def test_unscaled_round_trips_are_the_casts(dtype, x):
    kind = DTYPES[dtype]
    codes, scales = kind.encode(x)
    assert scales is None and codes.dtype == kind.np_storage
    import torch

    want = torch.from_numpy(x).to(getattr(torch, dtype)).float().numpy()
    np.testing.assert_array_equal(kind.decode(codes), want)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_int8_refuses_nan_and_infinity_naming_the_row(tmp_path, bad):
    x = np.ones((3, 4), np.float32)
    x[2, 1] = bad
    w = DatasetWriter(tmp_path / "ds", layers=[5], dim=4, model_name="m", dtype="int8")
    with pytest.raises(InvalidArgumentError, match=r"hidden\[5\].*row 2.*NaN or infinity"):
        w.add_batch(texts=["a", "b", "c"], num_tokens=[1, 1, 1], hidden={5: x})
    w.abort()


@pytest.mark.parametrize("storage", ["pooled", "full_sequence"])
def test_int8_dataset_reads_back_decoded_on_every_format_path(tmp_path, rng, storage):
    src = write_dataset(tmp_path / "ds", rng, n=19, layers=(0, 3), dim=6, storage=storage, shard_size=60,
                        dtype="int8", statistics=True)
    ds = lmprobe.load(tmp_path / "ds")
    assert ds.dtype == "int8" and ds.meta.raw["format_version"] == "3.0"
    h = ds.meta.hidden
    assert h.raw["scale_key_pattern"] == "hidden.layer_{layer}.scale" and h.row_bytes == 6 + 4
    assert len(h.shards) > 2  # several shards, so that gathers cross files
    kind = DTYPES["int8"]
    want = {layer: kind.decode(*kind.encode(x)) for layer, x in src["hidden"].items()}
    last = src["tok_start"][1:] - 1 if storage == "full_sequence" else np.arange(19)
    for layer in (0, 3):
        got = ds.hidden(layer)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want[layer][last])
        np.testing.assert_array_equal(ds.hidden(layer, [4, 1]), want[layer][last[[4, 1]]])
        t = ds.hidden(layer, as_torch=True)
        assert str(t.dtype) == "torch.float32"
        np.testing.assert_array_equal(t.numpy(), want[layer][last])
        # the error against the float32 input: half a step of each row's absmax
        step = np.abs(src["hidden"][layer][last]).max(axis=1) / 127
        assert np.all(np.abs(got - src["hidden"][layer][last]) <= 0.51 * step[:, None])
    if storage == "full_sequence":
        s = src["tok_start"]
        np.testing.assert_array_equal(ds.token_hidden(7, 3), want[3][s[7] : s[8]])
    stats = ds.statistics(3)  # of the decoded values, not of the float32 input
    np.testing.assert_allclose(stats["mean"], want[3].astype(np.float64).mean(axis=0), rtol=1e-5, atol=1e-6)
    rep = validate(tmp_path / "ds", checksums=True)
    assert rep.ok, rep.errors


def test_int8_shards_hold_codes_and_scales_under_the_descriptors_keys(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=5, layers=(2,), dim=4, dtype="int8")
    ds = lmprobe.load(tmp_path / "ds")
    h = ds.meta.hidden
    with safe_open(str(tmp_path / "ds" / h.file(2, 0)), "np") as f:
        assert set(f.keys()) == {h.key(2), h.scale_key(2)}
        codes, scales = f.get_tensor(h.key(2)), f.get_tensor(h.scale_key(2))
    assert codes.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == codes.shape[:1]
    np.testing.assert_array_equal(codes.astype(np.float32) * scales[:, None], ds.hidden(2))


def test_int8_metadata_under_format_2_is_refused(tmp_path, rng):
    """A reader of format 2 would return the codes as values: a 2.x int8 descriptor is damaged metadata."""
    import pyarrow.parquet as pq

    write_dataset(tmp_path / "ds", rng, n=5, layers=(2,), dim=4, dtype="int8")
    path = tmp_path / "ds/index/train-00000-of-00001.parquet"
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    meta[b"lmprobe:format_version"] = json.dumps("2.0").encode()
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(FormatError, match="int8.*3.0"):
        lmprobe.load(tmp_path / "ds").hidden(2)


def test_validator_wants_the_scales(tmp_path, rng):
    from safetensors.numpy import save_file

    write_dataset(tmp_path / "ds", rng, n=5, layers=(2,), dim=4, dtype="int8")
    h = lmprobe.load(tmp_path / "ds").meta.hidden
    f = tmp_path / "ds" / h.file(2, 0)
    with safe_open(str(f), "np") as g:
        codes = g.get_tensor(h.key(2))
    save_file({h.key(2): codes}, str(f))  # the scales dropped
    rep = validate(tmp_path / "ds")
    assert any("hidden.layer_2.scale" in e and "missing" in e for e in rep.errors), rep.errors


def test_the_job_plan_sizes_int8_rows_as_the_dtype_does(tmp_path):
    """The plan (and --dry-run) counts a row as the dtype's bytes: width codes and a float32 scale, as written."""

    prompts = ROOT / "examples" / "prompts.jsonl"
    kw = {"storage": "full_sequence", "dtype": "int8"}
    plan = lmprobe.plan("lmprobe-tiny", str(prompts), out=str(tmp_path / "o"), **kw)
    ds = lmprobe.extract("lmprobe-tiny", str(prompts), out=str(tmp_path / "o"), quiet=True, **kw)
    rows = int(ds.column("num_tokens").sum()) + ds.num_prompts
    assert plan.site_bytes[0] == rows * (ds.dim + 4)
    bf16 = lmprobe.plan("lmprobe-tiny", str(prompts), out=str(tmp_path / "b"), storage="full_sequence",
                        dtype="bfloat16")
    assert plan.site_bytes[0] / bf16.site_bytes[0] == (ds.dim + 4) / (2 * ds.dim)


def test_the_command_line_stores_int8_and_refuses_it_as_a_compute_dtype(tmp_path, capsys):
    from lmprobe.cli import main as cli_main

    (tmp_path / "p.txt").write_text("the cat sat\na dog ran far\n")
    base = ["extract", "--model", "lmprobe-tiny", "--prompts", str(tmp_path / "p.txt"), "--quiet"]
    assert cli_main([*base, "--out", str(tmp_path / "o"), "--dtype", "int8"]) == 0
    assert lmprobe.load(tmp_path / "o").dtype == "int8"
    with pytest.raises(SystemExit) as e:
        cli_main([*base, "--out", str(tmp_path / "c"), "--compute-dtype", "int8"])
    assert e.value.code == 2 and "int8" in capsys.readouterr().err
