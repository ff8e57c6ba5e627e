"""Hostile metadata and files (datasets, dictionaries, saev folders), bad input values, existing outputs: clear
errors, nothing opened or lost (docs/security.md, "Files" and "Sizes and JSON")."""

from __future__ import annotations

import builtins
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from support.datasets import edit_index_column, write_dataset

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.errors import ColumnTypeError, FormatError, LmprobeError, OutputExistsError, UnsafePathError
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
    write_dataset(tmp_path / "ds", rng, n=4, logits_topk=2)
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


# ------------------------------------------------------------------ shard headers, sizes, JSON, special files, addresses


def test_a_shard_header_whose_shape_overflows_is_refused(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=4, layers=(0,), dim=8)
    path = tmp_path / "ds/tensors/hidden_layer000_shard000.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["hidden.layer_0"]["shape"] = [2**61, 8]
    header["hidden.layer_0"]["data_offsets"] = [0, 0]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", n) + text + b" " * (n - len(text)) + raw[8 + n:])
    with pytest.raises(FormatError, match="shape"):
        lmprobe.load(tmp_path / "ds").hidden(0)


def test_a_fifo_or_a_folder_in_place_of_a_shard_is_an_error_not_a_hang(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=4, layers=(0, 1))
    shard0 = tmp_path / "ds/tensors/hidden_layer000_shard000.safetensors"
    shard0.unlink()
    os.mkfifo(shard0)
    shard1 = tmp_path / "ds/tensors/hidden_layer001_shard000.safetensors"
    shard1.unlink()
    shard1.mkdir()
    code = "import lmprobe, sys; lmprobe.load(sys.argv[1]).hidden(int(sys.argv[2]))"
    for layer in (0, 1):
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ds"), str(layer)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode != 0 and "not a regular file" in r.stderr, r.stderr
    rep = lmprobe.validate(tmp_path / "ds")
    assert sum("not a regular file" in e for e in rep.errors) == 2


@pytest.mark.parametrize("field", ["dim", "k"])
def test_sizes_from_metadata_are_checked_before_allocating(tmp_path, rng, field):
    write_dataset(tmp_path / "ds", rng, n=4, layers=(0,), logits_topk=3)
    index = tmp_path / "ds" / INDEX
    table = pq.read_table(index)
    meta = dict(table.schema.metadata)
    tensors = json.loads(meta[b"lmprobe:tensors"])
    if field == "dim":
        tensors["hidden_layers"]["dim"] = 10**12
    else:
        tensors["logits_topk"]["k"] = 10**12
    meta[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    pq.write_table(table.replace_schema_metadata(meta), index)
    ds = lmprobe.load(tmp_path / "ds")
    with pytest.raises(FormatError):
        ds.hidden(0) if field == "dim" else ds.logits_topk()


@pytest.mark.parametrize("where", ["prompt", "header", "meta.json", "saev"])
def test_deeply_nested_json_is_a_clear_error(tmp_path, rng, where):
    deep = "[" * 100000 + "]" * 100000
    if where == "prompt":
        (tmp_path / "p.jsonl").write_text('{"text": "fine"}\n' + deep + "\n")
        with pytest.raises(LmprobeError, match="line 2"):
            lmprobe.extract("lmprobe-tiny", tmp_path / "p.jsonl", out=tmp_path / "o")
    elif where == "header":
        write_dataset(tmp_path / "ds", rng, n=3, layers=(0,))
        path = tmp_path / "ds/tensors/hidden_layer000_shard000.safetensors"
        path.write_bytes(struct.pack("<Q", len(deep)) + deep.encode())
        with pytest.raises(FormatError, match="nested"):
            lmprobe.load(tmp_path / "ds").hidden(0)
    elif where == "meta.json":
        from lmprobe.sae import SAEConfig, load_dictionary

        (tmp_path / "d").mkdir()
        (tmp_path / "d/meta.json").write_text(deep)
        with pytest.raises(ValueError, match="nested"):
            load_dictionary(SAEConfig(root_path=tmp_path, dictionary_name="d"))
    else:
        from lmprobe.saev import validate_saev

        (tmp_path / "s").mkdir()
        (tmp_path / "s/metadata.json").write_text(deep)
        (tmp_path / "s/shards.json").write_text("[]")
        assert any("nested" in p for p in validate_saev(tmp_path / "s"))


def test_odd_values_in_metadata_are_clear_errors(tmp_path, rng, capsys):
    from lmprobe.saev import validate_saev

    # a saev folder with patches_per_ex 0
    write_dataset(tmp_path / "src", rng, n=6, storage="full_sequence")
    from lmprobe.saev import export_saev

    folder = export_saev(tmp_path / "src", tmp_path / "dump", context_len=2, quiet=True)
    m = json.loads((folder / "metadata.json").read_text())
    m["patches_per_ex"] = 0
    (folder / "metadata.json").write_text(json.dumps(m))
    assert any("patches_per_ex" in p for p in validate_saev(folder, check_hash=False))
    # a truncated encoder.npz
    from lmprobe.sae import SAEConfig, load_dictionary
    from lmprobe.sae.export import export_sae

    export_sae(layer=0, root=tmp_path / "r", dictionary="d", W_enc=rng.normal(size=(8, 12)).astype(np.float32),
               b_enc=np.zeros(12, np.float32))
    enc = tmp_path / "r/d/layer_0/encoder.npz"
    enc.write_bytes(enc.read_bytes()[:40])
    with pytest.raises(ValueError, match="encoder"):
        load_dictionary(SAEConfig(root_path=tmp_path / "r", dictionary_name="d")).get_layer(0)
    # model and provenance of the wrong type: info still prints, validate says what is wrong
    write_dataset(tmp_path / "ds", rng, n=3)
    index = tmp_path / "ds" / INDEX
    table = pq.read_table(index)
    meta = dict(table.schema.metadata)
    meta[b"lmprobe:model"] = b'"just a string"'
    meta[b"lmprobe:provenance"] = b"[1, 2]"
    pq.write_table(table.replace_schema_metadata(meta), index)
    assert cli_main(["info", str(tmp_path / "ds")]) == 0
    rep = lmprobe.validate(tmp_path / "ds")
    assert any("lmprobe:model" in w for w in rep.errors + rep.warnings)


def test_shard_ids_out_of_range_are_format_errors(tmp_path, rng):
    import pyarrow as pa

    write_dataset(tmp_path / "ds", rng, n=4, storage="full_sequence", min_tokens=2)
    index = tmp_path / "ds" / INDEX
    table = pq.read_table(index)
    ids = table.column("token_shard_ids").to_pylist()
    ids[0][0] = -1
    table = table.set_column(table.column_names.index("token_shard_ids"), "token_shard_ids",
                             pa.array(ids, pa.list_(pa.int64())))
    pq.write_table(table, index)
    with pytest.raises(FormatError):
        lmprobe.load(tmp_path / "ds").token_hidden(0, 0)


def test_symlinks_out_of_the_root_are_refused_everywhere(tmp_path, rng):
    from lmprobe.sae import SAEConfig, load_dictionary
    from lmprobe.sae.export import export_sae
    from lmprobe.saev import SaevDataset, export_saev, validate_saev

    outside = tmp_path / "outside"
    write_dataset(outside, rng, n=4)
    # the index itself
    write_dataset(tmp_path / "ds", rng, n=4)
    (tmp_path / "ds" / INDEX).unlink()
    (tmp_path / "ds" / INDEX).symlink_to(outside / INDEX)
    with pytest.raises(LmprobeError, match="outside"):
        lmprobe.load(tmp_path / "ds")
    assert not lmprobe.validate(tmp_path / "ds").ok
    # an SAE dictionary layer
    W = rng.normal(size=(8, 12)).astype(np.float32)
    export_sae(layer=0, root=tmp_path / "other", dictionary="d", W_enc=W, b_enc=np.zeros(12, np.float32))
    export_sae(layer=1, root=tmp_path / "r", dictionary="d", W_enc=W, b_enc=np.zeros(12, np.float32))
    (tmp_path / "r/d/layer_0").symlink_to(tmp_path / "other/d/layer_0")
    with pytest.raises(ValueError, match="outside"):
        load_dictionary(SAEConfig(root_path=tmp_path / "r", dictionary_name="d")).get_layer(0)
    # a saev shard
    write_dataset(tmp_path / "src", rng, n=8, storage="full_sequence")
    a = export_saev(tmp_path / "src", tmp_path / "a", context_len=2, quiet=True)
    b = export_saev(tmp_path / "src", tmp_path / "b", context_len=2, quiet=True)
    (b / "acts000000.bin").unlink()
    (b / "acts000000.bin").symlink_to(a / "acts000000.bin")
    assert any("outside" in p for p in validate_saev(b))
    with pytest.raises(LmprobeError, match="outside"):
        SaevDataset(b)


@pytest.mark.parametrize("extra", [1, 5, 10**6])
def test_num_tokens_beyond_the_address_lists_is_a_format_error(tmp_path, rng, capsys, extra):
    write_dataset(tmp_path / "ds", rng, n=20, layers=(0,), dim=4, storage="full_sequence", shard_size="256B",
                  token_ids=True)

    def more(n):
        n[3] += extra
        return n

    edit_index_column(tmp_path / "ds", "num_tokens", more)
    with pytest.raises(FormatError, match="row 3: .* token addresses for num_tokens="):
        lmprobe.load(tmp_path / "ds").shards.token_addresses()
    assert cli_main(["export-saev", str(tmp_path / "ds"), "--out", str(tmp_path / "saev"), "--context-len", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_tokens" in err[0] and "lmprobe validate" in err[0], err
    assert not list((tmp_path / "saev").glob("[!.]*"))


def test_validate_of_metadata_listing_huge_numbers_of_layers_counts_the_missing_files(tmp_path, rng):
    import json

    write_dataset(tmp_path / "ds", rng, n=20, layers=(0,), dim=4, storage="full_sequence", shard_size="256B")
    path = tmp_path / "ds" / INDEX
    meta = dict(pq.read_schema(path).metadata)
    tensors = json.loads(meta[b"lmprobe:tensors"])
    n_shards = len(tensors["hidden_layers"]["shards"])
    tensors["hidden_layers"]["layers"] = list(range(20_000))
    meta[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    pq.write_table(pq.read_table(path).replace_schema_metadata(meta), path)
    report = lmprobe.validate(tmp_path / "ds")
    assert not report.ok and report.checked_files == n_shards  # layer 0's files, each checked
    assert len(report.errors) <= 51, len(report.errors)  # listed one by one, then counted
    listed = sum("file is missing" in e for e in report.errors)
    assert report.errors[-1] == (f"... and {19_999 * n_shards - listed:,} more shard files listed in the metadata "
                                 "are missing (20,000 layers listed)")
